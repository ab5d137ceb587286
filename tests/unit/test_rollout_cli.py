"""``actorserve rollout ...`` parsing and status formatting (pure; the etcd path is in
tests/integration/test_rollout_controller.py)."""

from __future__ import annotations

import argparse

import pytest

from control.ops.cli import ACTOR_MODULES, MODEL_ACTORS, build_parser
from control.ops.rollout_cli import analysis_from_args, format_status, parse_steps, status_report
from control.state.routing import RoutingTable, set_weight, start_rollout


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def rejects(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as ei:
        parse(*argv)
    assert ei.value.code == 2
    return capsys.readouterr().err


def test_rollout_actor_is_registered_and_not_a_model_actor():
    assert ACTOR_MODULES["rollout"] == "actors.rollout.actor"
    assert "rollout" not in MODEL_ACTORS
    a = parse("actor", "rollout", "--etcd", "http://127.0.0.1:1", "--interval-s", "0.2")
    assert a.actor_kind == "rollout" and a.interval_s == 0.2 and a.lease_ttl == 2


def test_start_parses_every_option():
    a = parse("rollout", "start", "m", "--canary", "2", "--weight", "5", "--sticky", "tenant", "--steps",
              "5,20,100", "--window-s", "4", "--min-samples", "6", "--step-interval-s", "1",
              "--max-error-rate-delta", "0.1", "--max-ttft-p95-ratio", "2", "--max-itl-p95-ratio", "3",
              "--ttft-slack-ms", "10", "--itl-slack-ms", "5", "--etcd", "http://127.0.0.1:1")
    assert (a.name, a.canary, a.weight, a.sticky, a.steps, a.stable) == ("m", "2", 5.0, "tenant", [5.0, 20.0, 100.0],
                                                                          None)
    assert analysis_from_args(a) == {"window_s": 4.0, "min_samples": 6, "step_interval_s": 1.0,
                                     "max_error_rate_delta": 0.1, "max_ttft_p95_ratio": 2.0, "max_itl_p95_ratio": 3.0,
                                     "ttft_slack_ms": 10.0, "itl_slack_ms": 5.0}
    assert a.func is not None


def test_start_defaults_keep_analysis_defaults():
    a = parse("rollout", "start", "m", "--canary", "2")
    assert a.weight is None and a.steps is None and a.sticky == "request"
    assert analysis_from_args(a) == {}
    assert analysis_from_args(parse("rollout", "start", "m", "--canary", "2", "--manual")) == {"auto": False}


def test_start_rejects_bad_input(capsys):
    assert "--canary" in rejects(capsys, "rollout", "start", "m")
    assert "percentage" in rejects(capsys, "rollout", "start", "m", "--canary", "2", "--weight", "120")
    assert "ascending" in rejects(capsys, "rollout", "start", "m", "--canary", "2", "--steps", "50,25,100")
    assert "end at 100" in rejects(capsys, "rollout", "start", "m", "--canary", "2", "--steps", "5,50")
    assert "invalid choice" in rejects(capsys, "rollout", "start", "m", "--canary", "2", "--sticky", "user")
    assert "invalid int" in rejects(capsys, "rollout", "start", "m", "--canary", "2", "--min-samples", "x")
    a = parse("rollout", "start", "m", "--canary", "2", "--max-error-rate-delta", "2")
    with pytest.raises(ValueError, match="max_error_rate_delta"):
        analysis_from_args(a)


def test_parse_steps():
    assert parse_steps("10, 50,100") == [10.0, 50.0, 100.0]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_steps("a,100")


def test_other_subcommands_parse(capsys):
    assert parse("rollout", "promote", "m").rollout_command == "promote"
    assert parse("rollout", "rollback", "m").name == "m"
    assert parse("rollout", "set-weight", "m", "40").weight == 40.0
    a = parse("rollout", "status", "m", "--json", "--state-dir", "/tmp/x")
    assert a.json and a.state_dir == "/tmp/x"
    assert "required" in rejects(capsys, "rollout")


def test_status_shows_the_decision_log_newest_last():
    t = start_rollout(RoutingTable(), stable="1", canary="2", weight=5, analysis={"min_samples": 7}, now=100.0)
    t = set_weight(t, 25, by="controller", reasons=["healthy at 5%: canary weight 5% -> 25%",
                                                     "error rate: canary 0.0% (0/7) vs stable 0.0% (0/30)"], now=110.0)
    report = status_report("m", t, ["1", "2"])
    assert report["effective_analysis"]["min_samples"] == 7 and report["canary"] == "2"
    text = format_status(report, now=120.0)
    assert "canary:   2 at 25%" in text and "stable:   1" in text
    assert "min 7 requests per side" in text and "(20 s ago)" in text
    lines = text.splitlines()
    i_start = next(i for i, ln in enumerate(lines) if "start    by" in ln)
    i_step = next(i for i, ln in enumerate(lines) if "step     by" in ln)
    assert i_start < i_step and "by controller" in lines[i_step] and "weight 25%" in lines[i_step]
    assert "      - error rate: canary 0.0% (0/7) vs stable 0.0% (0/30)" in lines


def test_status_of_an_idle_model():
    text = format_status(status_report("m", RoutingTable(), ["1", "3"]))
    assert "state:    idle" in text and "highest active: 3" in text and "decisions: none" in text
