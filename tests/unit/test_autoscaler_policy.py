"""The autoscaler's pure policies (actors/autoscaler/cpu_policy.py, pool_policy.py, signals.py, decisions.py):
hysteresis, cool-downs, floors and ceilings, zero traffic down to the floor (Dynamo #6985), scale to / from
zero, leaving workers replaced (and scale-down victims not), each loop on its own signals only."""

from __future__ import annotations

import math

import pytest

from actors.autoscaler.cpu_policy import CpuTierConfig, CpuTierPolicy
from control.policy.curves import DecodePoint, ThroughputCurve
from actors.autoscaler.decisions import Decision, DecisionLog
from actors.autoscaler.pool_policy import PoolConfig, PoolPolicy
from actors.autoscaler.signals import (CpuKindSignals, Limits, PoolSignals, Slo, limits_from_autoscale, set_fields,
                                       slo_from_autoscale)

FAST_CPU = CpuTierConfig(cooldown_up_s=2, cooldown_down_s=5, down_window_s=5)
FAST_POOL = PoolConfig(cooldown_up_s=3, cooldown_down_s=10, down_window_s=5, idle_to_zero_s=30)
KEY = "m/v1/local"
SLO = Slo(ttft_ms=2000, itl_ms=100)
# one replica: 400 tok/s at ITL 100 ms (batch 40), 80 tok/s at batch 1 (ITL = 1000 x batch / tok/s)
CURVE = ThroughputCurve("local", 1.0, "test cpu", (DecodePoint(1, 80, 12.5), DecodePoint(8, 320, 25),
                                                     DecodePoint(40, 400, 100), DecodePoint(64, 427, 150)))


def cpu(kind="validator", replicas=1, **kw) -> CpuKindSignals:
    return CpuKindSignals(kind, replicas, **kw)


def pool(replicas=1, **kw) -> PoolSignals:
    return PoolSignals("m", "v1", "local", replicas, **kw)


# ------------------------------------------------------------------------------------------ CPU tier


def test_cpu_scales_up_on_its_worst_signal_with_reason_and_inputs():
    p = CpuTierPolicy(FAST_CPU)
    [d] = p.decide(100.0, {"validator": cpu(wait_ms_p90=412.0)}, {"validator": Limits(1, 8)})
    assert (d.loop, d.target, d.current, d.desired) == ("cpu", "validator", 1, 2)  # x4.1 capped at x2 per step
    assert d.reason == "validator wait p90 412 ms > 200 ms"
    assert d.inputs["wait"] == 412.0 and d.inputs["replicas"] == 1 and d.inputs["ceiling"] == 8
    p2 = CpuTierPolicy(FAST_CPU)  # proportional: 2 replicas at 0.95 s/s each -> ceil(2 x 0.95 / 0.6) = 4
    [d] = p2.decide(0.0, {"gateway": cpu("gateway", 2, cpu_util=0.95)}, {"gateway": Limits(1, 8)})
    assert d.desired == 4 and "cpu 0.95 s/s > 0.8 s/s" in d.reason


def _run_cpu(policy, loads, limits=Limits(1, 8), start_replicas=1, dt=1.0):
    """Closed loop: per-replica signals = total load / replicas; replicas follow desired at once."""
    replicas, changes = start_replicas, []
    for i, total_cpu in enumerate(loads):
        ds = policy.decide(i * dt, {"validator": cpu(replicas=replicas, cpu_util=total_cpu / replicas)},
                           {"validator": limits})
        for d in ds:
            changes.append((i * dt, replicas, d.desired))
            replicas = d.desired
    return replicas, changes


def test_cpu_hysteresis_no_flapping_around_thresholds():
    # total CPU demand oscillating around the high threshold of one replica (0.8 s/s): one step up, then quiet
    replicas, changes = _run_cpu(CpuTierPolicy(FAST_CPU), [0.78, 0.82] * 150)
    assert replicas == 2 and [c[1:] for c in changes] == [(1, 2)]
    # per-replica load oscillating around the low threshold (0.3): never sustained low, never scales down
    replicas, changes = _run_cpu(CpuTierPolicy(FAST_CPU), [0.56, 0.64] * 150, start_replicas=2)
    assert changes == [] and replicas == 2
    # sustained low at 2 x 0.25: down to 1 (0.5 on one replica <= 0.6 target), then stays
    replicas, changes = _run_cpu(CpuTierPolicy(FAST_CPU), [0.5] * 300, start_replicas=2)
    assert [c[1:] for c in changes] == [(2, 1)] and replicas == 1


