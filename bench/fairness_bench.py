"""``actorserve bench fairness``: latency isolation, fair share on served tokens and goodput under overload.

One run, one machine, loopback only, every load loop bounded in count and time. It starts a stack
(``control.ops.supervisor.Supervisor``, default model, ``--slots`` worker sequences) and tenants
``bench-a``/``bench-b``/``bench-c`` (reused with fresh keys when an earlier run left them), then runs the
phases named by ``--phases`` (default all, in this order; ``capacity`` always runs first):

- ``capacity``: after ``--warmup-s`` of warm-up, completed req/s of a closed loop of ``--slots`` clients
  of A for ``--capacity-s`` (requests done from 20 % of the phase on);
- ``solo``: B alone, open loop at r = 2 x capacity / 11, ``--b-requests`` requests (phase = N / r, at
  most ``--max-phase-s``);
- ``fair``: A at 10 r plus B at r (about 2x capacity), fair scheduler;
- ``flood``: the same, but every request of A is ``"priority": "batch"`` (B stays interactive): B's p99
  TTFT against its solo p99 (``interactive_under_batch_flood_ratio``);
- ``split``: weights A=3, B=1, both saturating (2 x slots closed-loop clients each) for ``--split-s``:
  the split of weighted service tokens (``fair_queue.service_tokens``: prompt x 1 + completion x 2,
  from each response's usage) of requests done from the first quarter of the phase to its end;
- ``three``: weights A=1, B=2, C=3, all saturating: each tenant's service-token share against
  w_i / sum w; ``three_tenant_max_share_error`` = max_i |share_i - w_i/sum w| / (w_i/sum w);
- ``overload``: weights back to 1; A and B together offer ``--overload-factor`` (10) x capacity for
  ``--overload-s`` (60) s, each request with a deadline of ``--deadline-factor`` (2) x its service time:
  the larger of its solo latency and its latency at capacity (least-squares fits of end-to-end latency on
  prompt words and max_tokens, over B's solo requests and over the capacity phase; ``--deadline-basis
  solo`` uses the solo fit alone, which on a CPU whose step time grows with the batch can be shorter than
  a request takes at full batch, so that nothing can meet it at capacity); goodput (ok
  requests finished by their deadline, per s, over capacity), answered/refused/expired/failed/hung
  counts, lateness, and VmRSS growth of every stack process (``/proc/<pid>/status``) over the phase;
- ``fcfs``: the scheduler replaced by one started with ``--fcfs``; the ``fair`` load again.

Requests follow the seeded distribution of bench/fairness_workload.py (unique prefix per request,
prompt words ~ U{4..24}, max_tokens ~ U{2..12} with ignore_eos, by default). TTFT = time from sending
the request to the first streamed content chunk, measured by the client. ``bench_wall_s``: the run's
wall time. Keys: see docs/bench.md.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench import fairness_workload as wl
from bench.fairness_report import PHASES, b_phase_keys, print_table, targets, timing_pct
from bench.fairness_workload import HUNG_MARGIN_S, Result, Spec, Workload

from bench.fairness_stack import (MODEL, TENANTS, replace_scheduler, set_weights, setup_tenants,  # noqa: F401
                                  stack_rss_kib)
DEFAULT_DEADLINE_MS = 30_000  # every phase but overload


async def _stream(client, url: str, key: str, sp: Spec, priority: str, res: Result) -> None:
    """Send one streamed chat request and fill ``res`` (status, TTFT, usage); see ``Result``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": sp.prompt}], "max_tokens": sp.max_tokens,
            "ignore_eos": True, "stream": True, "deadline_ms": res.deadline_ms, "priority": priority,
            "stream_options": {"include_usage": True}}
    got_usage = False
    async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        res.http_status = r.status_code
        if r.status_code != 200:
            res.error = (await r.aread())[:200].decode(errors="replace")
            res.status = wl.refusal_status(r.status_code, res.error)
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = orjson.loads(line[6:])
            if "error" in obj:
                res.error = orjson.dumps(obj["error"]).decode()[:200]
                res.status = "expired" if "deadline" in res.error.lower() else "failed"
                return
            if res.ttft_ms is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                res.ttft_ms = (time.monotonic() - res.sent) * 1e3
            if obj.get("usage"):
                u, got_usage = obj["usage"], True
                res.prompt_tokens, res.completion_tokens = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
                res.timing = u.get("actorserve_timing") or {}
    if got_usage:  # text that decodes to nothing (e.g. an end-of-text token under ignore_eos): TTFT at usage
        res.status = "ok"
        res.ttft_ms = res.ttft_ms if res.ttft_ms is not None else (time.monotonic() - res.sent) * 1e3
    else:
        res.error = "stream ended without usage"


