"""The autoscaler actor's shell (actors/autoscaler/service.py) on the in-memory bus with a dict registry: load
reports, credits, completion records and etcd state in -> desired keys and logged decisions out; each loop
acts on its own signals only."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.autoscaler.cpu_policy import CpuTierConfig
from actors.autoscaler.pool_policy import PoolConfig
from actors.autoscaler.service import Autoscaler, AutoscalerConfig
from actors.autoscaler.signals import Limits
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ActorLoad, CompletionRecord, Credits
from control.state import names


class DictRegistry:
    """The registry calls the autoscaler makes, over a dict."""

    def __init__(self) -> None:
        self.kv: dict[str, object] = {}

    async def get_json(self, key):
        return self.kv.get(key)

    async def get_prefix_json(self, prefix):
        return {k: v for k, v in sorted(self.kv.items()) if k.startswith(prefix)}

    async def put_json(self, key, value, *, lease=None):
        self.kv[key] = value
        return 1


def stack(reg: DictRegistry, *, workers=("w0",), autoscale=None) -> None:
    """One active version m@1 with ``workers`` registered on pool local."""
    reg.kv[names.model_version_key("m", "1")] = {"status": "active", **({"autoscale": autoscale} if autoscale else {})}
    for w in workers:
        reg.kv[names.worker_key("m", "1", w)] = {"worker_id": w, "pool": "local"}


async def started(reg, **cfg) -> tuple[MemoryBus, Autoscaler]:
    bus = MemoryBus()
    cfg.setdefault("cpu_limits", {"validator": Limits(1, 3), "gateway": Limits(1, 1)})
    scaler = Autoscaler(bus, reg, AutoscalerConfig(elect=False, warmup_s=0.0, **cfg))
    scaler._subs = [await bus.subscribe(subjects.LOAD_ALL, scaler._on_load),
                    await bus.subscribe(subjects.credits_all(), scaler._on_credits),
                    await bus.subscribe(subjects.done_all(), scaler._on_done)]  # as start(), without the loop
    await scaler.become_leader()
    return bus, scaler


async def report(bus, kind, aid, **kw) -> None:
    await bus.publish(subjects.load_subject(kind, aid), ActorLoad(kind, aid, time.time(), 1.0, **kw).encode())


async def heartbeat(bus, wid, free=90, served=None, draining=False) -> None:
    await bus.publish(subjects.credits("m", "1", wid), Credits(wid, "m", "1", free, 100, 4, 8, 16, draining=draining,
                                                               served=served or {}, ts=time.time()).encode())


async def settle() -> None:
    await asyncio.sleep(0.02)


def desired(reg, *parts) -> int | None:
    v = reg.kv.get(names.desired_key(*parts))
    return None if v is None else v["count"]


def history(reg) -> list[dict]:
    return (reg.kv.get(names.autoscaler_decisions_key()) or {}).get("decisions", [])


async def test_validator_bound_load_adds_a_validator_and_no_worker():
    reg = DictRegistry()
    stack(reg)
    bus, scaler = await started(reg)
    await report(bus, "validator", "v1", pending=9, wait_ms_p90=450.0, cpu_util=0.3, handled=5)
    await report(bus, "gateway", "gw-0", loop_lag_ms_p95=1.0, cpu_util=0.1)
    await report(bus, "scheduler", "s1", name="m", version="1", workers=1)
    await heartbeat(bus, "w0")
    await settle()
    made = await scaler.tick()
    assert [d.target for d in made] == ["validator"]
    assert desired(reg, "validator") == 2  # wait 450 / target 100 -> 5 replicas, at most 2 x per step
    assert desired(reg, "worker", "m", "1", "local") is None and desired(reg, "gateway") is None
    (d,) = history(reg)
    assert d["loop"] == "cpu" and d["current"] == 1 and d["desired"] == 2 and "wait p90 450 ms" in d["reason"]
    assert d["inputs"]["wait"] == 450.0 and d["inputs"]["replicas"] == 1
    stored = reg.kv[names.desired_key("validator")]
    assert stored["by"] == scaler.cfg.controller_id and stored["reason"] == d["reason"]
    assert scaler.snapshot["cpu"]["validator"]["pending"] == 9.0
    assert await scaler.tick() == []  # the policy remembers: no repeat while the replicas start


async def test_accelerator_bound_load_adds_a_worker_and_no_validator():
    reg = DictRegistry()
    stack(reg)
    bus, scaler = await started(reg, pools=PoolConfig(cooldown_up_s=0.0))
    await report(bus, "validator", "v1", pending=0, wait_ms_p90=3.0, cpu_util=0.1, loop_lag_ms_p95=0.5)
    await report(bus, "scheduler", "s1", name="m", version="1", queue_tokens=4000.0, queue_len=40,
                 arrivals_tokens_per_s=200.0, workers=1)
    await heartbeat(bus, "w0", free=5, served={"t": [100, 100]})
    for i in range(5):
        rec = CompletionRecord(f"r{i}", "t", "m", "1", "ok", "stop", 10, 20, {"queue_ms": 3000.0, "prefill_ms": 100.0,
                                                                             "decode_ms": 1900.0}, ts=time.time())
        await bus.publish(subjects.done("m", "1"), rec.encode())
    await settle()
    made = await scaler.tick()
    assert [d.target for d in made] == ["worker/m/1/local"]
    assert desired(reg, "worker", "m", "1", "local") == 2 and desired(reg, "validator") is None
    d = history(reg)[-1]
    assert d["loop"] == "pool" and d["inputs"]["ttft_ms_p90"] == 3100.0
    assert d["inputs"]["kv_util"] == pytest.approx(0.95)
    assert "ttft p90" in d["reason"]


async def test_scale_from_zero_on_a_held_request():
    reg = DictRegistry()
    stack(reg, workers=(), autoscale={"scale_to_zero": True, "min_workers": 1, "max_workers": 2})
    bus, scaler = await started(reg)
    await report(bus, "scheduler", "s1", name="m", version="1", queue_len=1, cold_start_waiting=1,
                 arrivals_tokens_per_s=4.0, workers=0)
    await settle()
    made = await scaler.tick()
    assert [(d.target, d.current, d.desired) for d in made] == [("worker/m/1/local", 0, 1)]
    assert "scale from zero" in made[0].reason and desired(reg, "worker", "m", "1", "local") == 1


async def test_a_preempted_worker_is_replaced_and_the_new_leader_adopts_stored_counts():
    reg = DictRegistry()
    stack(reg, workers=("w0", "w1"))
    reg.kv[names.desired_key("worker", "m", "1", "local")] = {"count": 2, "ts": time.time() - 1000, "reason": "x"}
    reg.kv[names.desired_key("validator")] = {"count": 2, "ts": time.time(), "reason": "x"}
    reg.kv[names.autoscaler_decisions_key()] = {"decisions": [{"ts": 1.0, "loop": "cpu", "target": "validator",
                                                               "current": 1, "desired": 2, "reason": "old"}]}
    reg.kv[names.preemption_notice_key("w1")] = {"deadline": time.time() + 120, "reason": "spot"}
    bus, scaler = await started(reg, worker_limits=Limits(1, 3))
    assert scaler.cpu_policy.desired("validator") == 2 and scaler.pool_policy.active_target("m/1/local") == 2
    await report(bus, "validator", "v1", cpu_util=0.4, wait_ms_p90=50.0)
    await report(bus, "validator", "v2", cpu_util=0.4, wait_ms_p90=50.0)
    await report(bus, "scheduler", "s1", name="m", version="1", queue_len=1, queue_tokens=10.0, workers=2)
    for w in ("w0", "w1"):
        await heartbeat(bus, w, served={"t": [0, 50]})
    await settle()
    made = await scaler.tick()
    assert [(d.target, d.desired) for d in made] == [("worker/m/1/local", 3)]  # 2 active wanted + 1 leaving
    assert scaler.snapshot["pools"]["m/1/local"]["leaving"] == 1 and scaler.snapshot["leaving"] == ["w1"]
    assert [d["reason"] for d in history(reg)][0] == "old" and len(history(reg)) == 2  # history kept


async def test_policy_tuning_and_the_cpu_tier_never_reads_pool_signals():
    reg = DictRegistry()
    stack(reg)
    bus, scaler = await started(reg, cpu=CpuTierConfig(cooldown_up_s=0.0))
    await report(bus, "validator", "v1", loop_lag_ms_p95=80.0, cpu_util=0.4, handled=20)  # busy: its lag is load
    await report(bus, "scheduler", "s1", name="m", version="1", queue_tokens=1e6, queue_len=500, workers=1)
    await settle()
    first = await scaler.tick()
    assert [d.target for d in first] == ["validator"] and first[0].inputs.get("lag") == 80.0
    assert "queue_tokens" not in first[0].inputs  # only the kind's own signals
    await report(bus, "validator", "v2", loop_lag_ms_p95=80.0, cpu_util=0.4, handled=20)  # the new one is loaded too
    await settle()
    second = await scaler.tick()  # cooldown_up_s 0 (default 10 s would hold it): up again, to the ceiling
    assert [(d.target, d.current, d.desired) for d in second] == [("validator", 2, 3)]


async def test_history_is_bounded_and_warmup_holds_decisions():
    reg = DictRegistry()
    stack(reg)
    reg.kv[names.autoscaler_decisions_key()] = {"decisions": [
        {"ts": float(i), "loop": "cpu", "target": "validator", "current": 1, "desired": 1 + i % 2, "reason": f"{i}"}
        for i in range(200)]}
    bus = MemoryBus()
    scaler = Autoscaler(bus, reg, AutoscalerConfig(elect=False, warmup_s=30.0))
    await scaler.become_leader()
    scaler.loads.add(time.monotonic(), ActorLoad("validator", "v1", time.time(), 1.0, pending=50))
    assert await scaler.tick() == []  # a new leader waits for fresh reports first
    scaler.leader_since -= 31.0
    made = await scaler.tick()
    assert made and len(history(reg)) == 200 and history(reg)[-1]["reason"] == made[-1].reason


async def test_start_runs_the_loop_without_election_and_stops():
    reg = DictRegistry()
    stack(reg)
    bus = MemoryBus()
    scaler = Autoscaler(bus, reg, AutoscalerConfig(elect=False, warmup_s=0.0, tick_s=0.05))
    await scaler.start()
    await report(bus, "validator", "v1", pending=20)
    for _ in range(100):
        if desired(reg, "validator") is not None:
            break
        await asyncio.sleep(0.02)
    assert scaler.is_leader and desired(reg, "validator") == 2
    await scaler.stop()
    assert not scaler.is_leader and scaler._subs == []


@pytest.mark.parametrize("bad", [b"not json", b'{"kind":"validator"}'])
async def test_bad_messages_are_ignored(bad):
    reg = DictRegistry()
    bus, scaler = await started(reg)
    await bus.publish(subjects.load_subject("validator", "v1"), bad)
    await bus.publish(subjects.credits("m", "1", "w0"), bad)
    await bus.publish(subjects.done("m", "1"), bad)
    await settle()
    assert scaler.loads.fresh(time.monotonic(), "validator") == [] and scaler.credits.latest == {}


def curve_json(pool: str) -> dict:
    return {"pool": pool, "measured_at": 1.0, "cpu": "test",
            "decode": [{"batch": 1, "tokens_per_s": 20.0, "itl_ms": 50.0}, {"batch": 4, "tokens_per_s": 60.0,
                                                                            "itl_ms": 90.0},
                       {"batch": 8, "tokens_per_s": 80.0, "itl_ms": 150.0}]}


async def test_a_pool_mix_starts_workers_where_the_mix_wants_them():
    """Two priced pools with measured curves: the version's demand goes to the pools of the cheapest mix
    (mix.plan_mix), each of which scales from zero up to its count; the default pool keeps its floor."""
    from control.policy.curves import ThroughputCurve
    from actors.autoscaler.mix import PoolOffer, plan_mix
    from control.state.pools import PoolRecord

    reg = DictRegistry()
    stack(reg)  # one worker on local (no pool record: not part of the mix)
    records = {"od": {"price_on_demand_per_h": 1.0, "max_workers": 4},
               "spot": {"price_spot_per_h": 0.3, "market": "spot", "preemption_rate_per_h": 3.0, "max_workers": 4}}
    for pool, rec in records.items():
        reg.kv[names.pool_key(pool)] = rec
        reg.kv[names.profile_key("m", "1", pool)] = curve_json(pool)
    bus, scaler = await started(reg)
    await report(bus, "scheduler", "s1", name="m", version="1", queue_len=2, queue_tokens=50.0,
                 arrivals_tokens_per_s=100.0, workers=1)
    await settle()
    made = await scaler.tick()
    offers = [PoolOffer.from_record(PoolRecord.from_json(p, r), ThroughputCurve.from_json(curve_json(p)))
              for p, r in records.items()]
    # the mix covers demand / target_util: the pool policy keeps its headroom under the mix's ceilings
    plan = plan_mix(100.0 / scaler.cfg.pools.target_util, offers, scaler.cfg.pools.default_slo).workers
    assert scaler.mixes == {("m", "1"): dict(plan)} and sum(plan.values()) >= 2
    want = {f"worker/m/1/{p}": n for p, n in plan.items() if n > 0}
    assert {d.target: d.desired for d in made} == want  # each mix pool from zero to its count, nothing else
    assert all("scale from zero" in d.reason for d in made)
    assert scaler.snapshot["limits"]["m/1/od"]["ceiling"] == max(1, plan["od"])
    assert scaler.snapshot["pools"]["m/1/local"]["arrival_tokens_per_s"] == 0.0  # not in the mix


async def test_carry_sleep_writes_sleep_and_wake_records_and_the_export_counts_running_plus_sleeping():
    """Issue [28] without a supervisor (actors/autoscaler/sleep_carry.py): two awake workers for a desired count of
    1 that recent history wanted at 2: the extra sleeps by record, the desired record gets the plan, and the
    exported count (what KEDA follows) stays 2 -- no pod goes; a count of 2 again wakes the sleeper by record."""
    from actors.autoscaler import export

    reg = DictRegistry()
    stack(reg, workers=("w0", "w1"))
    reg.kv[names.desired_key("worker", "m", "1", "local")] = {"count": 1, "ts": time.time(), "reason": "idle"}
    bus, scaler = await started(reg, carry_sleep=True)
    scaler.sleep_policy.observe("m/1/local", time.time() - 30, 2)  # the pool ran 2 until the scale-down
    await scaler.tick()
    assert reg.kv[names.sleep_key("w1")]["want"] == "sleep" and names.sleep_key("w0") not in reg.kv
    plan = reg.kv[names.desired_key("worker", "m", "1", "local")]["sleep"]
    assert plan["keep"] == 1 and plan["exit"] == [] and plan["wanted_again"] == 1
    assert dict((lab["target"], v) for v, lab in export.desired_samples(scaler))["worker/m/1/local"] == 2.0
    reg.kv[names.worker_key("m", "1", "w1")]["sleep"] = {"state": "sleeping", "since": time.time(), "wake_s": 0.5}
    await scaler.tick()
    assert scaler.snapshot["pools"]["m/1/local"]["sleeping"] == 1 and scaler.sleep_commands == 1
    assert dict((lab["target"], v) for v, lab in export.desired_samples(scaler))["worker/m/1/local"] == 2.0
    reg.kv[names.desired_key("worker", "m", "1", "local")]["count"] = 2
    await scaler.tick()
    assert reg.kv[names.sleep_key("w1")]["want"] == "wake" and scaler.sleep_commands == 2
    assert dict((lab["target"], v) for v, lab in export.desired_samples(scaler))["worker/m/1/local"] == 2.0
