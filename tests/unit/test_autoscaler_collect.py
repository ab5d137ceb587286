"""actors/autoscaler/collect.py (pure signal windows) and the pure helpers of the autoscaler's shell and entry:
etcd listings -> state, options -> config."""

from __future__ import annotations

import argparse

import pytest

from actors.autoscaler import actor as entry
from actors.autoscaler.collect import (CollectConfig, CreditBook, Desired, LatencyBook, LoadBook, WorkerRecord, p90,
                                       pool_signals, worker_records)
from actors.autoscaler.service import (AutoscalerConfig, active_versions, desired_key_of, parse_curves,
                                       parse_desired)
from actors.autoscaler.signals import Limits
from bus.messages import ActorLoad, Credits
from control.state import names


def load(kind, aid, ts=1.0, **kw):
    return ActorLoad(kind, aid, ts, kw.pop("window_s", 1.0), **kw)


def test_p90():
    assert p90([]) == 0.0 and p90([3.0]) == 3.0
    assert p90(float(v) for v in range(1, 11)) == 9.0


def test_cpu_signals_aggregate_fresh_replicas_only():
    book = LoadBook(CollectConfig(stale_s=3.0))
    book.add(10.0, load("validator", "a", loop_lag_ms_p95=5.0, pending=2, wait_ms_p90=100.0, cpu_util=0.9, handled=10))
    book.add(11.0, load("validator", "b", loop_lag_ms_p95=30.0, pending=3, wait_ms_p90=40.0, cpu_util=0.5,
                        handled=6, window_s=2.0))
    book.add(5.0, load("validator", "gone", loop_lag_ms_p95=900.0, pending=50))  # silent since t=5: stale at 12
    book.add(11.0, load("gateway", "gw-0", cpu_util=0.2, handled=4))
    sig = book.cpu_signals(12.0)
    v, g = sig["validator"], sig["gateway"]
    assert v.replicas == 2 and v.loop_lag_ms_p95 == 30.0 and v.wait_ms_p90 == 100.0  # worst replica
    assert v.pending == 5.0 and v.cpu_util == pytest.approx(0.7) and v.handled_per_s == pytest.approx(13.0)
    assert (g.replicas, g.cpu_util, g.handled_per_s) == (1, 0.2, 4.0)
    assert book.cpu_signals(100.0)["validator"].replicas == 0
    book.add(20.0, load("validator", "a", pending=1))  # a newer report replaces the older one
    assert [x.pending for x in book.fresh(20.5, "validator")] == [1]
    book.prune(1000.0)
    assert book.fresh(1000.0, "validator") == []


def test_scheduler_report_is_the_freshest_of_its_version():
    book = LoadBook()
    book.add(10.0, load("scheduler", "s1", ts=100.0, name="m", version="1", queue_len=3))
    book.add(10.0, load("scheduler", "s2", ts=101.0, name="m", version="1", queue_len=7))
    book.add(10.0, load("scheduler", "s3", ts=102.0, name="m", version="2", queue_len=9))
    assert book.scheduler(11.0, "m", "1").queue_len == 7
    assert book.scheduler(11.0, "x", "1") is None and book.scheduler(100.0, "m", "1") is None


def credits(wid, free=50, total=100, draining=False, served=None, name="m", version="1"):
    return Credits(wid, name, version, free, total, 4, 8, 16, draining=draining, served=served or {})


def test_credit_book_kv_served_and_draining():
    book = CreditBook(CollectConfig(stale_s=2.0, served_window_s=5.0))
    book.add(0.0, credits("w1", served={"t": [100, 20]}))
    book.add(2.0, credits("w1", free=25, served={"t": [0, 30], "u": [5, 10], "bad": "x"}))
    book.add(2.0, credits("w2", draining=True))
    assert book.fresh(3.0, "w1").kv_util == pytest.approx(0.75)
    assert book.served_per_s(3.0, "w1") == pytest.approx((20 + 30 + 10) / 5.0)  # completion tokens only
    assert book.served_per_s(6.5, "w1") == pytest.approx(40 / 5.0)  # the t=0 heartbeat left the window
    assert book.draining(3.0) == {"w2"} and book.draining(10.0) == set()
    assert book.fresh(10.0, "w1") is None
    book.prune(100.0)
    assert book.latest == {}


