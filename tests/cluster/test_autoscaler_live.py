"""The autoscaler live on ``actorserve up`` stacks (issue 19 targets), run by ``make cluster-test`` (collected
only with ``ACTORSERVE_CLUSTER=1``). No root needed. The tiny random-weight model of the other e2e tests;
cool-downs shortened with the autoscaler's ``--policy-set`` (through the Supervisor's ``actor_args``); every
test prints its figures.

* Desired counts written by hand (no autoscaler): the supervisor starts a worker and a validator, they
  become ready (cold start measured: spawn -> lease, spawn -> first credits), the new worker takes traffic;
  lowered while streams run (300 tokens, 1.5/s), the newest worker drains and every stream completes;
  nothing restarts it.
* Validator-bound load (``ACTORSERVE_TEST_FAULTS=1`` + ``ACTORSERVE_FAULT_VALIDATOR_DELAY_MS``: each
  validator holds each request that long, one at a time, so the validator tier is the bottleneck; on 2
  cores tokenization is otherwise cheaper than prefill): validators are added, no worker.
* Accelerator-bound 3x load step (1-slot workers, long streams): a worker is added, no validator, and it
  takes traffic (its first dispatch) soon after its cold start (spawn -> lease); the figure against the issue's
  target (cold start + 2 s) is printed, and measured over several runs by ``bench/autoscaler_step_bench.py``.
* Scale-down after the 3x step stops (back to the base load, so streams run across it): 0 failed requests.

Before any load each autoscaled stack idles a few seconds: the autoscaler must keep today's counts
(its decisions in etcd are read; asserted last, after the other figures are measured). Only processes
these stacks started are signalled (recorded pids).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from control.state.names import autoscaler_decisions_key, desired_key
from control.state.registry import Registry
from tests.engine_fixtures import write_tiny_llama_gguf

pytestmark = [pytest.mark.cluster]

MODEL = "tiny"
# 1 slot per worker: the worker is the bottleneck of a few concurrent long streams (accelerator-bound). Two-thread
# steps (a one-slot worker's steps are all one-row steps, which the worker's default runs on one thread: decision
# 0051), as the figures in docs/autoscaling.md were measured with.
def worker_options(slots: int = 1) -> list[str]:
    """The workers' options with ``slots`` slots (``--max-num-seqs``)."""
    return ["--kv-cache-bytes", "8000000", "--max-num-seqs", str(slots), "--no-progress", "--drain-timeout", "8",
            "--small-step-tokens", "0"]


WORKER_ARGS = worker_options(1)
# Short cool-downs and windows so that a test sees a scale-up and a scale-down within a minute.
POLICY = ["cpu.cooldown_up_s=2", "cpu.down_window_s=3", "cpu.cooldown_down_s=4",
          "pool.cooldown_up_s=2", "pool.down_window_s=3", "pool.cooldown_down_s=4",
          "pool.queue_drain_high_s=0.5", "pool.queue_drain_low_s=0.1"]
DEADLINE_MS = 30_000
# One 1-slot worker served ~800 tokens/s of 400-token streams on an AVX-512 machine (~2 requests/s); from one
# stack to the next the same worker measured 0.45-1.25 s a stream (a 2-thread step shares 2 cores with the
# stack), so the base rate is BASE_SHARE of what this stack's worker serves: first from three streams served
# alone (base_rate), then again from the streams of the base load itself (rebase), which run as the step's do.
# 50 % -> the 3x step is 150 %: a calibration 25 % off (seen) still leaves the step above what one worker serves.
BASE_RATE = 2.0  # at most this many requests/s at the base load (what the load generator keeps up with)
BASE_SHARE = 0.5
REBASE_OFF = 0.15  # a base load measured this far off its calibration is set again and run 4 s more


async def base_rate(sup, max_tokens: int = 400) -> float:
    """BASE_RATE, or less: BASE_SHARE of one 1-slot worker's rate, from the median of three streams served
    alone (the fastest of two overrated the worker now and then: a queue at the base load, a scale-up before
    the step), in requests/s."""
    async with httpx.AsyncClient(timeout=DEADLINE_MS / 1e3 + 10) as c:
        times = sorted((o.t_end - o.t_start) for o in [await one(c, sup, -1 - k, max_tokens) for k in range(3)]
                       if o.kind == "ok")
    assert times, "the calibration streams failed"
    return share_rate(times)