def test_cpu_no_scale_down_when_one_fewer_would_overload():
    # 3 replicas at 0.29 each (all low) -> 0.435 each on 2 (<= 0.6 target): down once; 0.435 is not low
    _, changes = _run_cpu(CpuTierPolicy(FAST_CPU), [0.87] * 100, start_replicas=3)
    assert [c[1:] for c in changes] == [(3, 2)]
    # 2 replicas at 0.29 each would be 0.58 on one: above a 0.5 target, so no scale-down
    strict = CpuTierPolicy(CpuTierConfig(cpu_target=0.5, cooldown_up_s=2, cooldown_down_s=5, down_window_s=5))
    _, changes = _run_cpu(strict, [0.58] * 100, start_replicas=2)
    assert changes == []


def test_cpu_loop_lag_of_an_idle_starved_loop_adds_nothing():
    # measured live: an idle validator next to a busy worker on 2 cores lags 30-55 ms at 0.01 s/s of CPU
    p, lim = CpuTierPolicy(FAST_CPU), {"validator": Limits(1, 4)}
    for t in range(30):
        idle = cpu(loop_lag_ms_p95=150.0, cpu_util=0.01, handled_per_s=1.0)
        assert p.decide(float(t), {"validator": idle}, lim) == []
    # the same lag with work of its own (CPU at its low threshold) is load: one more replica
    [d] = p.decide(30.0, {"validator": cpu(loop_lag_ms_p95=150.0, cpu_util=0.3, handled_per_s=5.0)}, lim)
    assert d.desired == 2 and "loop lag p95 150 ms > 50 ms" in d.reason and d.inputs["lag_raw"] == 150.0


def test_cpu_cooldowns_space_the_steps():
    p = CpuTierPolicy(CpuTierConfig(cooldown_up_s=10, cooldown_down_s=30, down_window_s=5))
    lim = {"validator": Limits(1, 16)}
    ups = []
    replicas = 1
    for t in range(60):  # lag far over its threshold every tick; replicas follow at once
        busy = cpu(replicas=replicas, loop_lag_ms_p95=500.0, cpu_util=0.4, handled_per_s=20.0)
        for d in p.decide(float(t), {"validator": busy}, lim):
            ups.append(t)
            replicas = d.desired
    assert ups == [0, 10, 20, 30] and replicas == 16  # 1 -> 2 -> 4 -> 8 -> 16 (ceiling), once per 10 s
    downs = []
    for t in range(60, 200):
        for d in p.decide(float(t), {"validator": cpu(replicas=replicas)}, lim):
            downs.append(t)
            replicas = d.desired
    assert downs and all(b - a >= 30 for a, b in zip([30] + downs, downs))  # 30 s since the last change
    assert replicas == 16 - len(downs)


def test_cpu_floor_and_ceiling():
    p = CpuTierPolicy(FAST_CPU)
    [d] = p.decide(0.0, {"validator": cpu(replicas=0)}, {"validator": Limits(2, 4)})
    assert d.desired == 2 and "below floor 2" in d.reason
    p = CpuTierPolicy(FAST_CPU)
    p.seed("validator", 6, 0.0)
    [d] = p.decide(1.0, {"validator": cpu(replicas=6)}, {"validator": Limits(1, 4)})
    assert d.desired == 4 and "above ceiling 4" in d.reason
    # at the ceiling an overload asks for nothing more; idle never goes below the floor
    assert p.decide(10.0, {"validator": cpu(replicas=4, wait_ms_p90=900.0)}, {"validator": Limits(1, 4)}) == []
    replicas, changes = _run_cpu(CpuTierPolicy(FAST_CPU), [0.0] * 200, limits=Limits(2, 8), start_replicas=5)
    assert replicas == 2 and [c[2] for c in changes] == [4, 3, 2]


