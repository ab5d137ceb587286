"""Pure tests of control/ops/diagnose.py and the snapshot building of control/ops/diagnose_cli.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from control.ops import diagnose_cli as cli
from control.ops import diagnose as p


def snap(*, v_cpu=0.05, v_lag=0.005, g_cpu=0.1, g_lag=0.005, workers=None, sched_queue=0.0, lat=None):
    return p.Snapshot(
        window_s=5.0,
        actors=(p.ActorFigures("gateway", "gw-0", g_cpu, g_lag), p.ActorFigures("validator", "validator-1", v_cpu, v_lag),
                p.ActorFigures("scheduler", "s-0", 0.03, 0.004)),
        workers=tuple(workers if workers is not None else [p.WorkerFigures("w-0", "tiny@1", 2, 0, 0.3, 2.0, 2, 100)]),
        scheduler_queue=sched_queue, latency=lat)


QUEUE_HEAVY = p.Latency(requests=20, ttft=2.1, e2e=2.4, queue=2.0, prefill=0.05, decode=0.3)
VALIDATION_HEAVY = p.Latency(requests=20, ttft=1.1, e2e=1.2, queue=0.02, prefill=0.02, decode=0.1)
LIGHT = p.Latency(requests=20, ttft=0.03, e2e=0.12, queue=0.002, prefill=0.02, decode=0.09)


def test_breakdown_shares_sum_to_one_and_derive_validation_and_gateway():
    bd = p.breakdown(p.Latency(requests=1, ttft=0.5, e2e=1.0, queue=0.2, prefill=0.1, decode=0.6))
    assert bd["validation"]["mean_s"] == pytest.approx(0.1)
    assert bd["gateway"]["mean_s"] == pytest.approx(0.1)  # 0.5 - (0.1 + 0.2 + 0.1)
    assert sum(b["share"] for b in bd.values()) == pytest.approx(1.0)
    assert p.breakdown(None) == {} and p.breakdown(p.Latency(requests=0)) == {}


def test_accelerator_bound_full_slots_and_queue_dominant():
    d = p.diagnose(snap(sched_queue=10, lat=QUEUE_HEAVY))
    assert d.bottleneck == p.WORKER and d.saturated == [p.WORKER]
    assert d.dominant_stage == "queue"
    assert "accelerator-bound" in d.summary and "CPU tier low" in d.summary
    assert d.actions[0].tier == p.WORKER and "shed" in d.actions[0].action
    assert any("max-num-seqs" in a.action for a in d.actions)
    assert "add workers" in d.actions[-1].action


def test_accelerator_bound_by_kv_recommends_kv_before_batch():
    w = p.WorkerFigures("w-0", "tiny@1", running=3, waiting=2, kv_usage=0.97, batch_size=3.0, max_batch_size=8)
    d = p.diagnose(snap(workers=[w], sched_queue=4, lat=QUEUE_HEAVY))
    assert d.bottleneck == p.WORKER
    texts = [a.action for a in d.actions]
    assert "kv-cache-bytes" in texts[1] and not any("max-num-seqs" in t for t in texts)


def test_validator_cpu_saturated_means_add_validators():
    d = p.diagnose(snap(v_cpu=0.98, lat=LIGHT))
    assert d.bottleneck == p.VALIDATOR and d.saturated == [p.VALIDATOR]
    assert "add validators" in d.actions[0].action


def test_validator_lag_or_validation_share_alone_suffices():
    assert p.diagnose(snap(v_lag=0.5, lat=LIGHT)).bottleneck == p.VALIDATOR
    d = p.diagnose(snap(v_cpu=0.6, lat=VALIDATION_HEAVY))
    assert d.bottleneck == p.VALIDATOR and d.dominant_stage == "validation"


def test_small_validation_share_of_tiny_total_is_not_saturation():
    lat = p.Latency(requests=5, ttft=0.012, e2e=0.02, queue=0.001, prefill=0.002, decode=0.004)  # 13 ms validation
    assert p.diagnose(snap(lat=lat)).bottleneck == p.NONE


def test_validator_before_worker_when_validation_dominates():
    w = p.WorkerFigures("w-0", "tiny@1", running=2, waiting=0, kv_usage=0.2, batch_size=2, max_batch_size=2)
    d = p.diagnose(snap(v_cpu=0.97, v_lag=0.4, workers=[w], sched_queue=1, lat=VALIDATION_HEAVY))
    assert d.saturated[0] == p.VALIDATOR


def test_gateway_lag_means_add_gateways():
    d = p.diagnose(snap(g_lag=0.35, lat=LIGHT))
    assert d.bottleneck == p.GATEWAY and "add gateways" in d.actions[0].action


def test_queue_with_idle_workers_points_at_scheduler():
    w = p.WorkerFigures("w-0", "tiny@1", running=0, waiting=0, kv_usage=0.0, batch_size=0.1, max_batch_size=4)
    d = p.diagnose(snap(workers=[w], sched_queue=6, lat=QUEUE_HEAVY))
    assert d.bottleneck == p.SCHEDULER and d.actions[0].tier == p.SCHEDULER


def test_healthy_and_idle():
    d = p.diagnose(snap(lat=LIGHT))
    assert d.bottleneck == p.NONE and d.saturated == [] and d.actions[0].tier == p.NONE
    assert "healthy" in d.summary
    idle = p.diagnose(snap(lat=None))
    assert idle.breakdown == {} and "no request completed" in idle.actions[0].action
    assert idle.to_dict()["bottleneck"] == "none"


def _s(name, value, **labels):
    return SimpleNamespace(name=name, value=value, labels=labels)


def test_build_snapshot_from_two_scrapes():
    eps = [{"kind": "gateway", "id": "gw", "url": "http://127.0.0.1:1/metrics", "pid": 1},
           {"kind": "worker", "id": "w", "url": "http://127.0.0.1:2/metrics", "pid": 2},
           {"kind": "scheduler", "id": "s", "url": "http://127.0.0.1:3/metrics", "pid": 3}]

    def gw(n, total):
        out = [_s("actorserve_event_loop_lag_seconds", 0.01), _s("process_cpu_seconds_total", total)]
        for name in cli.HISTOGRAMS.values():
            out += [_s(name + "_count", n, model="m", tenant="t"), _s(name + "_sum", n * 0.5, model="m", tenant="t")]
        return out
    worker = [_s("actorserve_kv_cache_usage_perc", 0.5, model="m", worker="w-0"),
              _s("actorserve_num_requests_running", 2, model="m", worker="w-0"),
              _s("actorserve_max_batch_size", 2, model="m", worker="w-0")]
    sched = [_s("actorserve_num_requests_waiting", 7, model="m")]
    first = {"gateway/gw": (0.0, gw(10, 1.0), None), "worker/w": (0.0, worker, 5.0), "scheduler/s": (0.0, sched, 1.0)}
    second = {"gateway/gw": (2.0, gw(14, 2.0), None), "worker/w": (2.0, worker, 6.0), "scheduler/s": (2.0, sched, 1.0)}
    s = cli.build_snapshot(eps, first, second, 2.0)
    assert s.scheduler_queue == 7
    assert s.latency.requests == 4 and s.latency.source == "window" and s.latency.e2e == pytest.approx(0.5)
    by = {a.kind: a for a in s.actors}
    assert by["gateway"].cpu_cores == pytest.approx(0.5)  # process_cpu_seconds_total fallback
    assert by["worker"].cpu_cores == pytest.approx(0.5)  # /proc figures
    assert s.workers[0].kv_usage == 0.5 and s.workers[0].running == 2
    # nothing completed in the window: cumulative means
    s2 = cli.build_snapshot(eps, second, second, 2.0)
    assert s2.latency.source == "cumulative" and s2.latency.requests == 14


def test_proc_cpu_seconds_of_this_process():
    import os
    assert cli.proc_cpu_seconds(os.getpid()) >= 0
    assert cli.proc_cpu_seconds(2**22 + 12345) is None


def test_scrape_refuses_non_loopback():
    assert cli.scrape("http://10.1.2.3:9/metrics") is None


def test_validator_test_delay_only_with_test_faults(monkeypatch):
    import argparse

    from actors.validator.actor import _test_delay_ms
    args = argparse.Namespace(test_delay_ms=150.0)
    monkeypatch.delenv("ACTORSERVE_TEST_FAULTS", raising=False)
    assert _test_delay_ms(args) == 0.0
    monkeypatch.setenv("ACTORSERVE_TEST_FAULTS", "1")
    assert _test_delay_ms(args) == 150.0