def share_rate(times: list[float]) -> float:
    """BASE_SHARE of one 1-slot worker's rate (requests/s, at most BASE_RATE) from the sorted seconds its
    streams took (their median)."""
    return min(BASE_RATE, BASE_SHARE / times[len(times) // 2])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_llama_gguf(path)
    return path


def _need_autoscaler() -> None:
    from actors.kinds import ACTOR_MODULES

    if "autoscaler" not in ACTOR_MODULES:
        pytest.skip("the autoscaler actor (actors/autoscaler/actor.py, kind 'autoscaler') is not registered yet")


@contextlib.contextmanager
def live_stack(state: Path, tiny: str, *, autoscaler: bool, env: dict | None = None,
               policy: list[str] | None = None, worker_args: list[str] | None = None, **cfg: Any) -> Iterator[Any]:
    """A supervised tiny-model stack (1 gateway, validator, worker), the autoscaler on or off; ``worker_args``:
    the workers' options (default WORKER_ARGS: 1 slot); ``cfg``: more StackConfig fields (e.g.
    ``sleep_horizon_s``)."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    args: dict[str, list[str]] = {"worker": WORKER_ARGS if worker_args is None else worker_args}
    if autoscaler:
        _need_autoscaler()
        args["autoscaler"] = ["--tick-s", "0.25", *[x for p in (policy or POLICY) for x in ("--policy-set", p)]]
    sup = Supervisor(StackConfig(state, port=0, supervise=True, model_file=tiny, model_name=MODEL, workers=1,
                                 autoscaler=autoscaler, actor_args=args, env=env or {}, **cfg))
    t0 = time.monotonic()
    sup.start()
    try:
        sup.wait_ready(timeout=120)
        print(f"stack ready in {time.monotonic() - t0:.1f} s ({len(sup.actors)} actors, cores {sup.cfg.cores})")
        yield sup
    finally:
        sup.stop()


# -- load ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one streamed request ended: ``kind`` ok | error (in-band) | http | hung | truncated."""

    kind: str
    status: int
    code: str | None
    t_start: float  # epoch s
    t_end: float


def headers_of(sup) -> dict:
    return {"Authorization": f"Bearer {(Path(sup.state_dir) / 'dev-api-key').read_text().strip()}"}


async def one(client: httpx.AsyncClient, sup, i: int, max_tokens: int) -> Outcome:
    """Stream one completion and classify its end (at most its deadline + 5 s)."""
    body = {"model": MODEL, "prompt": f"autoscaler {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "deadline_ms": DEADLINE_MS}
    t0 = time.time()
    try:
        async with asyncio.timeout(DEADLINE_MS / 1e3 + 5):
            async with client.stream("POST", sup.http_url + "/v1/completions", json=body,
                                     headers=headers_of(sup)) as r:
                text = (await r.aread()).decode()
    except (TimeoutError, httpx.HTTPError):
        return Outcome("hung", 0, None, t0, time.time())
    if r.status_code != 200:
        err = (orjson.loads(text).get("error") or {}) if text.startswith("{") else {}
        return Outcome("http", r.status_code, err.get("code"), t0, time.time())
    events = [orjson.loads(x[6:]) for x in text.splitlines() if x.startswith("data: ") and x != "data: [DONE]"]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        return Outcome("error", 200, errors[-1].get("code"), t0, time.time())
    done = text.rstrip().endswith("data: [DONE]")
    finished = any(c.get("finish_reason") == "length" for e in events for c in e.get("choices", []))
    return Outcome("ok" if done and finished else "truncated", 200, None, t0, time.time())


class Load:
    """Open-loop streamed requests at ``rate`` per second until :meth:`stop`; a new ``rate`` acts within
    20 ms (the next request is due 1/rate after the last one)."""

    def __init__(self, sup, max_tokens: int, rate: float) -> None:
        self.sup, self.max_tokens, self.rate = sup, max_tokens, rate
        self.results: list[asyncio.Task] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closers: list[asyncio.Task] = []

    async def _run(self) -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=300),
                                     timeout=DEADLINE_MS / 1e3 + 10) as c:
            i, last = 0, 0.0
            while not self._stop.is_set():
                if time.monotonic() >= last + 1.0 / self.rate:  # the rate is read every 20 ms: a step acts at once
                    last = time.monotonic()
                    self.results.append(asyncio.create_task(one(c, self.sup, i, self.max_tokens)))
                    i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.02)
            await asyncio.gather(*self.results)

    def burst(self, n: int) -> None:
        """Send ``n`` more requests at once (counted in :meth:`stop`'s outcomes): with 1-slot workers, more
        concurrent streams than workers put one on every worker whatever the scheduler's tie-break."""
        client = httpx.AsyncClient(timeout=DEADLINE_MS / 1e3 + 10)

        async def send(i: int) -> Outcome:
            return await one(client, self.sup, 10_000 + i, self.max_tokens)

        tasks = [asyncio.create_task(send(k)) for k in range(n)]
        closer = asyncio.create_task(self._close_after(client, tasks))
        self.results.extend(tasks)
        self._closers.append(closer)

    @staticmethod
    async def _close_after(client: httpx.AsyncClient, tasks: list[asyncio.Task]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()

    def start(self) -> "Load":
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> list[Outcome]:
        """Stop sending; wait for every request sent; their outcomes."""
        self._stop.set()
        await self._task
        await asyncio.gather(*self.results, *self._closers)
        return [t.result() for t in self.results]


def summary(results: list[Outcome]) -> str:
    kinds: dict[str, int] = {}
    for r in results:
        key = r.kind if r.kind == "ok" else f"{r.kind}:{r.status}:{r.code}"
        kinds[key] = kinds.get(key, 0) + 1
    lat = sorted(r.t_end - r.t_start for r in results) or [0.0]
    return f"{len(results)} requests: {kinds}; latency p50 {lat[len(lat) // 2]:.2f} s, max {lat[-1]:.2f} s"


class CreditsWatch:
    """Per worker id, epoch s of: its first credits heartbeat (``first``), the first heartbeat with a running
    sequence (``busy``; heartbeats are 4 Hz, so up to 250 ms late), its first dispatch (``dispatched``: the
    scheduler sent it a request, ``as.int.work.<id>``) and, with ``etcd_url``, its lease (``leased``: its
    worker record appeared in etcd; from then on schedulers may dispatch to it)."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.dispatched: dict[str, float] = {}
        self.leased: dict[str, float] = {}
        self._bus = None
        self._subs: list = []
        self._watch: asyncio.Task | None = None

    async def open(self, nats_url: str, etcd_url: str | None = None) -> "CreditsWatch":
        from bus import subjects
        from bus.messages import Credits
        from bus.nats_bus import NatsBus

        async def on(msg) -> None:
            c, now = Credits.decode(msg.data), time.time()
            self.first.setdefault(c.worker_id, now)
            if c.num_running > 0:
                self.busy.setdefault(c.worker_id, now)

        async def on_work(msg) -> None:
            self.dispatched.setdefault(msg.subject.rsplit(".", 1)[-1], time.time())
        self._bus = await NatsBus.connect(nats_url, name="test-autoscaler-credits")
        self._subs = [await self._bus.subscribe(subjects.credits_of_version(MODEL, "1"), on),
                      await self._bus.subscribe(subjects.work("x").rsplit(".", 1)[0] + ".*", on_work)]
        if etcd_url is not None:
            self._watch = asyncio.create_task(self._watch_leases(etcd_url))
        return self

    async def _watch_leases(self, etcd_url: str) -> None:
        from control.state.names import workers_prefix

        prefix = workers_prefix(MODEL, "1")
        async with Registry.connect(etcd_url, timeout=3) as reg:
            async for event, key, _ in reg.watch_prefix(prefix, include_existing=True):
                if event == "put":
                    self.leased.setdefault(key[len(prefix):].strip("/"), time.time())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        for sub in self._subs:
            await sub.unsubscribe()
        if self._bus is not None:
            await self._bus.close()


async def put_desired(sup, kind: str, *parts: str, count: int, reason: str) -> None:
    async with Registry.connect(sup.etcd_url, timeout=3) as reg:
        await reg.put_json(desired_key(kind, *parts),
                           {"count": count, "ts": time.time(), "reason": reason, "by": "test"})


async def decisions(sup) -> list[dict]:
    async with Registry.connect(sup.etcd_url, timeout=3) as reg:
        return ((await reg.get_json(autoscaler_decisions_key())) or {}).get("decisions", [])


async def until(pred, timeout: float, what: str, step: float = 0.1, diagnose=None) -> float:
    """Wait (bounded) until ``pred()`` is true; returns the epoch s it became true. ``diagnose``: an async
    callable whose result the assertion message carries when the wait runs out."""
    t_end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= t_end:
            seen = await diagnose() if diagnose is not None else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s {seen}")
        await asyncio.sleep(step)
    return time.time()


def log_of(sup, action: str, kind: str | None = None) -> list[dict]:
    return [e for e in sup.scaling_log if e["action"] == action and (kind is None or e["kind"] == kind)]


async def idle_moves(sup, seconds: float = 4.0) -> list[dict]:
    """Idle ``seconds``; the decisions that moved a desired count away from today's counts (there must be
    none: with no load the autoscaler changes nothing; a decision that confirms a count, e.g. "below floor"
    while the first worker still registers, is fine). The caller asserts, after measuring the rest."""
    await asyncio.sleep(seconds)
    ds = await decisions(sup)
    today = {"validator": 1, "gateway": sup.cfg.gateways, f"worker/{MODEL}/1/{sup.cfg.pool}": sup.cfg.workers}
    moved = [d for d in ds if d.get("desired") != today.get(d.get("target"), d.get("desired"))]
    seen = [(d.get("target"), d.get("current"), d.get("desired")) for d in ds]
    print(f"idle {seconds:.0f} s: {len(ds)} decision(s) {seen}, {len(moved)} away from today's counts; "
          f"scaling log {sup.scaling_log}")
    return moved


# -- the tests -----------------------------------------------------------------------------------------


def test_desired_counts_written_by_hand_are_carried_out(tmp_path, tiny):
    """No autoscaler (``up --no-autoscaler``): the supervisor still carries out the desired records an
    operator writes, drains the newest worker on a scale-down with no failed stream, and keeps it stopped."""
    with live_stack(tmp_path / "state", tiny, autoscaler=False) as sup:
        async def scenario() -> dict:
            credits = await CreditsWatch().open(sup.nats_url)
            try:
                await put_desired(sup, "worker", MODEL, "1", "local", count=2, reason="test: by hand")
                await put_desired(sup, "validator", count=2, reason="test: by hand")
                await until(lambda: len(log_of(sup, "ready")) >= 2, 60, "worker-1 and validator-1 ready")
                await until(lambda: "worker-1" in credits.first, 10, "worker-1 credits")
                load = Load(sup, max_tokens=300, rate=1.5).start()
                await until(lambda: "worker-1" in credits.busy, 30, "worker-1 running a sequence")
                await asyncio.sleep(1.0)
                await put_desired(sup, "worker", MODEL, "1", "local", count=1, reason="test: lower by hand")
                await put_desired(sup, "validator", count=1, reason="test: lower by hand")
                await until(lambda: len(log_of(sup, "exited")) >= 2, 30, "worker-1 and validator-1 gone")
                await asyncio.sleep(1.0)
                results = await load.stop()
            finally:
                await credits.close()
            return {"results": results, "first": dict(credits.first), "busy": dict(credits.busy)}

        out = asyncio.run(scenario())
        start = {e["name"]: e["ts"] for e in log_of(sup, "start")}
        ready = {e["name"]: e["cold_start_s"] for e in log_of(sup, "ready")}
        exited = {e["name"]: e for e in log_of(sup, "exited")}
        print(f"by hand: record written -> spawn "
              f"{ {e['name']: round(e['ts'] - e['decided_at'], 3) for e in log_of(sup, 'start')} } s; "
              f"cold start spawn -> ready {ready}; worker-1 spawn -> first credits "
              f"{out['first']['worker-1'] - start['worker-1']:.1f} s, -> first running sequence "
              f"{out['busy']['worker-1'] - start['worker-1']:.1f} s; drain {exited['worker-1']['drain_s']} s "
              f"(exit {exited['worker-1']['status']}); {summary(out['results'])}")
        assert set(start) == {"worker-1", "validator-1"}
        assert all(r.kind == "ok" for r in out["results"]), summary(out["results"])
        assert exited["worker-1"]["status"] == 0
        time.sleep(1.5)  # the restart monitor's rounds: a scaled-down worker stays stopped
        assert not sup.actor("worker-1").running and sup.actor("worker-0").running
        stopped = json.loads((Path(sup.state_dir) / "pids.json").read_text())["stopped"]
        assert stopped["worker-1"] == {"by": "autoscaler", "status": 0}
        assert any("reason: test: lower by hand (by test)" in e for e in sup.events)


def test_validator_bound_load_adds_validators_and_no_worker(tmp_path, tiny):
    """Each validator holds each request 150 ms, one at a time (~6.7 requests/s per validator): at 10/s of
    short streams the validators' queue wait grows; the autoscaler adds validators, never a worker. The worker
    has 8 slots: with one, a 2-token request served slowly on the loaded 2 cores now and then queued the next
    for a moment, which the policy rightly read as a worker short (the queue drains slower than 0.5 s at the
    rate served in the load's first second): the worker was a bottleneck too, not what this test is about."""
    env = {"ACTORSERVE_TEST_FAULTS": "1", "ACTORSERVE_FAULT_VALIDATOR_DELAY_MS": "150"}
    with live_stack(tmp_path / "state", tiny, autoscaler=True, env=env, worker_args=worker_options(8)) as sup:
        async def scenario() -> dict:
            idle = await idle_moves(sup)
            t_load = time.time()
            load = Load(sup, max_tokens=2, rate=10.0).start()
            try:
                t_ready = await until(lambda: log_of(sup, "ready", "validator"), 60, "a second validator ready")
                await asyncio.sleep(3.0)  # the added capacity shows; a wrong worker decision would too
            finally:
                results = await load.stop()
            return {"t_load": t_load, "t_ready": t_ready, "results": results, "decisions": await decisions(sup),
                    "idle": idle}

        out = asyncio.run(scenario())
        started = log_of(sup, "start")
        v_start = started[0]["ts"] - out["t_load"] if started else None
        print(f"validator-bound: first validator start {v_start:.1f} s after the load began, ready "
              f"{out['t_ready'] - out['t_load']:.1f} s after (cold start {log_of(sup, 'ready')[0]['cold_start_s']} s); "
              f"reasons {[e['reason'] for e in started]}; {summary(out['results'])}")
        worker_moves = [d for d in out["decisions"] if str(d.get("target", "")).startswith("worker/")
                        and d.get("desired", 0) > d.get("current", 0)]
        assert started and all(e["kind"] == "validator" for e in started), started
        assert worker_moves == [], f"a worker was asked for under a validator-bound load: {worker_moves}"
        assert out["idle"] == [], f"the autoscaler moved counts with no load: {out['idle']}"


@pytest.fixture(scope="module")
def pool_stack(tmp_path_factory, tiny):
    """One autoscaled stack for the accelerator-bound step and the scale-down after it (in this order)."""
    with live_stack(tmp_path_factory.mktemp("pool"), tiny, autoscaler=True) as sup:
        sup.shared = {}
        yield sup


STEP_TARGET_S = 2.0  # issue 19: the new worker takes traffic within its cold start + 2 s of the 3x step
# The live test asserts only that the new worker takes traffic within its cold start + this bound (a broken
# decision or routing path misses it by far); whether it meets the 2 s target is a timing figure, measured
# over several runs by ``python -m bench.autoscaler_step_bench`` (docs/bench.md), printed here once.
STEP_BOUND_S = 10.0


async def rebase(load: Load, rate: float) -> float:
    """The base rate again from the streams the base load completed (median seconds a stream, served as the
    step's will be; the calibration streams ran alone, and were seen 25 % slower and faster than these): when
    it is more than REBASE_OFF away, the load is set to it and runs 4 s more. Returns the rate (requests/s)."""
    took = sorted(o.t_end - o.t_start for t in load.results if t.done() and (o := t.result()).kind == "ok")
    if not took:
        return rate
    again = share_rate(took)
    print(f"base load {rate:.2f}/s: {len(took)} streams, median {took[len(took) // 2]:.2f} s -> {again:.2f}/s")
    if abs(again - rate) <= REBASE_OFF * rate:
        return rate
    load.rate = again
    await asyncio.sleep(4.0)
    return again


async def step_scenario(sup, *, keep_load: bool = True) -> dict:
    """Idle 4 s, calibrate, run the base load 6 s (calibrated again from its streams: :func:`rebase`), step it
    3x and wait for a dispatch to a new worker (+2 s).
    Returns the timestamps (epoch s) that :func:`step_figures` reads; with ``keep_load`` the running
    :class:`Load` is under ``"load"`` (streams go on), else it is stopped and its outcomes are under
    ``"results"``."""
    idle = await idle_moves(sup)
    credits = await CreditsWatch().open(sup.nats_url, sup.etcd_url)
    try:
        rate = await base_rate(sup)
        load = Load(sup, max_tokens=400, rate=rate).start()
        await asyncio.sleep(6.0)
        rate = await rebase(load, rate)
        base_log = list(sup.scaling_log)
        t_step = time.time()
        load.rate = 3 * rate
        await until(lambda: any(w != "worker-0" for w in credits.dispatched), 60, "a dispatch to a new worker")
        await asyncio.sleep(2.0)
    finally:
        await credits.close()
    out = {"t_step": t_step, "base_rate": rate, "base_log": base_log, "first": dict(credits.first),
           "busy": dict(credits.busy), "dispatched": dict(credits.dispatched), "leased": dict(credits.leased),
           "decisions": await decisions(sup), "idle": idle}
    if keep_load:
        out["load"] = load
    else:
        out["results"] = await load.stop()
    return out


def step_figures(sup, out: dict) -> dict:
    """Seconds after the step (``decision``: the spawn of the new worker; ``traffic``: its first dispatch;
    ``busy``: its first heartbeat with a running sequence, 4 Hz, or None), its cold start (``cold``: spawn ->
    lease, as the supervisor's ``cold_start_s`` and the schedulers count it; ``credits``: spawn -> first
    heartbeat), ``margin`` = cold + 2 s - traffic (>= 0: the 2 s target met) and the scale-up ``reason``."""
    started = log_of(sup, "start", "worker")
    assert started, sup.scaling_log
    new, t_spawn, t_step = started[0]["name"], started[0]["ts"], out["t_step"]
    assert new in out["dispatched"], f"no dispatch to {new} seen: {out['dispatched']}"
    assert new in out["leased"], f"{new} took a dispatch with no lease seen: {out['leased']}"
    cold, traffic = out["leased"][new] - t_spawn, out["dispatched"][new] - t_step
    return {"worker": new, "decision": t_spawn - t_step, "record_to_spawn": t_spawn - started[0]["decided_at"],
            "cold": cold, "credits": out["first"][new] - t_spawn, "traffic": traffic,
            "busy": out["busy"][new] - t_step if new in out["busy"] else None,
            "margin": cold + STEP_TARGET_S - traffic, "reason": started[0]["reason"]}


def test_accelerator_bound_3x_step_adds_a_worker_that_takes_traffic(pool_stack):
    """1-slot workers, 400-token streams: a 3x step of the arrival rate (~50 % -> ~150 % of what one worker
    serves) adds a worker (and no validator), which takes traffic (its first dispatch) within its cold start
    (spawn -> lease) + STEP_BOUND_S of the step; the figure against the 2 s target is printed."""
    sup = pool_stack
    loop = asyncio.new_event_loop()
    sup.shared["loop"] = loop
    out = loop.run_until_complete(step_scenario(sup))
    sup.shared["load"], sup.shared["base_rate"] = out["load"], out["base_rate"]  # the scale-down test goes on
    assert [e for e in out["base_log"] if e["kind"] == "worker"] == [], f"a worker at the base load: {out['base_log']}"
    f = step_figures(sup, out)
    busy = f"{f['busy']:.2f} s" if f["busy"] is not None else "not seen"
    print(f"3x step: decision+actuation {f['decision']:.2f} s after the step (decision record -> spawn "
          f"{f['record_to_spawn']:.2f} s; reason {f['reason']!r}); {f['worker']} cold start spawn -> lease "
          f"{f['cold']:.2f} s (spawn -> first credits {f['credits']:.2f} s); first dispatch to it "
          f"{f['traffic']:.2f} s after the step (first heartbeat with a running sequence {busy}); target cold "
          f"start + {STEP_TARGET_S:.0f} s = {f['cold'] + STEP_TARGET_S:.2f} s: "
          f"{'met' if f['margin'] >= 0 else 'missed'} by {abs(f['margin']):.2f} s")
    val_moves = [(d.get("current"), d.get("desired"), d.get("reason")) for d in out["decisions"]
                 if d.get("target") == "validator" and d.get("desired", 0) > d.get("current", 0)]
    print(f"validator decisions up during the accelerator-bound load: {val_moves}")
    assert f["traffic"] <= f["cold"] + STEP_BOUND_S, (
        f"the new worker took traffic {f['traffic']:.1f} s after the step (> cold start {f['cold']:.1f} s + "
        f"{STEP_BOUND_S:.0f} s)")
    assert val_moves == [], f"a validator was asked for under an accelerator-bound load: {val_moves}"
    assert out["idle"] == [], f"the autoscaler moved counts with no load: {out['idle']}"


def test_scale_down_after_the_load_stops_fails_no_request(pool_stack):
    """The 3x step stops (back to the base rate, ~50 % of one worker, so streams keep running); the
    autoscaler lowers the count, the newest worker drains (its sequences finish or migrate) and every request
    running at the drop or sent after it completes: 0 failed. Two more are sent at the SIGTERM, so that
    streams surely run while the worker drains."""
    sup = pool_stack
    if "load" not in sup.shared:
        pytest.skip("needs the scaled-up stack of the 3x-step test (it did not get that far)")
    loop = sup.shared["loop"]

    async def scenario() -> dict:
        load: Load = sup.shared["load"]
        load.rate = sup.shared["base_rate"]  # the step ends; the base load goes on, so streams run while a worker drains
        t_low = time.time()
        # the policy comes down once every signal stayed low for down_window_s (3 s here): the TTFT p90 is over
        # the completions of the last 30 s (collect.py latency_window_s), so the step's queued requests hold it
        # up ~30 s after the backlog drained (~40 s in most runs; one CI run missed 60 s): 120 s, decisions
        # printed if missed
        await until(lambda: log_of(sup, "stop", "worker"), 120, "a worker scale-down (its SIGTERM)", step=0.02,
                    diagnose=lambda: decisions(sup))
        # at the base rate (0.3-0.6 requests/s) no stream may overlap a 1.5 s drain (1 CI run in 4): two sent
        # right at the SIGTERM run while the worker drains, so the check below is never empty
        load.burst(2)
        t_exit = await until(lambda: log_of(sup, "exited", "worker"), 60, "a worker scaled down and gone")
        await asyncio.sleep(1.0)
        return {"t_low": t_low, "t_exit": t_exit, "results": await load.stop()}

    try:
        out = loop.run_until_complete(scenario())
    finally:
        loop.close()
    stop = log_of(sup, "stop", "worker")[0]
    exited = log_of(sup, "exited", "worker")[0]
    during = [r for r in out["results"] if r.t_start < exited["ts"] and r.t_end > stop["ts"]]
    after = [r for r in out["results"] if r.t_end > out["t_low"]]  # running when the load dropped, or later
    print(f"scale-down: {stop['name']} SIGTERM {stop['ts'] - out['t_low']:.1f} s after the load dropped "
          f"(reason {stop['reason']!r}), drained in {exited['drain_s']} s (exit {exited['status']}); "
          f"{len(during)} stream(s) ran across it; since the drop: {summary(after)}; whole load incl. the "
          f"step: {summary(out['results'])}")
    assert during, "no stream ran across the scale-down (the check would be empty)"
    assert all(r.kind == "ok" for r in after), summary(after)
    assert exited["status"] == 0
