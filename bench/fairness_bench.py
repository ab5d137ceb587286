"""``actorserve bench fairness``: tenant B's TTFT alone, under fair share and under FCFS, and a 3:1 split.

One run, one machine, loopback only, every load loop bounded in count and time:
1. start a stack (``control.ops.supervisor.Supervisor``, default model) and two tenants A and B;
2. capacity: completed requests/s with a closed loop of ``--concurrency`` streams;
3. B alone at rate r = 2 x capacity / 11 (open loop): B's TTFT p50/p99 ("solo");
4. A at 10 r plus B at r (about 2x capacity) under the fair scheduler: B's TTFT ("fair");
5. the scheduler replaced by one started with ``--fcfs``; phase 4 again ("fcfs");
6. the fair scheduler back, weights A=3, B=1, both saturating (2 x slots closed-loop clients each):
   completion-token split A/B of requests completed from the first quarter of the phase to its end.
JSON keys: capacity_req_s, b_solo_ttft_p50_ms, b_solo_ttft_p99_ms, b_fair_ttft_p50_ms,
b_fair_ttft_p99_ms, b_fcfs_ttft_p50_ms, b_fcfs_ttft_p99_ms, weighted_split_ratio (+ raw counts).
TTFT = time from sending the request to the first streamed content chunk, measured by the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

MODEL = "smollm2-135m-instruct"


@dataclass
class Phase:
    """Client-side results of one load phase for one tenant."""

    ttft_ms: list[float] = field(default_factory=list)  # successful requests only
    completion_tokens: int = 0
    done: list[tuple[float, int]] = field(default_factory=list)  # (monotonic completion time, tokens) per ok request
    num_ok: int = 0
    num_refused: int = 0  # 429/503
    num_failed: int = 0  # anything else
    timings: list[dict] = field(default_factory=list)  # usage.actorserve_timing (ms per stage) per ok request


def pct(values: list[float], q: float) -> float:
    """q-quantile (0..1) by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


async def stream_one(client: httpx.AsyncClient, url: str, key: str, max_tokens: int, deadline_ms: int,
                     out: Phase) -> None:
    """One streamed chat request; records TTFT and completion tokens in ``out``."""
    import httpx  # not imported at module level: `actorserve --help` imports this module

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "deadline_ms": deadline_ms,
            "stream_options": {"include_usage": True}}
    t0, ttft = time.monotonic(), None
    try:
        async with client.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"},
                                 timeout=deadline_ms / 1e3 + 10) as r:
            if r.status_code != 200:
                await r.aread()
                out.num_refused += r.status_code in (429, 503)
                out.num_failed += r.status_code not in (429, 503)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = orjson.loads(line[6:])
                if ttft is None and any((c.get("delta") or {}).get("content") for c in obj.get("choices", [])):
                    ttft = (time.monotonic() - t0) * 1e3
                if obj.get("usage"):
                    out.completion_tokens += obj["usage"].get("completion_tokens", 0)
                    out.done.append((time.monotonic(), obj["usage"].get("completion_tokens", 0)))
                    out.timings.append(obj["usage"].get("actorserve_timing") or {})
    except httpx.HTTPError:
        out.num_failed += 1
        return
    if ttft is not None:
        out.ttft_ms.append(ttft)
        out.num_ok += 1