def test_latency_book_p90_over_the_window():
    book = LatencyBook(CollectConfig(latency_window_s=10.0))
    for i in range(10):
        book.add(float(i), "m", "1", ttft_ms=100.0 * (i + 1), itl_ms=None if i == 0 else 10.0 * i)
    assert book.p90(9.0, "m", "1") == (900.0, 90.0)  # ITL: 9 samples 10..90, rank ceil(8.1) = 9
    assert book.p90(15.0, "m", "1") == (1000.0, 90.0)  # samples before t=5 left the window
    assert book.p90(9.0, "x", "1") == (0.0, 0.0)


def test_worker_records_from_a_listing():
    prefix = names.all_workers_prefix()
    listing = {names.worker_key("m", "1", "w1"): {"pool": "spot"}, names.worker_key("m", "1", "w0"): {},
               prefix + "junk": {}, names.worker_key("n", "2", "w2"): {"pool": ""}}
    assert worker_records(prefix, listing, "local") == [
        WorkerRecord("w0", "m", "1", "local"), WorkerRecord("w1", "m", "1", "spot"),
        WorkerRecord("w2", "n", "2", "local")]


def test_pool_signals_split_version_demand_by_active_workers():
    loads, creds, lats = LoadBook(), CreditBook(), LatencyBook()
    loads.add(0.0, load("scheduler", "s", name="m", version="1", queue_tokens=300.0, queue_len=6,
                        arrivals_tokens_per_s=90.0, cold_start_waiting=0, workers=3))
    for wid, free in (("w1", 20), ("w2", 60), ("w3", 0)):
        creds.add(0.0, credits(wid, free=free, served={"t": [0, 50]}))
    lats.add(0.0, "m", "1", 400.0, 40.0)
    workers = [WorkerRecord("w1", "m", "1", "local"), WorkerRecord("w2", "m", "1", "local"),
               WorkerRecord("w3", "m", "1", "spot")]
    desired = {"m/1/local": Desired(3, 990.0), "m/1/spot": Desired(1, 100.0)}
    out = pool_signals(1.0, 1000.0, [("m", "1"), ("z", "9")], "local", workers, {"w3"}, loads, creds, lats, desired)
    local, spot, idle = out["m/1/local"], out["m/1/spot"], out["z/9/local"]
    assert (local.replicas, local.leaving, local.starting) == (2, 0, 1)  # desired 3 written 10 s ago, 2 live
    assert (spot.replicas, spot.leaving, spot.starting) == (1, 1, 0)  # its desired is older than starting_s
    assert local.queue_tokens == 300.0 and local.arrival_tokens_per_s == 90.0 and local.queue_len == 6
    assert spot.queue_tokens == 0.0 and spot.arrival_tokens_per_s == 0.0  # a leaving pool gets no demand share
    assert local.kv_util == pytest.approx(0.6) and spot.kv_util == 1.0
    assert local.served_tokens_per_s == pytest.approx(100 / 5.0)
    assert (local.ttft_ms_p90, local.itl_ms_p90) == (400.0, 40.0)
    assert idle.replicas == 0 and idle.idle() and set(out) == {"m/1/local", "m/1/spot", "z/9/local"}


def test_pool_signals_at_zero_workers_give_the_demand_to_the_default_pool():
    loads = LoadBook()
    loads.add(0.0, load("scheduler", "s", name="m", version="1", queue_len=2, cold_start_waiting=2,
                        arrivals_tokens_per_s=5.0))
    out = pool_signals(0.5, 0.0, [("m", "1")], "local", [], set(), loads, CreditBook(), LatencyBook())
    s = out["m/1/local"]
    assert (s.replicas, s.cold_start_waiting, s.queue_len, s.arrival_tokens_per_s) == (0, 2, 2, 5.0)


def test_collect_config_is_validated():
    with pytest.raises(ValueError, match="stale_s"):
        CollectConfig(stale_s=0)