def test_cpu_kind_without_limits_is_left_alone_and_starting_replicas_not_reasked():
    p = CpuTierPolicy(FAST_CPU)
    assert p.decide(0.0, {"gateway": cpu("gateway", 1, wait_ms_p90=999.0)}, {}) == []
    [d] = p.decide(0.0, {"validator": cpu(wait_ms_p90=999.0)}, {"validator": Limits(1, 8)})
    assert d.desired == 2
    # the second replica has not come up yet: the same overload after the cool-down asks for 2 again -> nothing
    assert p.decide(5.0, {"validator": cpu(wait_ms_p90=999.0)}, {"validator": Limits(1, 8)}) == []


def test_each_loop_reads_only_its_own_signals():
    with pytest.raises(TypeError):
        CpuTierPolicy().decide(0.0, {"validator": pool()}, {"validator": Limits(1, 2)})
    with pytest.raises(TypeError):
        PoolPolicy().decide(0.0, {KEY: cpu()}, {KEY: Limits(1, 2)}, {}, {})
    # validator-bound: the validator scales, the (idle) accelerator pool does not
    cpu_p, pool_p = CpuTierPolicy(FAST_CPU), PoolPolicy(FAST_POOL)
    lim_c, lim_p = {"validator": Limits(1, 4)}, {KEY: Limits(1, 4)}
    assert [d.target for d in cpu_p.decide(0.0, {"validator": cpu(wait_ms_p90=800.0, pending=20)}, lim_c)] \
        == ["validator"]
    assert pool_p.decide(0.0, {KEY: pool(1, arrival_tokens_per_s=10, served_tokens_per_s=10)}, lim_p, {}, {}) == []
    # accelerator-bound: the pool scales, the (quiet) validator does not
    cpu_p, pool_p = CpuTierPolicy(FAST_CPU), PoolPolicy(FAST_POOL)
    assert cpu_p.decide(0.0, {"validator": cpu(wait_ms_p90=50.0, cpu_util=0.5)}, lim_c) == []
    [d] = pool_p.decide(0.0, {KEY: pool(1, ttft_ms_p90=5000.0, queue_len=9, queue_tokens=3000,
                                        arrival_tokens_per_s=300, served_tokens_per_s=150)}, lim_p, {KEY: SLO}, {})
    assert d.target == "worker/m/v1/local" and d.loop == "pool" and d.desired == 2


def test_configs_validate_and_set_from_strings():
    with pytest.raises(ValueError, match="cpu_target"):
        CpuTierConfig(cpu_low=0.7)
    with pytest.raises(ValueError, match="cooldown_up_s"):
        CpuTierConfig(cooldown_up_s=-1)
    with pytest.raises(ValueError, match="kv_low"):
        PoolConfig(kv_low=0.95)
    with pytest.raises(ValueError, match="target_util"):
        PoolConfig(target_util=1.5)
    assert set_fields(CpuTierConfig(), {"cooldown_up_s": "2"}).cooldown_up_s == 2.0
    assert set_fields(PoolConfig(), {"idle_to_zero_s": "5", "kv_high": "0.95"}).idle_to_zero_s == 5.0
    with pytest.raises(ValueError, match="no field 'nope'"):
        set_fields(PoolConfig(), {"nope": "1"})
    with pytest.raises(ValueError, match="down_window_s"):
        set_fields(PoolConfig(), {"down_window_s": "soon"})
    with pytest.raises(ValueError, match="target_util"):
        set_fields(PoolConfig(), {"target_util": "0"})


def test_signals_limits_and_autoscale_parsing():
    with pytest.raises(ValueError, match="leaving"):
        pool(1, leaving=2)
    with pytest.raises(ValueError, match="ceiling"):
        Limits(3, 2)
    with pytest.raises(ValueError, match="queue_len"):
        pool(1, queue_len=-1)
    assert limits_from_autoscale({"max_workers": 3, "scale_to_zero": True}, Limits(1, 2)) == Limits(1, 3, True)
    assert slo_from_autoscale({"itl_slo_ms": 50}, Slo(2000, 100)) == Slo(2000, 50)
    with pytest.raises(ValueError, match="autoscale"):
        limits_from_autoscale({"min_workers": 5, "max_workers": 2}, Limits(1, 2))