async def send(client, url: str, key: str, tenant: str, sp: Spec, deadline_ms: int, priority: str,
               out: list[Result]) -> None:
    """One request, appended to ``out``; bounded by its deadline + ``HUNG_MARGIN_S`` (then "hung")."""
    import httpx  # not at module level: `actorserve --help` imports this module

    res = Result(tenant, time.monotonic(), deadline_ms, sp.words, sp.max_tokens)
    out.append(res)
    try:
        await asyncio.wait_for(_stream(client, url, key, sp, priority, res), deadline_ms / 1e3 + HUNG_MARGIN_S)
    except asyncio.TimeoutError:
        res.status = "hung"
    except httpx.HTTPError as e:
        res.status, res.error = "failed", repr(e)[:200]
    res.e2e_ms = (time.monotonic() - res.sent) * 1e3


def _client(connections: int):
    import httpx

    return httpx.AsyncClient(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=64),
                             timeout=httpx.Timeout(DEFAULT_DEADLINE_MS / 1e3 + 2 * HUNG_MARGIN_S, pool=None))


async def with_loop_lag(coro, period_s: float = 0.05) -> float:
    """Run ``coro``; return the largest delay (ms) of this client's event loop meanwhile (a timer of
    ``period_s`` that fired late), which tells a client too slow to send or read on time from a slow stack."""
    worst, done = 0.0, False

    async def watch() -> None:
        nonlocal worst
        while not done:
            t = time.monotonic()
            await asyncio.sleep(period_s)
            worst = max(worst, time.monotonic() - t - period_s)
    w = asyncio.create_task(watch())
    try:
        await coro
    finally:
        done = True
        await w
    return round(worst * 1e3, 1)


@dataclass
class Stream:
    """One tenant's request stream in a phase: who sends, under which tag, and how."""

    tenant: str
    key: str
    tag: str
    priority: str = "interactive"
    deadline: Callable[[Spec], int] = lambda sp: DEFAULT_DEADLINE_MS
    out: list[Result] = field(default_factory=list)


async def open_loop(url: str, s: Stream, workload: Workload, rate: float, n: int) -> None:
    """Send ``n`` requests at ``rate`` req/s (phase length n / rate), then wait for all of them."""
    async with _client(2000) as client:
        t0, tasks = time.monotonic(), []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            sp = wl.spec(workload, s.tag, i)
            tasks.append(asyncio.create_task(send(client, url, s.key, s.tenant, sp, s.deadline(sp), s.priority,
                                                  s.out)))
        await asyncio.gather(*tasks)


async def closed_loop(url: str, s: Stream, workload: Workload, concurrency: int, duration_s: float) -> None:
    """``concurrency`` clients sending back to back until ``duration_s`` passes (at most 50 req/s each)."""
    t_end, counter = time.monotonic() + duration_s, iter(range(int(concurrency * duration_s * 50)))
    async with _client(concurrency + 8) as client:
        async def loop() -> None:
            for i in counter:
                if time.monotonic() >= t_end:
                    return
                sp = wl.spec(workload, s.tag, i)
                await send(client, url, s.key, s.tenant, sp, s.deadline(sp), s.priority, s.out)
        await asyncio.gather(*(loop() for _ in range(concurrency)))


@dataclass
class Ctx:
    """State shared by the phases of one run."""

    sup: object
    args: argparse.Namespace
    url: str
    keys: dict[str, str]
    workload: Workload
    res: dict = field(default_factory=dict)
    capacity: float = float("nan")
    rate: float = float("nan")
    solo: list[Result] | None = None
    loaded: list[Result] | None = None  # the capacity phase's results: latency of each shape at capacity
    sched: subprocess.Popen | None = None
    rss_start: dict[str, int] = field(default_factory=dict)

    def stream(self, tenant: str, tag: str, **kw) -> Stream:
        return Stream(tenant, self.keys[tenant], tag, **kw)

    def pids(self) -> dict[str, int]:
        p = dict(self.sup.pids)
        if self.sched is not None:
            p["scheduler-bench"] = self.sched.pid
        return p


