"""``actorserve autoscaler status`` (control/ops/autoscaler_cli.py): the report built from etcd listings (pure),
its text form, the parser, and exit 3 when etcd does not answer."""

from __future__ import annotations

import json

from control.ops.autoscaler_cli import build_report, format_report
from control.ops.cli import build_parser
from control.state import names


def raw():
    return {
        "leader": {"id": "autoscaler-h-1", "pid": 1, "since": 0.0},
        "desired": {names.desired_key("validator"): {"count": 2, "ts": 10.0, "reason": "validator wait p90 400 ms > "
                                                     "200 ms", "by": "autoscaler-h-1"},
                    names.desired_key("worker", "m", "1", "local"): {"count": 1, "ts": 11.0, "reason": "r"}},
        "workers": {names.worker_key("m", "1", "w0"): {"pool": "local"}, names.worker_key("m", "1", "w1"): {},
                    names.worker_key("m", "2", "w2"): {"pool": "local"}},
        "metrics": {names.metrics_key("validator", "validator-1"): {}, names.metrics_key("gateway", "gw-0"): {},
                    names.metrics_key("worker", "w0"): {}},
        "decisions": {"decisions": [{"ts": float(i), "loop": "cpu", "target": "validator", "current": 1,
                                     "desired": 2, "reason": f"d{i}", "inputs": {"wait": 400.0}} for i in range(5)]},
    }


def test_report_desired_against_actual():
    rep = build_report(raw(), last=3)
    t = rep["targets"]
    assert t["validator"]["desired"] == 2 and t["validator"]["actual"] == 1
    assert t["validator"]["reason"].startswith("validator wait p90")
    assert t["gateway"] == {"desired": None, "actual": 1, "reason": "", "ts": None}
    assert t["worker/m/1/local"]["desired"] == 1 and t["worker/m/1/local"]["actual"] == 1
    assert t["worker/m/1/default"]["actual"] == 1 and t["worker/m/2/local"]["desired"] is None
    assert [d["reason"] for d in rep["decisions"]] == ["d2", "d3", "d4"]  # newest last
    assert rep["active"]["id"] == "autoscaler-h-1"
    json.dumps(rep)  # --json prints it as is


def test_report_text():
    text = format_report(build_report(raw(), last=2))
    assert "active autoscaler: autoscaler-h-1" in text
    assert any(line.split()[:3] == ["validator", "2", "1"] for line in text.splitlines())
    assert "[cpu] validator 1 -> 2: d4" in text and "inputs: wait=400.0" in text
    empty = format_report(build_report({}))
    assert "active autoscaler: none" in empty and "no decisions yet" in empty


def test_status_parses_and_reports_an_unreachable_etcd(capsys, monkeypatch):
    """A closed port refuses at once: exit 3 with one line (about 0.1 s)."""
    import socket

    monkeypatch.delenv("ACTORSERVE_ETCD", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening, then closed: connections are refused
    args = build_parser().parse_args(["autoscaler", "status", "--json", "--last", "4", "--etcd",
                                      f"http://127.0.0.1:{port}"])
    assert args.json and args.last == 4
    assert args.func(args) == 3
    assert "stack unreachable" in capsys.readouterr().err