def test_decision_json_and_bounded_log():
    d = Decision(12.5, "pool", "worker/m/v1/local", 1, 2, "why", {"queue_tokens": 3.0, "curve": True})
    assert Decision.from_json(d.to_json()) == d and Decision.from_json(d.to_json()).inputs == d.inputs
    with pytest.raises(ValueError, match="loop"):
        Decision(1.0, "gpu", "x", 1, 2, "r")
    log = DecisionLog(max_len=3)
    log.extend(Decision(float(t), "cpu", "validator", t, t + 1, f"r{t}") for t in range(5))
    assert [x.ts for x in log] == [2.0, 3.0, 4.0]  # newest last, oldest dropped
    again = DecisionLog.from_json(log.to_json())
    assert [x.to_json() for x in again] == [x.to_json() for x in log] and log.last("validator").ts == 4.0


# ------------------------------------------------------------------------------------------ pools


def _run_pool(policy, sig_at, ticks, limits=Limits(1, 8), start=1, dt=1.0, curve=None):
    """Closed loop: ``sig_at(t, replicas) -> PoolSignals``; replicas follow desired at once."""
    replicas, changes = start, []
    for i in range(ticks):
        t = i * dt
        ds = policy.decide(t, {KEY: sig_at(t, replicas)}, {KEY: limits}, {KEY: SLO},
                           {KEY: curve} if curve else {})
        for d in ds:
            changes.append((t, replicas, d.desired, d.reason))
            replicas = d.desired
    return replicas, changes


def test_zero_traffic_scales_down_to_the_floor_not_below():
    """Dynamo's Planner kept its replicas when traffic went to zero (ai-dynamo/dynamo#6985)."""
    replicas, changes = _run_pool(PoolPolicy(FAST_POOL), lambda t, r: pool(r), 200, limits=Limits(1, 8), start=4)
    assert replicas == 1 and [c[2] for c in changes] == [3, 2, 1]
    assert all(b[0] - a[0] >= FAST_POOL.cooldown_down_s for a, b in zip(changes, changes[1:]))
    assert "all low" in changes[0][3]
    replicas, _ = _run_pool(PoolPolicy(FAST_POOL), lambda t, r: pool(r), 200, limits=Limits(2, 8), start=4,
                            curve=CURVE)
    assert replicas == 2


def test_scale_to_zero_only_when_allowed_and_idle_then_from_zero_at_once():
    replicas, changes = _run_pool(PoolPolicy(FAST_POOL), lambda t, r: pool(r), 100, limits=Limits(1, 4))
    assert replicas == 1 and changes == []  # not allowed: stays at the floor
    p = PoolPolicy(FAST_POOL)
    lim = {KEY: Limits(1, 4, scale_to_zero=True)}
    assert p.decide(0.0, {KEY: pool(1)}, lim, {}, {}) == []
    assert p.decide(29.0, {KEY: pool(1)}, lim, {}, {}) == []  # idle 29 s < 30 s
    [d] = p.decide(30.0, {KEY: pool(1)}, lim, {}, {})
    assert d.desired == 0 and "scale to zero" in d.reason
    assert p.decide(31.0, {KEY: pool(0)}, lim, {}, {}) == []  # stays at zero while nothing comes
    [d] = p.decide(31.5, {KEY: pool(0, cold_start_waiting=1)}, lim, {}, {})  # within every cool-down
    assert d.desired == 1 and "scale from zero" in d.reason
    p2 = PoolPolicy(FAST_POOL)
    p2.seed(KEY, 0, 0.0)
    [d] = p2.decide(0.1, {KEY: pool(0, queue_len=3, queue_tokens=600, arrival_tokens_per_s=1000)},
                    {KEY: Limits(1, 4, True)}, {KEY: SLO}, {KEY: CURVE})
    assert d.desired == 4  # from zero straight to what the arrivals need: ceil(1000 / (400 x 0.8)) = 4


def test_busy_version_is_not_scaled_to_zero():
    p = PoolPolicy(FAST_POOL)
    lim = {KEY: Limits(1, 4, scale_to_zero=True)}
    for t in range(100):  # one long request running: tokens served, nothing arriving
        assert p.decide(float(t), {KEY: pool(1, served_tokens_per_s=20.0)}, lim, {}, {}) == []