def phase_capacity(ctx: Ctx) -> None:
    """Closed loop of ``--slots`` clients of A; capacity = ok requests done from 20 % of the phase on."""
    warm = ctx.stream("bench-a", "warmup")  # first requests of a fresh worker are slower: not counted
    asyncio.run(closed_loop(ctx.url, warm, ctx.workload, ctx.args.slots, ctx.args.warmup_s))
    s, T = ctx.stream("bench-a", "capacity"), ctx.args.capacity_s
    t0 = time.monotonic()
    asyncio.run(closed_loop(ctx.url, s, ctx.workload, ctx.args.slots, T))
    ctx.capacity = sum(1 for r in s.out if r.status == "ok" and t0 + 0.2 * T <= r.done <= t0 + T) / (0.8 * T)
    ctx.loaded = s.out
    ctx.rate = 2 * ctx.capacity / 11
    ctx.res.update(capacity_req_s=round(ctx.capacity, 3), b_rate_req_s=round(ctx.rate, 3),
                   capacity_counts=wl.counts(s.out), capacity_errors=wl.error_sample(s.out))
    if ctx.capacity <= 0:
        raise RuntimeError(f"no request completed in the capacity phase: {ctx.res['capacity_errors']}")


def _b_phase(ctx: Ctx, name: str, a_priority: str | None) -> list[Result]:
    """B at r for ``--b-requests`` requests (fewer if N / r > ``--max-phase-s``), with A at 10 r
    (``a_priority``) unless None; B's results."""
    n = min(ctx.args.b_requests, max(1, int(ctx.rate * ctx.args.max_phase_s)))
    b = ctx.stream("bench-b", f"{name}-b")
    a = ctx.stream("bench-a", f"{name}-a", priority=a_priority or "interactive")

    async def both() -> None:
        loops = [open_loop(ctx.url, b, ctx.workload, ctx.rate, n)]
        if a_priority is not None:
            loops.append(open_loop(ctx.url, a, ctx.workload, 10 * ctx.rate, 10 * n))
        return await with_loop_lag(asyncio.gather(*loops))
    ctx.res[f"{name}_client_loop_lag_max_ms"] = asyncio.run(both())
    ctx.res.update(b_phase_keys(name, b.out))
    if a_priority is not None:
        ctx.res[f"a_{name}_counts"], ctx.res[f"a_{name}_errors"] = wl.counts(a.out), wl.error_sample(a.out)
    return b.out


def phase_solo(ctx: Ctx) -> None:
    ctx.solo = _b_phase(ctx, "solo", None)


def phase_fair(ctx: Ctx) -> None:
    _b_phase(ctx, "fair", "interactive")


def phase_flood(ctx: Ctx) -> None:
    _b_phase(ctx, "flood", "batch")


def phase_fcfs(ctx: Ctx) -> None:
    ctx.res["run_rss_growth_mib"] = wl.rss_growth_mib(ctx.rss_start, stack_rss_kib(ctx.pids()))
    ctx.sched = replace_scheduler(ctx.sup, ctx.sched, True, Path(ctx.args.state_dir))
    _b_phase(ctx, "fcfs", "interactive")


def _saturate(ctx: Ctx, name: str, weights: dict[str, float]) -> tuple[dict, dict]:
    """All ``weights`` tenants saturating (2 x slots closed-loop clients each) for ``--split-s``; returns
    (service tokens, completion tokens) per tenant of requests done from T/4 to T."""
    set_weights(ctx.sup.etcd_url, weights)
    T, streams = ctx.args.split_s, [ctx.stream(t, f"{name}-{t[-1]}") for t in weights]
    t0 = time.monotonic()

    async def all_() -> None:
        await asyncio.gather(*(closed_loop(ctx.url, s, ctx.workload, 2 * ctx.args.slots, T) for s in streams))
    asyncio.run(all_())
    steady, end = t0 + T / 4, t0 + T
    for s in streams:
        ctx.res[f"{name}_counts_{s.tenant[-1]}"] = wl.counts(s.out)
    return ({s.tenant: wl.window_sum(s.out, steady, end) for s in streams},
            {s.tenant: wl.window_sum(s.out, steady, end, "completion_tokens") for s in streams})


def phase_split(ctx: Ctx) -> None:
    """Weights 3:1: ``weighted_split_ratio`` on service tokens, ``weighted_completion_split_ratio`` on
    completion tokens."""
    svc, comp = _saturate(ctx, "weighted", {"bench-a": 3.0, "bench-b": 1.0})
    a, b = svc["bench-a"], svc["bench-b"]
    ctx.res.update(weighted_tokens_a=round(a), weighted_tokens_b=round(b),
                   weighted_split_ratio=round(a / max(1.0, b), 3),
                   weighted_completion_tokens_a=comp["bench-a"], weighted_completion_tokens_b=comp["bench-b"],
                   weighted_completion_split_ratio=round(comp["bench-a"] / max(1, comp["bench-b"]), 3))
    for t in "ab":
        c = ctx.res[f"weighted_counts_{t}"]
        ctx.res[f"weighted_refused_{t}"], ctx.res[f"weighted_failed_{t}"] = c["refused"], c["failed"] + c["hung"]