def test_etcd_listings_to_state():
    dp = names.desired_prefix()
    listing = {names.desired_key("validator"): {"count": 2, "ts": 5.0},
               names.desired_key("worker", "m", "1", "local"): {"count": 0, "ts": 6},
               dp + "gateway": {"count": True}, dp + "odd/x": {"count": 1}}
    assert parse_desired(listing) == {"validator": Desired(2, 5.0), "m/1/local": Desired(0, 6.0)}
    assert desired_key_of("worker/m/1/local") == names.desired_key("worker", "m", "1", "local")
    assert desired_key_of("validator") == names.desired_key("validator")
    mp = names.models_prefix()
    models = {names.model_version_key("m", "1"): {"status": "active"}, names.model_version_key("m", "2"):
              {"status": "retired"}, names.routing_key("m"): {"stable": "1"}, names.model_version_key("n", "1"): {}}
    assert set(active_versions(mp, models)) == {("m", "1"), ("n", "1")}
    pp = names.profiles_prefix()
    curve = {"pool": "local", "measured_at": 1.0, "cpu": "x", "decode": [{"batch": 1, "tokens_per_s": 10.0,
                                                                       "itl_ms": 100.0}],
             "prefill": [{"prompt_tokens": 10, "ttft_ms": 50.0}]}
    curves = parse_curves(pp, {names.profile_key("m", "1", "local"): curve, names.profile_key("m", "1", "x"): {}})
    assert list(curves) == ["m/1/local"] and curves["m/1/local"].tokens_per_s_at(1) == 10.0


def test_entry_options():
    assert entry.limits_arg("validator=1:3,gateway=2:2") == {"validator": Limits(1, 3), "gateway": Limits(2, 2)}
    for bad in ("worker=1:2", "validator=3:1", "validator=1", "validator=a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            entry.limits_arg(bad)
    assert entry.worker_limits_arg("0:2") == Limits(0, 2)
    assert entry.policy_set_arg("cpu.cooldown_up_s=1") == ("cpu", "cooldown_up_s", "1")
    with pytest.raises(argparse.ArgumentTypeError, match="no_such"):
        entry.policy_set_arg("pool.no_such=1")
    with pytest.raises(argparse.ArgumentTypeError):
        entry.policy_set_arg("gpu.x=1")
    cfgs = entry.policy_configs([("cpu", "cooldown_up_s", "1"), ("pool", "idle_to_zero_s", "5")])
    assert cfgs["cpu"].cooldown_up_s == 1.0 and cfgs["pool"].idle_to_zero_s == 5.0
    with pytest.raises(ValueError, match="lag_target_ms"):  # each alone is fine, together low >= target
        entry.policy_configs([("cpu", "lag_low_ms", "30")])
    with pytest.raises(ValueError):
        AutoscalerConfig(cpu_limits={"worker": Limits(1, 2)})
    with pytest.raises(ValueError):
        AutoscalerConfig(tick_s=0)


def test_the_cli_parses_the_contract_options_into_a_config():
    from control.ops.cli import build_parser

    args = build_parser().parse_args(["actor", "autoscaler", "--limits", "validator=1:2,gateway=1:1", "--worker-limits",
                                      "1:2", "--tick-s", "0.5", "--pool", "local", "--policy-set",
                                      "cpu.cooldown_up_s=1", "--policy-set", "pool.cooldown_down_s=5"])
    cfg = entry.config_from_args(args)
    assert cfg.cpu_limits == {"validator": Limits(1, 2), "gateway": Limits(1, 1)} and cfg.worker_limits == Limits(1, 2)
    assert (cfg.tick_s, cfg.pool, cfg.cpu.cooldown_up_s, cfg.pools.cooldown_down_s) == (0.5, "local", 1.0, 5.0)
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["actor", "autoscaler", "--policy-set", "cpu.nope=1"])
    assert ei.value.code == 2
    args = build_parser().parse_args(["actor", "autoscaler", "--policy-set", "cpu.lag_high_ms=10"])  # < target 20
    with pytest.raises(SystemExit) as ei:
        entry.config_from_args(args)
    assert ei.value.code == 2
    both = build_parser().parse_args(["actor", "autoscaler", "--policy-set", "cpu.lag_high_ms=10", "--policy-set",
                                      "cpu.lag_target_ms=8"])  # together they keep low < target <= high
    assert entry.config_from_args(both).cpu.lag_high_ms == 10.0
    bad = build_parser().parse_args(["actor", "autoscaler", "--policy-set", "pool.cooldown_up_s=soon"])
    with pytest.raises(SystemExit):
        entry.config_from_args(bad)