async def open_loop(url: str, key: str, rate: float, duration_s: float, max_tokens: int, out: Phase,
                    deadline_ms: int = 30_000) -> None:
    """Send at ``rate`` req/s for ``duration_s`` (at most rate x duration requests), then wait for all."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        t0, tasks = time.monotonic(), []
        for i in range(int(rate * duration_s)):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            tasks.append(asyncio.create_task(stream_one(client, url, key, max_tokens, deadline_ms, out)))
        await asyncio.gather(*tasks)


async def closed_loop(url: str, key: str, concurrency: int, duration_s: float, max_tokens: int, out: Phase) -> None:
    """``concurrency`` clients each sending back to back until ``duration_s`` passes."""
    import httpx

    t_end = time.monotonic() + duration_s
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        async def loop() -> None:
            while time.monotonic() < t_end:
                await stream_one(client, url, key, max_tokens, 60_000, out)
        await asyncio.gather(*(loop() for _ in range(concurrency)))


async def setup_tenants(etcd_url: str) -> dict[str, str]:
    """Create tenants ``bench-a`` and ``bench-b`` (allowed: the default model, weight 1); return their keys.
    Tenants left in the state directory by an earlier run are reused with a fresh key and weight 1, so the
    bench can be run again after a failed run."""
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin
    async with Registry.connect(etcd_url) as reg:
        admin = TenantAdmin(reg)
        return {t: await _bench_tenant(admin, t) for t in ("bench-a", "bench-b")}


async def _bench_tenant(admin, tenant_id: str) -> str:
    """A new API key of ``tenant_id``, created (or reset: model access, weight 1) for this run."""
    from control.state.tenants import TenantError
    try:
        return (await admin.create(tenant_id, allowed_models=[MODEL]))[2]
    except TenantError:
        await admin.allow_models(tenant_id, [MODEL])
        await admin.set_weight(tenant_id, 1.0)
        return (await admin.add_key(tenant_id))[1]


async def set_weights(etcd_url: str, weights: dict[str, float]) -> None:
    """Write tenant weights (schedulers re-read tenants every 2 s)."""
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin
    async with Registry.connect(etcd_url) as reg:
        for t, w in weights.items():
            await TenantAdmin(reg).set_weight(t, w)


def replace_scheduler(sup, current: subprocess.Popen | None, fcfs: bool, log_dir: Path) -> subprocess.Popen:
    """Stop the running scheduler (supervisor's or ours) and start one with or without ``--fcfs``."""
    if current is None:
        sup.actor("scheduler-0").proc.send_signal(signal.SIGTERM)
        sup.actor("scheduler-0").proc.wait(20)
    else:
        current.send_signal(signal.SIGTERM)
        current.wait(20)
    cmd = [sys.executable, "-m", "control.ops.cli", "actor", "scheduler", "--model", f"{MODEL}@1",
           "--nats", sup.nats_url, "--etcd", sup.etcd_url] + (["--fcfs"] if fcfs else [])
    log = open(log_dir / f"bench-scheduler-{'fcfs' if fcfs else 'fair'}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    asyncio.run(wait_active(sup.etcd_url, proc.pid))
    return proc


async def wait_active(etcd_url: str, pid: int, timeout_s: float = 60.0) -> None:
    """Wait until the scheduler process ``pid`` holds the version's election key (it is then subscribed
    and has listed the workers once). RuntimeError after ``timeout_s``."""
    from control.state.names import scheduler_key
    from control.state.registry import Registry
    async with Registry.connect(etcd_url) as reg:
        t_end = time.monotonic() + timeout_s
        while ((await reg.get_json(scheduler_key(MODEL, "1"))) or {}).get("pid") != pid:
            if time.monotonic() > t_end:
                raise RuntimeError(f"scheduler {pid} did not become active in {timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # its first credit heartbeats (4 Hz) arrive


def timing_pct(timings: list[dict], q: float = 0.5) -> dict[str, float]:
    """q-quantile of each server-side timing key (ms) over ``timings`` (usage.actorserve_timing dicts)."""
    keys = sorted({k for t in timings for k in t if k != "decode_ms"})
    return {k: round(pct([float(t[k]) for t in timings if k in t], q), 1) for k in keys}


def run(args: argparse.Namespace) -> dict:
    """Run all phases; returns the JSON result dict."""
    from control.ops.supervisor import Supervisor

    state = Path(args.state_dir)
    sup = Supervisor(state, port=0, supervise=False,
                     actor_args={"worker": ["--max-num-seqs", str(args.slots), "--dtype", args.dtype]})
    sup.start()
    sched = None
    try:
        sup.wait_ready(timeout=240)
        url = sup.http_url + "/v1/chat/completions"
        keys = asyncio.run(setup_tenants(sup.etcd_url))
        time.sleep(2)  # gateways pick the tenants up
        a, b, T = keys["bench-a"], keys["bench-b"], args.phase_s
        cap = Phase()
        asyncio.run(closed_loop(url, a, args.slots, T, args.max_tokens, cap))
        capacity = cap.num_ok / T
        r = 2 * capacity / 11
        solo = Phase()
        asyncio.run(open_loop(url, b, r, T, args.max_tokens, solo))

        def mixed() -> tuple[Phase, Phase]:
            pa, pb = Phase(), Phase()

            async def both():
                await asyncio.gather(open_loop(url, a, 10 * r, T, args.max_tokens, pa),
                                     open_loop(url, b, r, T, args.max_tokens, pb))
            asyncio.run(both())
            return pa, pb
        _, fair = mixed()
        sched = replace_scheduler(sup, None, True, state)
        _, fcfs = mixed()
        sched = replace_scheduler(sup, sched, False, state)
        asyncio.run(set_weights(sup.etcd_url, {"bench-a": 3.0, "bench-b": 1.0}))
        time.sleep(3)
        wa, wb = Phase(), Phase()

        async def saturate():
            # 2 x slots clients per tenant: both keep requests queued at the scheduler while their finished
            # clients send the next one (with only `slots` each, the heavier tenant's queue runs dry)
            await asyncio.gather(closed_loop(url, a, 2 * args.slots, T, args.max_tokens, wa),
                                 closed_loop(url, b, 2 * args.slots, T, args.max_tokens, wb))
        t_weighted = time.monotonic()
        asyncio.run(saturate())
    finally:
        if sched is not None:
            sched.send_signal(signal.SIGTERM)
            sched.wait(20)
        sup.stop()
    res = {"capacity_req_s": round(capacity, 3), "b_rate_req_s": round(r, 3)}
    for name, ph in (("solo", solo), ("fair", fair), ("fcfs", fcfs)):
        res[f"b_{name}_ttft_p50_ms"] = round(pct(ph.ttft_ms, 0.5), 1)
        res[f"b_{name}_ttft_p99_ms"] = round(pct(ph.ttft_ms, 0.99), 1)
        res[f"b_{name}_ok"], res[f"b_{name}_refused"] = ph.num_ok, ph.num_refused
        res[f"b_{name}_timing_p50_ms"] = timing_pct(ph.timings, 0.5)
        res[f"b_{name}_timing_p99_ms"] = timing_pct(ph.timings, 0.99)
    # steady state only: tokens of requests completed from the first quarter of the phase to its end. Left
    # out: the start-up transient (both tenants' first requests fill the batch together) and the tail
    # after the clients stop sending, when the lighter-weighted tenant's backlog drains alone.
    steady, end = t_weighted + T / 4, t_weighted + T
    ta, tb = (sum(n for t, n in ph.done if steady <= t <= end) for ph in (wa, wb))
    res["weighted_tokens_a"], res["weighted_tokens_b"] = ta, tb
    res["weighted_split_ratio"] = round(ta / max(1, tb), 3)
    res["weighted_refused_a"], res["weighted_refused_b"] = wa.num_refused, wb.num_refused
    res["weighted_failed_a"], res["weighted_failed_b"] = wa.num_failed, wb.num_failed
    return res


def print_table(res: dict) -> None:
    """Human-readable summary with the issue's target ratios."""
    print(f"capacity: {res['capacity_req_s']} req/s; B offered {res['b_rate_req_s']} req/s, A 10x that")
    for name in ("solo", "fair", "fcfs"):
        print(f"  B TTFT {name:5s}: p50 {res[f'b_{name}_ttft_p50_ms']:9.1f} ms   p99 {res[f'b_{name}_ttft_p99_ms']:9.1f} ms"
              f"   ({res[f'b_{name}_ok']} ok, {res[f'b_{name}_refused']} refused)")
        for q in ("p50", "p99"):
            timing = res.get(f"b_{name}_timing_{q}_ms") or {}
            print(f"      server-side {q} (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in timing.items()))
    solo, fair, fcfs = (res[f"b_{n}_ttft_p99_ms"] for n in ("solo", "fair", "fcfs"))
    print(f"  fair/solo p99 = {fair / solo:.2f} (target <= 2);  fair/fcfs p99 = {fair / fcfs:.3f} (target <= 0.25)")
    print(f"  weights 3:1 -> token split {res['weighted_split_ratio']} (target 3 +- 10%)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench fairness``."""
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--state-dir", default=".actorserve-bench-fairness", help="state dir of the bench stack")
    parser.add_argument("--phase-s", type=float, default=20.0, help="seconds per load phase")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--slots", type=int, default=8, help="worker sequence slots (max_num_seqs)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="worker compute dtype (default auto: bf16 on CPUs with AMX)")


def main(args: argparse.Namespace) -> int:
    """Entry point used by the CLI."""
    res = run(args)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="actorserve bench fairness")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