def phase_three(ctx: Ctx) -> None:
    """Weights 1:2:3: service-token shares and their largest relative error."""
    weights = {"bench-a": 1.0, "bench-b": 2.0, "bench-c": 3.0}
    svc, _ = _saturate(ctx, "three", weights)
    total = sum(svc.values()) or 1.0
    err = wl.share_errors(svc, weights)
    ctx.res.update(three_tenant_service_tokens={t: round(v) for t, v in svc.items()},
                   three_tenant_shares={t: round(v / total, 4) for t, v in svc.items()},
                   three_tenant_share_errors={t: round(e, 4) for t, e in err.items()},
                   three_tenant_max_share_error=round(max(abs(e) for e in err.values()), 4))


def phase_overload(ctx: Ctx) -> None:
    """``--overload-factor`` x capacity from A and B (half each) for ``--overload-s``, deadlines at
    ``--deadline-factor`` x predicted solo latency; RSS of every stack process before and after."""
    set_weights(ctx.sup.etcd_url, {t: 1.0 for t in TENANTS})
    solo = ctx.solo
    if not solo:  # no solo phase in this run: 20 s of one sequential client of B instead
        s = ctx.stream("bench-b", "calibrate")
        asyncio.run(closed_loop(ctx.url, s, ctx.workload, 1, 20.0))
        solo = s.out
    model = wl.fit_latency([(r.words, r.max_tokens, r.e2e_ms) for r in solo if r.status == "ok"])
    loaded = wl.fit_latency([(r.words, r.max_tokens, r.e2e_ms) for r in ctx.loaded or [] if r.status == "ok"])
    f, T = ctx.args.deadline_factor, ctx.args.overload_s
    rate = ctx.args.overload_factor * ctx.capacity / 2

    def deadline(sp) -> int:  # near the service time: f x the larger of the shape's solo and loaded latency
        return max(wl.deadline_ms(model, sp.words, sp.max_tokens, f), wl.deadline_ms(loaded, sp.words, sp.max_tokens, f)
                   if ctx.args.deadline_basis == "service" else 0)
    streams = [ctx.stream(t, f"overload-{t[-1]}", deadline=deadline) for t in ("bench-a", "bench-b")]
    before = stack_rss_kib(ctx.pids())
    t0 = time.monotonic()

    mid: dict[str, int] = {}

    async def snapshot_mid() -> None:  # growth over the second half: a leak keeps growing once warm
        await asyncio.sleep(T / 2)
        mid.update(stack_rss_kib(ctx.pids()))

    async def both() -> float:
        return await with_loop_lag(asyncio.gather(snapshot_mid(), *(
            open_loop(ctx.url, s, ctx.workload, rate, int(rate * T)) for s in streams)))
    ctx.res["overload_client_loop_lag_max_ms"] = asyncio.run(both())
    after = stack_rss_kib(ctx.pids())
    growth, late_growth = wl.rss_growth_mib(before, after), wl.rss_growth_mib(mid, after)
    ctx.res.update(overload_rss_growth_second_half_mib=late_growth,
                   overload_rss_growth_second_half_max_mib=max(late_growth.values(), default=float("nan")))
    out = streams[0].out + streams[1].out
    summary = wl.overload_summary(out, t0, T, ctx.capacity)
    late = [r.timing for r in out if r.status == "ok" and r.e2e_ms > 1.1 * r.deadline_ms]
    ctx.res["overload_late_timing_p50_ms"] = timing_pct(late, 0.5)
    ctx.res["overload_hung_sent_s"] = sorted(round(r.sent - t0, 1) for r in out if r.status == "hung")[:20]
    ctx.res.update({f"overload_{k}": (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()})
    ctx.res["overload_errors"] = wl.error_sample(out)
    ctx.res.update(overload_latency_model_ms=[round(v, 3) for v in model],
                   overload_loaded_latency_model_ms=[round(v, 3) for v in loaded],
                   overload_deadline_basis=ctx.args.deadline_basis, overload_rss_growth_mib=growth,
                   overload_rss_growth_max_mib=max(growth.values(), default=float("nan")))


PHASE_FUNCS = {"capacity": phase_capacity, "solo": phase_solo, "fair": phase_fair, "flood": phase_flood,
               "split": phase_split, "three": phase_three, "overload": phase_overload, "fcfs": phase_fcfs}


def run(args: argparse.Namespace) -> dict:
    """Run the selected phases (``args.phases``, in ``PHASES`` order); returns the JSON result dict."""
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    t_start = time.monotonic()
    phases = ["capacity"] + [p for p in PHASES if p in set(args.phases.split(",")) and p != "capacity"]
    state = Path(args.state_dir)
    sup = Supervisor(StackConfig(state, port=0, supervise=False,
                                 actor_args={"worker": ["--max-num-seqs", str(args.slots), "--dtype", args.dtype]}))
    sup.start()
    ctx = None
    try:
        sup.wait_ready(timeout=240)
        keys = asyncio.run(setup_tenants(sup.etcd_url, TENANTS))
        time.sleep(2)  # gateways pick the tenants up
        workload = Workload(*args.prompt_words, *args.out_tokens, seed=args.seed)
        ctx = Ctx(sup, args, sup.http_url + "/v1/chat/completions", keys, workload)
        ctx.res.update(workload=workload.describe(), slots=args.slots, b_requests=args.b_requests,
                       phases=phases)
        for name in phases:
            t = time.monotonic()
            print(f"[bench fairness] phase {name} ...", flush=True)
            PHASE_FUNCS[name](ctx)
            ctx.res[f"{name}_wall_s"] = round(time.monotonic() - t, 1)
            if name == "capacity":  # RSS baseline of the run: after warm-up and a full batch
                ctx.rss_start = stack_rss_kib(ctx.pids())
        if "run_rss_growth_mib" not in ctx.res:
            ctx.res["run_rss_growth_mib"] = wl.rss_growth_mib(ctx.rss_start, stack_rss_kib(ctx.pids()))
    finally:
        if ctx is not None and ctx.sched is not None:
            ctx.sched.send_signal(signal.SIGTERM)
            ctx.sched.wait(20)
        sup.stop()
    res = ctx.res
    growth = res["run_rss_growth_mib"]
    res["run_rss_growth_max_mib"] = max(growth.values(), default=float("nan"))
    res["bench_wall_s"] = round(time.monotonic() - t_start, 1)
    res["targets"] = {name: {"value": v, "target": tgt, "met": ok} for name, v, tgt, ok in targets(res)}
    return res


def _pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench fairness``."""
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--state-dir", default=".actorserve-bench-fairness", help="state dir of the bench stack")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma-separated phases to run (capacity always runs); default {','.join(PHASES)}")
    parser.add_argument("--b-requests", type=int, default=300,
                        help="B's requests per solo/fair/flood/fcfs phase (phase length = N / r)")
    parser.add_argument("--max-phase-s", type=float, default=300.0,
                        help="longest solo/fair/flood/fcfs phase: fewer B requests when N / r is longer")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="seconds of closed-loop warm-up (not counted)")
    parser.add_argument("--capacity-s", type=float, default=20.0, help="seconds of the capacity phase")
    parser.add_argument("--split-s", type=float, default=30.0, help="seconds of each weighted (3:1, 1:2:3) phase")
    parser.add_argument("--overload-s", type=float, default=60.0, help="seconds of offered overload")
    parser.add_argument("--overload-factor", type=float, default=10.0, help="overload offered, x capacity")
    parser.add_argument("--deadline-factor", type=float, default=2.0,
                        help="overload deadlines, x the request shape's predicted latency (see --deadline-basis)")
    parser.add_argument("--deadline-basis", choices=("service", "solo"), default="service",
                        help="overload deadlines from the larger of the shape's solo latency and its latency at "
                             "capacity (service, default: near the service time) or from its solo latency alone")
    parser.add_argument("--prompt-words", type=_pair, default=(4, 24), metavar="LO,HI",
                        help="prompt length range, words (uniform)")
    parser.add_argument("--out-tokens", type=_pair, default=(2, 12), metavar="LO,HI",
                        help="max_tokens range (uniform, ignore_eos)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the request distribution")
    parser.add_argument("--slots", type=int, default=8, help="worker sequence slots (max_num_seqs)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="worker compute dtype (default auto: bf16 on CPUs with AMX)")


def main(args: argparse.Namespace) -> int:
    """Entry point used by the CLI."""
    from bench.cli_common import write_json

    res = run(args)
    print_table(res)
    write_json(res, args.json)
    return 0


if __name__ == "__main__":
    from bench.cli_common import standalone

    sys.exit(standalone("actorserve bench fairness", __doc__, add_arguments, main))