def test_metrics_export_reads_the_last_snapshot():
    from types import SimpleNamespace

    from actors.metrics import render_latest

    scaler = SimpleNamespace(is_leader=True, decisions_written=3, snapshot={
        "cpu": {"validator": {"replicas": 2}}, "pools": {"m/1/local": {"replicas": 1}},
        "desired": {"validator": 3, "m/1/local": 2}})
    entry._export(scaler)
    text = render_latest().decode()
    assert "actorserve_autoscaler_leader 1.0" in text
    assert ('actorserve_autoscaler_desired_replicas{model="m",pool="local",target="worker/m/1/local",tier="worker",'
            'version="1"} 2.0') in text
    # the exporter gives every series of a family the same label names (empty = absent, as PromQL reads it)
    assert ('actorserve_autoscaler_desired_replicas{model="",pool="",target="validator",tier="validator",version=""}'
            ' 3.0') in text
    assert 'actorserve_autoscaler_observed_replicas{target="validator"} 2.0' in text
    assert "actorserve_autoscaler_decisions_total 3.0" in text


def test_worker_records_carry_the_sleep_and_the_host():
    """Issue [28]: a sleeper's record gives when it fell asleep and its last wake; a host's version names its host
    (the sleeping tier weighs a sleeper sharing its instance as free: actors/autoscaler/sleep_tier.py)."""
    prefix = names.all_workers_prefix()
    listing = {names.worker_key("m", "1", "h-v1"): {"host": "h", "sleep": {"state": "sleeping", "since": 100.5,
                                                                           "wake_s": 0.4}},
               names.worker_key("n", "1", "h-v2"): {"host": "h", "sleep": {"state": "running", "since": 99.0,
                                                                           "wake_s": "bad"}}}
    assert worker_records(prefix, listing, "local") == [
        WorkerRecord("h-v1", "m", "1", "local", True, "h", 100.5, 0.4),
        WorkerRecord("h-v2", "n", "1", "local", False, "h", 0.0, 0.0)]


def test_the_autoscaler_plans_the_sleeping_tier_per_pool_with_shared_instances_free():
    """The service's sleep plans (actors/autoscaler/service.py ``_sleep_plans``): a sleeper on a host where another
    version is awake is shared (kept to the idle horizon), one alone exits at its break-even."""
    from actors.autoscaler.service import Autoscaler, AutoscalerConfig
    from actors.autoscaler.signals import PoolSignals
    from actors.autoscaler.sleep_tier import SleepTierConfig

    a = Autoscaler(None, None, AutoscalerConfig(sleep=SleepTierConfig(cold_start_s=52, history_s=10**6)))
    a.sleep_policy.observe("m/1/local", 0.0, 3)
    a.state.workers = [WorkerRecord("w0", "m", "1", "local"),
                       WorkerRecord("h-v1", "m", "1", "local", True, "h", 1000.0, 1.0),
                       WorkerRecord("w9", "m", "1", "local", True, "", 1000.0, 1.0),
                       WorkerRecord("h-v2", "n", "1", "local", False, "h")]
    pools = {"m/1/local": PoolSignals("m", "1", "local", replicas=1, sleeping=2)}
    plan = a._sleep_plans(1000.0 + 600.0, pools)["m/1/local"]  # both asleep 600 s: over 10 x (52 - 1) s
    assert plan.exit == ("w9",) and plan.keep == 2, plan  # h-v1 shares host h with n@1 awake: free, it stays
    a.state.workers[3] = WorkerRecord("h-v2", "n", "1", "local", True, "h", 1000.0, 1.0)  # n@1 sleeps too
    assert a._sleep_plans(1600.0, pools)["m/1/local"].exit == ("h-v1", "w9")


def test_the_cli_sets_the_sleeping_tier_and_carry_sleep():
    """Issue [28]: ``--policy-set sleep.FIELD=V`` tunes SleepTierConfig, ``--carry-sleep`` makes the autoscaler write
    the sleep and wake records itself; off by default."""
    from control.ops.cli import build_parser

    args = build_parser().parse_args(["actor", "autoscaler", "--policy-set", "sleep.history_s=120",
                                      "--policy-set", "sleep.cold_start_penalty=1", "--carry-sleep"])
    cfg = entry.config_from_args(args)
    assert (cfg.sleep.history_s, cfg.sleep.cold_start_penalty, cfg.carry_sleep) == (120.0, 1.0, True)
    assert entry.config_from_args(build_parser().parse_args(["actor", "autoscaler"])).carry_sleep is False
    with pytest.raises(argparse.ArgumentTypeError, match="no field 'nope'"):
        entry.policy_set_arg("sleep.nope=1")
    bad = build_parser().parse_args(["actor", "autoscaler", "--policy-set", "sleep.history_s=-5"])
    with pytest.raises(SystemExit):
        entry.config_from_args(bad)
