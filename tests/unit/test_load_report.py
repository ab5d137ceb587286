"""actors/load_report.py: the window arithmetic (pure), the ActorLoad message, the reporter on the in-memory
bus, the subscription ``pending()`` of both buses' contract, and the validator's test-only delay fault."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.load_report import LoadReporter, LoadWindow, new_actor_id, percentile
from actors.validator import faults
from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ActorLoad


def test_percentile_nearest_rank():
    assert percentile([], 0.95) == 0.0
    assert percentile([5.0], 0.9) == 5.0
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.95) == 95.0 and percentile(values, 0.90) == 90.0
    assert percentile(list(reversed(values)), 0.5) == 50.0


def test_window_figures_and_reset():
    w = LoadWindow(started=100.0, cpu_started=10.0)
    for lag in [1.0] * 19 + [40.0]:
        w.add_lag(lag)
    w.add_lag(-3.0)  # an early wake-up counts as no lag: 21 samples, one stall -> p95 (rank 20) is 1 ms
    for ms in range(1, 11):
        w.add_wait(float(ms * 10))  # 10 .. 100 ms
    w.add_wait(None)  # counted, no wait
    out = w.close(now=102.0, cpu_now=11.5)
    assert out == {"window_s": 2.0, "loop_lag_ms_p95": 1.0, "loop_drift_ms_p95": 1.0,
                   "cpu_util": 0.75, "wait_ms_p90": 90.0, "handled": 11}
    assert (w.started, w.cpu_started, w.lags_ms, w.waits_ms, w.handled) == (102.0, 11.5, [], [], 0)
    empty = w.close(now=103.0, cpu_now=11.5)
    assert empty == {"window_s": 1.0, "loop_lag_ms_p95": 0.0, "loop_drift_ms_p95": 0.0, "cpu_util": 0.0,
                     "wait_ms_p90": 0.0, "handled": 0}


def test_drift_without_cpu_is_starvation_not_lag():
    """A loop that woke 50 ms late having used no CPU was starved by other processes: no lag; one that used the
    CPU meanwhile was busy: its drift is lag."""
    w = LoadWindow(0.0, 0.0)
    for _ in range(10):
        w.add_lag(50.0, cpu_ms=0.5)  # starved: 50 ms late, 0.5 ms of CPU over the interval
    starved = w.close(1.0, 0.0)
    assert starved["loop_drift_ms_p95"] == 50.0 and starved["loop_lag_ms_p95"] == 0.5
    for _ in range(10):
        w.add_lag(50.0, cpu_ms=95.0)  # busy: it ran the whole time
    busy = w.close(2.0, 0.1)
    assert busy["loop_lag_ms_p95"] == 50.0 == busy["loop_drift_ms_p95"]


async def test_a_busy_loop_reports_lag():
    """Real clocks: a handler that blocks the loop for 80 ms of CPU at a time shows up as lag (it used the CPU;
    spun on CPU time, so a loaded machine only stretches the drift)."""
    bus = MemoryBus()
    rep = LoadReporter(bus, "validator", "v1", period_s=10.0, lag_sample_s=0.01)
    await rep.start()
    for _ in range(6):
        busy_until = time.process_time() + 0.08
        while time.process_time() < busy_until:  # burn CPU on the loop
            pass
        await asyncio.sleep(0.005)
    fig = rep.window.close(time.monotonic(), time.process_time())
    await rep.stop()
    assert fig["loop_lag_ms_p95"] >= 40.0 and fig["loop_drift_ms_p95"] >= fig["loop_lag_ms_p95"], fig


def test_window_p95_of_a_stall():
    w = LoadWindow(0.0, 0.0)
    for lag in [1.0] * 18 + [40.0, 60.0]:
        w.add_lag(lag)
    assert w.close(1.0, 0.0)["loop_lag_ms_p95"] == 40.0  # rank ceil(0.95 * 20) = 19


def test_actor_load_round_trip_and_validation():
    m = ActorLoad("scheduler", "sched-1", 1.0, 1.0, 2.5, 0.4, 3, 12.0, 7, name="m", version="1", queue_tokens=80.0,
                  queue_len=2, arrivals_tokens_per_s=10.0, served_tokens_per_s=8.0, workers=0, cold_start_waiting=2)
    assert ActorLoad.decode(m.encode()) == m
    old = ActorLoad.decode(b'{"kind":"validator","actor_id":"v","ts":1,"window_s":1,"future_field":3}')
    assert old.pending == 0 and old.name == "" and old.cold_start_waiting == 0
    with pytest.raises(ValueError, match="pending"):
        ActorLoad("validator", "v", 1.0, 1.0, pending=-1)
    with pytest.raises(ValueError, match="cpu_util"):
        ActorLoad("validator", "v", 1.0, 1.0, cpu_util=float("nan"))


def test_load_subjects_and_ids():
    assert subjects.load_subject("validator", "v-1") == "as.int.load.validator.v-1"
    assert subjects.LOAD_ALL == "as.int.load.>"
    with pytest.raises(ValueError):
        subjects.load_subject("validator", "a.b")
    aid = new_actor_id("validator")
    assert aid.startswith("validator-") and subjects.load_subject("validator", aid)
    with pytest.raises(ValueError):
        LoadReporter(MemoryBus(), "validator", "bad id")


async def test_reporter_publishes_pending_waits_and_extras():
    bus = MemoryBus()
    got: list[ActorLoad] = []

    async def on(msg):
        got.append(ActorLoad.decode(msg.data))
    await bus.subscribe(subjects.LOAD_ALL, on)
    rep = LoadReporter(bus, "validator", "v1", period_s=0.1, lag_sample_s=0.01, pending=lambda: 4,
                       extras=lambda: {"name": "m"})
    await rep.start()
    now = time.time()
    for ms in (10, 20, 300):
        rep.waited(now - ms / 1e3, now)
    rep.count(2)
    deadline = time.monotonic() + 2.0
    while not got and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await rep.stop()
    first = got[0]
    assert (first.kind, first.actor_id, first.pending, first.handled, first.name) == ("validator", "v1", 4, 5, "m")
    assert first.wait_ms_p90 == pytest.approx(300.0, abs=1.0)
    assert 0.05 < first.window_s < 1.0 and first.cpu_util >= 0.0
    assert rep.sent == len(got) and rep.last == got[-1]


async def test_reporter_survives_a_disconnected_bus():
    bus = MemoryBus()
    rep = LoadReporter(bus, "gateway", "gw-0", period_s=0.05, lag_sample_s=0.01)
    await rep.start()
    bus.disconnect()
    await asyncio.sleep(0.2)
    assert rep.sent == 0 and all(not t.done() for t in rep._tasks)  # nothing sent, still running
    bus.connected = True
    await asyncio.sleep(0.15)
    await rep.stop()
    assert rep.sent >= 1


async def test_memory_subscription_pending_counts_undelivered_messages():
    bus = MemoryBus()
    release = asyncio.Event()

    async def slow(msg):
        await release.wait()
    sub = await bus.subscribe("a.b", slow)
    for _ in range(4):
        await bus.publish("a.b", b"x")
    await asyncio.sleep(0.01)  # the first one is being handled, three wait
    assert sub.pending() == 3
    release.set()
    await asyncio.sleep(0.01)
    assert sub.pending() == 0
    await sub.unsubscribe()


def test_validator_delay_fault_needs_test_faults():
    assert faults.from_env({}) is None
    assert faults.from_env({faults.ENV_DELAY_MS: "50"}) is None  # test faults off: ignored
    assert faults.from_env({faults.ENV_DELAY_MS: "0", faults.ENV_TEST_FAULTS: "1"}) is None
    fault = faults.from_env({faults.ENV_DELAY_MS: "50", faults.ENV_TEST_FAULTS: "1"})
    assert fault is not None and fault.delay_ms == 50.0
    with pytest.raises(ValueError, match=faults.ENV_DELAY_MS):
        faults.from_env({faults.ENV_DELAY_MS: "soon", faults.ENV_TEST_FAULTS: "1"})
    with pytest.raises(ValueError):
        faults.ValidatorDelay(-1.0)


async def test_validator_delay_fault_holds_one_request_at_a_time():
    fault = faults.ValidatorDelay(50.0)
    turns: list[float] = []
    t0 = time.monotonic()
    await asyncio.gather(*(fault.hold(lambda: turns.append(time.monotonic() - t0)) for _ in range(3)))
    elapsed = time.monotonic() - t0
    assert fault.held == 3 and elapsed >= 0.15  # serialised: 3 x 50 ms
    assert turns[1] >= 0.045 and turns[2] >= 0.095  # each turn starts after the previous hold


async def test_a_kick_sends_the_next_report_early_but_not_before_a_quarter_period():
    bus = MemoryBus()
    rep = LoadReporter(bus, "scheduler", "s1", period_s=2.0, lag_sample_s=0.01)
    await rep.start()
    try:
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        rep.kick()
        while rep.sent == 0 and time.monotonic() - t0 < 1.9:
            await asyncio.sleep(0.01)
        took = time.monotonic() - t0
        assert rep.sent == 1, "a kick did not send a report before the 2 s period"
        assert 0.3 <= took < 1.0, took  # not before period / 4 (0.5 s after the loop started, 0.05 s before the kick)
        await asyncio.sleep(0.8)
        assert rep.sent == 1  # no kick: the next report waits for its period
    finally:
        await rep.stop()
