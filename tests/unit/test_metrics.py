"""Pure metric helpers: label cardinality, completion record -> observations, worker gauges, lag probe, keys."""

from __future__ import annotations

import argparse

import pytest

from actors.metrics import LabelLimiter, LagProbe, WorkerGauges, actor_identity, record_observations
from bus.messages import WorkerStats
from control.state.names import all_metrics_prefix, metrics_key


def test_label_limiter_caps_distinct_values():
    lim = LabelLimiter(3)
    assert [lim(t) for t in ("a", "b", "a", "c", "d", "e", "b")] == ["a", "b", "a", "c", "other", "other", "b"]
    assert lim("") == "other"  # "none" would be a 4th value
    assert LabelLimiter(2)(None) == "none"
    assert LabelLimiter(0)("a") == "other"
    with pytest.raises(ValueError):
        LabelLimiter(-1)


def test_record_observations_seconds():
    obs = record_observations({"validation_ms": 2.0, "queue_ms": 10.0, "prefill_ms": 30.0, "decode_ms": 90.0}, 10)
    assert obs == pytest.approx({"queue": 0.010, "prefill": 0.030, "decode": 0.090, "ttft": 0.042,
                                 "e2e": 0.132, "itl": 0.010})


def test_record_observations_partial_and_bad_values():
    assert record_observations(None, 5) == {}
    assert record_observations({"queue_ms": "x", "prefill_ms": -1, "decode_ms": True}, 5) == {}
    obs = record_observations({"prefill_ms": 20.0, "decode_ms": 0.0}, 1)
    assert obs == pytest.approx({"prefill": 0.02, "decode": 0.0, "ttft": 0.02, "e2e": 0.02})  # no itl with 1 token


def _stats(steps, gen, prompt, free, running=2, waiting=1, wid="w1"):
    return WorkerStats(wid, "m", "1", steps, gen, prompt, running, waiting, free, 100, 4)


def test_worker_gauges_rates_and_staleness():
    g = WorkerGauges(stale_s=5.0)
    r = g.update(_stats(10, 20, 100, 75), now=100.0)
    assert r["kv"] == 0.25 and r["gen_tps"] == 0.0 and r["labels"] == {"model": "m@1", "worker": "w1"}
    r = g.update(_stats(20, 50, 300, 50), now=102.0)
    assert r["kv"] == 0.5 and r["gen_tps"] == 15.0 and r["prompt_tps"] == 100.0 and r["batch"] == 3.0
    assert r["running"] == 2 and r["waiting"] == 1 and r["max_batch"] == 4
    assert len(g.rows(now=106.0)) == 1
    assert g.rows(now=108.0) == []


def test_lag_probe_max_of_window():
    p = LagProbe(window=3)
    assert p.value == 0.0
    for v in (0.01, -0.5, 0.2, 0.03, 0.02):
        p.add(v)
    assert p.value == 0.2
    p.add(0.0)
    assert p.value == 0.03


def test_metrics_key_and_identity():
    assert all_metrics_prefix() == "/actorserve/metrics/"
    assert metrics_key("worker", "worker-0") == "/actorserve/metrics/worker/worker-0"
    with pytest.raises(ValueError):
        metrics_key("worker", "a.b")
    assert actor_identity(argparse.Namespace(worker_id="Host.X-1"), "worker") == "host-x-1"
    assert actor_identity(argparse.Namespace(), "validator").startswith("validator-")
