"""Rollout controller against real nats-server + etcd, fed with synthetic completion records on
``as.int.done.<name>.<version>``: a healthy canary is stepped and promoted, a failing one is rolled back with
its reasons in etcd; CAS writes never overwrite an operator's edit; one active replica (election)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bus import subjects
from bus.messages import CompletionRecord
from bus.nats_bus import NatsBus
from control.state import names
from actors.rollout.actor import RolloutController
from control.state.routing import RoutingTable, start_rollout

REPO = Path(__file__).resolve().parents[2]
FAST = ["--window-s", "5", "--min-samples", "5", "--step-interval-s", "0.3"]


def _model() -> str:
    return f"ro-{uuid.uuid4().hex[:8]}"


def cli(infra, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ACTORSERVE_ETCD": infra.etcd_url, "ACTORSERVE_NATS": infra.nats_url}
    return subprocess.run([sys.executable, "-m", "control.ops.cli", "rollout", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


async def register(registry, name: str, *versions: str, status: str = "active") -> None:
    for v in versions:
        await registry.put_model_version(name, v, {"artifact": f"/nowhere/{name}-{v}.gguf", "status": status})


def record(name: str, version: str, i: int, status: str = "ok", ttft_ms: float = 20.0) -> bytes:
    return CompletionRecord(f"{version}-{i}", "t", name, version, status, "stop" if status == "ok" else "abort",
                            4, 11, {"queue_ms": 5.0, "prefill_ms": ttft_ms - 5.0, "decode_ms": 100.0},
                            ts=time.time()).encode()


@contextlib.asynccontextmanager
async def traffic(bus, name: str, *, canary_error_every: int = 0, period_s: float = 0.02):
    """Publish one stable (1) and one canary (2) record every ``period_s`` until the block ends; every
    ``canary_error_every``-th canary record is an error (0: none)."""
    async def loop() -> None:
        i = 0
        while True:
            i += 1
            await bus.publish(subjects.done(name, "1"), record(name, "1", i))
            bad = canary_error_every and i % canary_error_every == 0
            await bus.publish(subjects.done(name, "2"), record(name, "2", i, "error" if bad else "ok"))
            await asyncio.sleep(period_s)
    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_table(registry, name: str, cond, timeout: float = 20.0) -> RoutingTable:
    t_end = time.monotonic() + timeout
    while True:
        t = RoutingTable.from_dict(await registry.get_routing(name))
        if cond(t) or time.monotonic() > t_end:
            return t
        await asyncio.sleep(0.05)


async def test_healthy_canary_is_stepped_then_promoted(infra, registry):
    name = _model()
    await register(registry, name, "1", "2")
    r = await asyncio.to_thread(cli, infra, "start", name, "--canary", "2", "--weight", "5", "--steps", "5,50,100",
                                *FAST)
    assert r.returncode == 0, r.stderr
    assert "stable " + name + "@1" in r.stdout  # stable defaulted to the highest active other version
    bus = await NatsBus.connect(infra.nats_url, name="test-rollout-healthy")
    ctl = RolloutController(bus, registry, interval_s=0.1, elect=False)
    try:
        async with ctl, traffic(bus, name):
            t = await wait_table(registry, name, lambda t: t.state != "canary")
    finally:
        await bus.close()
    assert t.state == "promoted" and t.stable == "2" and t.last_good == "1" and t.canary is None
    acts = [(d["action"], d["by"], d["weight"]) for d in t.decisions]
    assert acts == [("start", "cli", 5.0), ("step", "controller", 50.0), ("promote", "controller", 0.0)]
    step = t.decisions[1]
    assert step["reasons"][0] == "healthy at 5%: canary weight 5% -> 50%"
    assert any(x.startswith("error rate: canary 0.0%") for x in step["reasons"])
    assert any(x.startswith("TTFT p95: canary 20.0 ms vs stable 20.0 ms") for x in step["reasons"])
    assert t.decisions[2]["ts"] - step["ts"] >= 0.3  # step interval respected
    print(f"healthy canary: start -> promote in {t.decisions[2]['ts'] - t.decisions[0]['ts']:.2f} s")
    r = await asyncio.to_thread(cli, infra, "status", name)
    assert r.returncode == 0 and "state:    promoted" in r.stdout and "promote  by controller" in r.stdout


async def test_failing_canary_is_rolled_back_with_reasons_in_etcd(infra, registry):
    name = _model()
    await register(registry, name, "1", "2")
    r = await asyncio.to_thread(cli, infra, "start", name, "--canary", "2", "--weight", "5", *FAST)
    assert r.returncode == 0, r.stderr
    bus = await NatsBus.connect(infra.nats_url, name="test-rollout-bad")
    ctl = RolloutController(bus, registry, interval_s=0.1, elect=False)
    try:
        async with ctl, traffic(bus, name, canary_error_every=2):
            t0 = time.monotonic()
            t = await wait_table(registry, name, lambda t: t.state != "canary")
            took = time.monotonic() - t0
    finally:
        await bus.close()
    assert t.state == "rolled_back" and t.stable == "1" and t.canary is None and t.weight == 0.0
    assert took < 5.0  # well within the 5 s window
    print(f"failing canary: rolled back {took:.2f} s after traffic began: {t.decisions[-1]['reasons'][0]}")
    last = t.decisions[-1]
    assert (last["action"], last["by"], last["weight"]) == ("rollback", "controller", 0.0)
    assert last["reasons"][0].startswith("error rate: canary ")
    r = await asyncio.to_thread(cli, infra, "status", name, "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    assert shown["state"] == "rolled_back" and shown["decisions"][-1]["reasons"] == last["reasons"]
    assert shown["effective_analysis"]["min_samples"] == 5
    # nothing more to roll back or promote: refused with exit 2
    r = await asyncio.to_thread(cli, infra, "promote", name)
    assert r.returncode == 2 and "no rollout is running" in r.stderr


async def test_controller_never_overwrites_a_concurrent_operator_edit(infra, registry):
    name = _model()
    await register(registry, name, "1", "2")
    table = start_rollout(RoutingTable(), stable="1", canary="2", weight=5,
                          analysis={"min_samples": 3, "step_interval_s": 0, "window_s": 5})
    await registry.put_routing(name, table.to_dict())

    class OperatorInBetween:
        """Registry proxy: right after the controller reads the table, an operator moves the weight."""

        def __init__(self, reg) -> None:
            self.reg = reg

        def __getattr__(self, attr):
            return getattr(self.reg, attr)

        async def get_json_rev(self, key):
            got = await self.reg.get_json_rev(key)
            from control.state.routing import set_weight
            edited = set_weight(RoutingTable.from_dict(got[0]), 7, by="cli", reasons=["operator"])
            await self.reg.put_json(key, edited.to_dict())
            return got

    ctl = RolloutController(None, OperatorInBetween(registry), elect=False)
    now = time.time() + 1
    for v in ("1", "2"):
        for i in range(5):
            from actors.rollout.policy import Sample
            ctl.add_sample(name, v, Sample(now - 0.5, "ok", 10.0, 5.0))
    assert await ctl.tick(now) == []  # the controller wanted to step, lost the race, wrote nothing
    assert ctl.last_decisions[name].action == "step"
    t = RoutingTable.from_dict(await registry.get_routing(name))
    assert t.weight == 7.0 and t.decisions[-1]["by"] == "cli"
    written = await RolloutController(None, registry, elect=False)._decide(name, now)  # no race: writes
    assert written is None or written.action == "wait"  # fresh controller has no samples


async def test_cli_start_checks_versions(infra, registry):
    name = _model()
    await register(registry, name, "1")
    await register(registry, name, "2", status="disabled")
    r = await asyncio.to_thread(cli, infra, "start", name, "--canary", "2")
    assert r.returncode == 2 and "is disabled, not active" in r.stderr
    r = await asyncio.to_thread(cli, infra, "start", name, "--canary", "9")
    assert r.returncode == 2 and "is not registered" in r.stderr
    r = await asyncio.to_thread(cli, infra, "start", name, "--canary", "1")
    assert r.returncode == 2 and "no active version" in r.stderr
    assert await registry.get_routing(name) is None


async def start_leading(ctl: RolloutController, timeout: float = 10.0) -> None:
    """Start ``ctl`` and wait (bounded) until it holds the election; a replica started after it stands by."""
    await ctl.start()
    t_end = time.monotonic() + timeout
    while not ctl.is_leader and time.monotonic() < t_end:
        await asyncio.sleep(0.05)


async def test_one_active_replica_and_takeover(infra, registry):
    bus_a = await NatsBus.connect(infra.nats_url, name="test-rollout-a")
    bus_b = await NatsBus.connect(infra.nats_url, name="test-rollout-b")
    a = RolloutController(bus_a, registry, interval_s=0.1, controller_id="ctl-a", lease_ttl=1)
    b = RolloutController(bus_b, registry, interval_s=0.1, controller_id="ctl-b", lease_ttl=1)
    try:
        await start_leading(a)
        await b.start()
        await asyncio.sleep(0.6)
        assert a.is_leader and not b.is_leader
        assert (await registry.get_json(names.controller_key("rollout")))["id"] == "ctl-a"
        await a.stop()  # resigns: b takes over within its campaign poll
        t0 = time.monotonic()
        while not b.is_leader and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.05)
        assert b.is_leader and time.monotonic() - t0 < 2.0
    finally:
        await a.stop()
        await b.stop()
        await bus_a.close()
        await bus_b.close()


async def test_hears_a_models_records_only_while_it_is_in_rollout(infra, registry):
    """No rollout: no completion record reaches the controller (issue [25]: it decoded every request's). A
    rollout starts: within its interval the controller hears that model's records (both versions); the
    rollout ends (rolled back by hand): it stops hearing them. A standby follows the same way."""
    name = _model()
    await register(registry, name, "1", "2")
    bus = await NatsBus.connect(infra.nats_url, name="test-rollout-listen")
    lead_ = RolloutController(bus, registry, interval_s=0.1, controller_id="ctl-lead", lease_ttl=2)
    standby = RolloutController(bus, registry, interval_s=0.1, controller_id="ctl-standby", lease_ttl=2)
    try:
        await start_leading(lead_)
        await standby.start()
        async with traffic(bus, name):
            await asyncio.sleep(0.5)
            assert lead_.windows == {} and standby.windows == {}  # nothing in rollout: nothing heard
            r = await asyncio.to_thread(cli, infra, "start", name, "--canary", "2", "--weight", "5",
                                        "--window-s", "60", "--min-samples", "100000")
            assert r.returncode == 0, r.stderr
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end and not all(
                    (name, v) in c.windows for c in (lead_, standby) for v in ("1", "2")):
                await asyncio.sleep(0.05)
            for c in (lead_, standby):
                assert {(name, "1"), (name, "2")} <= set(c.windows), c.windows
            r = await asyncio.to_thread(cli, infra, "rollback", name)
            assert r.returncode == 0, r.stderr
            await asyncio.sleep(0.5)  # a few intervals: both unsubscribed
            heard = {c.controller_id: len(c.windows[(name, "1")]) for c in (lead_, standby)}
            await asyncio.sleep(0.4)
            assert lead_.is_leader and not standby.is_leader
            assert heard == {c.controller_id: len(c.windows[(name, "1")]) for c in (lead_, standby)}
    finally:
        await lead_.stop()
        await standby.stop()
        await bus.close()