def test_leaving_workers_are_replaced_and_scale_down_victims_are_not():
    p = PoolPolicy(FAST_POOL)
    lim = {KEY: Limits(1, 3)}
    busy = dict(arrival_tokens_per_s=500, served_tokens_per_s=500)
    assert p.decide(0.0, {KEY: pool(2, **busy)}, lim, {KEY: SLO}, {KEY: CURVE}) == []  # needs 2, has 2
    [d] = p.decide(1.0, {KEY: pool(2, leaving=1, **busy)}, lim, {KEY: SLO}, {KEY: CURVE})
    assert (d.current, d.desired) == (2, 3) and "1 leaving worker(s) replaced" in d.reason
    assert p.decide(2.0, {KEY: pool(3, leaving=1, **busy)}, lim, {KEY: SLO}, {KEY: CURVE}) == []
    [d] = p.decide(3.0, {KEY: pool(2, **busy)}, lim, {KEY: SLO}, {KEY: CURVE})
    assert d.desired == 2 and "gone" in d.reason
    # a scale-down victim drains as "leaving": it is not replaced
    p = PoolPolicy(FAST_POOL)
    t0 = 0.0
    while not (ds := p.decide(t0, {KEY: pool(3)}, lim, {}, {})):
        t0 += 1.0
    assert [d.desired for d in ds] == [2] and t0 == FAST_POOL.down_window_s
    for t in (t0 + 1, t0 + 2):  # the victim drains, then is gone
        assert p.decide(t, {KEY: pool(3, leaving=1)}, lim, {}, {}) == []
    assert p.decide(t0 + 3, {KEY: pool(2)}, lim, {}, {}) == []
    # without room under the ceiling no replacement is asked for
    p = PoolPolicy(FAST_POOL)
    p.decide(0.0, {KEY: pool(3, **busy)}, lim, {KEY: SLO}, {KEY: CURVE})
    assert p.decide(1.0, {KEY: pool(3, leaving=1, **busy)}, lim, {KEY: SLO}, {KEY: CURVE}) == []


def test_arrivals_against_the_curve_give_the_needed_replicas():
    p = PoolPolicy(FAST_POOL)
    [d] = p.decide(0.0, {KEY: pool(1, arrival_tokens_per_s=1200, served_tokens_per_s=400)}, {KEY: Limits(1, 8)},
                   {KEY: SLO}, {KEY: CURVE})
    assert d.desired == math.ceil(1200 / (400 * 0.8)) == 4
    assert "arrivals 1200 tok/s need 4" in d.reason and d.inputs["capacity_tokens_per_s"] == 400.0
    # a tighter ITL SLO lowers capacity (ITL 25 ms at batch 8, 100 at 40: 50 ms at batch 18.7, 346.7 tok/s)
    p = PoolPolicy(FAST_POOL)
    [d] = p.decide(0.0, {KEY: pool(1, arrival_tokens_per_s=1200)}, {KEY: Limits(1, 8)}, {KEY: Slo(2000, 50)},
                   {KEY: CURVE})
    assert d.desired == math.ceil(1200 / (CURVE.capacity_tokens_per_s(50) * 0.8)) == 5
    p = PoolPolicy(FAST_POOL)  # the ceiling bounds it
    [d] = p.decide(0.0, {KEY: pool(1, arrival_tokens_per_s=99999)}, {KEY: Limits(1, 3)}, {KEY: SLO}, {KEY: CURVE})
    assert d.desired == 3


def test_pool_hysteresis_around_a_replica_boundary():
    # arrivals oscillate around what 2 replicas carry at 80 % (640 tok/s): one step up, no flapping
    def sig(t, r):
        arr = 620.0 if int(t) % 2 else 660.0
        return pool(r, arrival_tokens_per_s=arr, served_tokens_per_s=arr)
    replicas, changes = _run_pool(PoolPolicy(FAST_POOL), sig, 300, start=2, curve=CURVE)
    assert replicas == 3 and [c[1:3] for c in changes] == [(2, 3)]


def test_no_curve_falls_back_to_queue_and_slo_signals():
    p = PoolPolicy(FAST_POOL)
    lim, slo = {KEY: Limits(1, 8)}, {KEY: SLO}
    [d] = p.decide(0.0, {KEY: pool(1, itl_ms_p90=180.0, arrival_tokens_per_s=150, served_tokens_per_s=100)},
                   lim, slo, {})
    assert d.desired == 2 and "itl p90 180 ms > 100 ms" in d.reason and d.inputs["curve"] is False
    assert p.decide(1.0, {KEY: pool(2, itl_ms_p90=180.0)}, lim, slo, {}) == []  # cool-down (3 s)
    [d] = p.decide(3.0, {KEY: pool(2, queue_len=40, queue_tokens=8000, served_tokens_per_s=200)}, lim, slo, {})
    assert d.desired == 3 and "queue 8000 tokens drains in 40 s > 2 s" in d.reason
    # served rate far below arrivals under overload: ceil(active x arrivals / served), at most x2 per step
    p = PoolPolicy(FAST_POOL)
    [d] = p.decide(0.0, {KEY: pool(2, kv_util=0.97, arrival_tokens_per_s=500, served_tokens_per_s=100)},
                   lim, slo, {})
    assert d.desired == 4 and "kv 0.97 > 0.9" in d.reason
    # no overload and nothing known about capacity: no change
    assert PoolPolicy(FAST_POOL).decide(0.0, {KEY: pool(1, arrival_tokens_per_s=500, served_tokens_per_s=500,
                                                        ttft_ms_p90=1500, itl_ms_p90=80)}, lim, slo, {}) == []


def test_pool_floor_ceiling_and_defaults():
    p = PoolPolicy(FAST_POOL)
    [d] = p.decide(0.0, {KEY: pool(0)}, {KEY: Limits(2, 4)}, {}, {})
    assert d.desired == 2 and "below floor 2" in d.reason
    p = PoolPolicy(FAST_POOL)
    [d] = p.decide(0.0, {KEY: pool(6)}, {KEY: Limits(1, 4)}, {}, {})
    assert d.desired == 4 and "above ceiling 4" in d.reason
    # a version without limits is left alone; a missing Slo takes the config's default
    assert PoolPolicy(FAST_POOL).decide(0.0, {KEY: pool(0, queue_len=5)}, {}, {}, {}) == []
    [d] = PoolPolicy(FAST_POOL).decide(0.0, {KEY: pool(1, ttft_ms_p90=2500.0)}, {KEY: Limits(1, 4)}, {}, {})
    assert d.desired == 2 and d.inputs["slo_ttft_ms"] == FAST_POOL.default_ttft_slo_ms


def test_decide_is_deterministic():
    def run():
        p = PoolPolicy(FAST_POOL)
        out = []
        for t in range(200):
            arr = 300.0 + 250.0 * math.sin(t / 15.0)
            sigs = {f"m/v{i}/local": PoolSignals("m", f"v{i}", "local", 2, arrival_tokens_per_s=arr * i,
                                                 served_tokens_per_s=arr) for i in (1, 2, 3)}
            lims = {k: Limits(1, 6) for k in sigs}
            out += [d.to_json() for d in p.decide(float(t), sigs, lims, {}, {k: CURVE for k in sigs})]
        return out
    first = run()
    assert first and first == run()


def test_policy_modules_are_pure():
    """No torch, nats, etcd or clock in the policy modules: they import only the standard library's pure parts
    and each other (issue [14]'s simulator drives them with simulated time)."""
    import ast
    from pathlib import Path

    allowed = {"__future__", "collections", "dataclasses", "itertools", "math", "typing"}
    root = Path(__file__).resolve().parents[2]
    for mod in ("signals", "decisions", "cpu_policy", "pool_policy", "mix"):
        tree = ast.parse((root / "actors" / "autoscaler" / f"{mod}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [node.module or ""]
            else:
                continue
            for name in found:
                # control.policy: the pure floor (curves.py, numbers.py; tests/unit/test_layers.py)
                assert name.split(".")[0] in allowed or name.startswith(("actors.autoscaler.", "control.policy.")), \
                    (mod, name)


def test_no_curve_capacity_is_learnt_from_a_backlog_only():
    lim, slo = {KEY: Limits(1, 8)}, {KEY: SLO}

    def policy_after(first: PoolSignals) -> PoolPolicy:
        p = PoolPolicy(FAST_POOL)
        p.seed(KEY, 3, -100.0)
        p.decide(0.0, {KEY: first}, lim, slo, {})
        return p

    def downs(p: PoolPolicy, arrivals: float) -> list:
        return [d for t in range(1, 40) for d in p.decide(float(t), {KEY: pool(
            3, arrival_tokens_per_s=arrivals, served_tokens_per_s=arrivals)}, lim, slo, {})]

    backlog = pool(3, queue_len=50, queue_tokens=9000, served_tokens_per_s=300, arrival_tokens_per_s=300)
    # 100 tok/s per worker seen under a backlog: 150 tok/s fits 2 workers at 80 %, 170 does not
    assert [d.desired for d in downs(policy_after(backlog), 150.0)][:1] == [2]
    assert downs(policy_after(backlog), 170.0) == []
    # a TTFT miss without a backlog teaches nothing: the same 170 tok/s then scales down on low signals
    ttft_only = pool(3, ttft_ms_p90=3000.0, served_tokens_per_s=30, arrival_tokens_per_s=30)
    assert [d.desired for d in downs(policy_after(ttft_only), 170.0)][:1] == [2]


def test_request_during_the_drain_of_a_scale_to_zero_asks_for_one_worker():
    p = PoolPolicy(FAST_POOL)
    lim = {KEY: Limits(1, 4, scale_to_zero=True)}
    p.decide(0.0, {KEY: pool(1)}, lim, {}, {})
    [d] = p.decide(30.0, {KEY: pool(1)}, lim, {}, {})
    assert d.desired == 0
    assert p.decide(31.0, {KEY: pool(1, leaving=1)}, lim, {}, {}) == []  # the last worker drains
    [d] = p.decide(32.0, {KEY: pool(1, leaving=1, cold_start_waiting=1)}, lim, {}, {})
    assert d.desired == 1  # one new worker, not one more for the draining one
    assert p.decide(33.0, {KEY: pool(0, cold_start_waiting=1)}, lim, {}, {}) == []


def test_sleeping_workers_are_a_tier_a_step_up_need_not_wait_for():
    """Issue [28]: with sleeping workers in the pool a second step up does not wait out the cool-down (a wake
    serves in about a second); without them it does. Sleepers are not replicas (collect.py leaves them out)."""
    for sleeping, second_step_at in ((0, FAST_POOL.cooldown_up_s), (2, 1.0)):
        p = PoolPolicy(FAST_POOL)
        lim = {KEY: Limits(1, 8)}
        [d] = p.decide(0.0, {KEY: pool(1, arrival_tokens_per_s=600, sleeping=sleeping)}, lim, {KEY: SLO},
                       {KEY: CURVE})
        assert d.desired == 2 and d.inputs["sleeping"] == sleeping
        assert ("sleeping worker(s) to wake" in d.reason) == bool(sleeping)
        t, got = 1.0, []
        while not got:
            got = p.decide(t, {KEY: pool(2, arrival_tokens_per_s=1200, sleeping=sleeping)}, lim, {KEY: SLO},
                           {KEY: CURVE})
            t += 1.0
        assert got[0].desired == 4 and t - 1.0 == second_step_at, (sleeping, t)


def test_collect_leaves_sleepers_out_of_the_replicas():
    from actors.autoscaler.collect import CreditBook, LatencyBook, LoadBook, pool_signals, worker_records
    from control.state.names import all_workers_prefix

    prefix = all_workers_prefix()
    listing = {f"{prefix}m/v1/w0": {"pool": "local"},
               f"{prefix}m/v1/w1": {"pool": "local", "sleep": {"state": "sleeping"}},
               f"{prefix}m/v1/w2": {"pool": "local", "sleep": {"state": "running", "wakes": 1}}}
    recs = worker_records(prefix, listing, "local")
    assert [(r.worker_id, r.sleeping) for r in recs] == [("w0", False), ("w1", True), ("w2", False)]
    sig = pool_signals(0.0, 0.0, [("m", "v1")], "local", recs, set(), LoadBook(), CreditBook(), LatencyBook())
    assert (sig[KEY].replicas, sig[KEY].sleeping) == (2, 1)
