"""``actorserve bench sim-check``: the simulator's latency model against the live platform, at small scale.

One run, this machine, loopback only. It starts the real stack as ``actorserve bench fairness`` does
(``control.ops.supervisor.Supervisor``, default model, one worker of ``--slots`` sequences, no autoscaler;
its tenant from bench/fairness_stack.py), then:

1. measures this machine's throughput curve with ``actorserve profile`` (control/ops/profile_cli.py, run as a
   subprocess against the stack's etcd, ``--no-store``, batches 1, 2, slots/2, slots, 16 decode tokens,
   prompts 32 / 64 / 128; the worker is idle meanwhile), or reads ``--curve PATH``;
2. for each rate of ``--rates`` (fractions of the curve's decode capacity at ``--slots`` sequences, in
   requests/s: ``tokens_per_s_at(slots) / output_tokens``), sends ``--requests`` streamed chat requests
   (fewer when they would take longer than ``--max-phase-s``, at least 10)
   with Poisson arrivals (exponential gaps, seeded), every one of the same prompt (``--prompt-words`` words,
   the bench fairness distribution with lo = hi; its token count is read back from usage) and output
   length (``--output-tokens``, ``ignore_eos``), after a short warm-up; client-side TTFT (send to the first
   content chunk), p50 and p99, and mean TPOT = mean over requests of (end - first chunk) / (tokens - 1);
3. runs the simulator (control.sim.simulate) with this machine as the only accelerator type (the measured
   curve, ``--slots`` KV slots, one replica held fixed) on a constant trace of each rate with the measured
   prompt and output lengths, and reads the same three figures from its result;
4. prints measured against simulated and their ratio; target: TTFT (p50 and p99) and TPOT within +-20 %.

Figures from a 2-core machine shared with other work are noisy: the run records ``uptime``'s load before and
after and the CPU steal time (/proc/stat) over the run. The JSON (``--json``) holds every figure and
``targets``. Six warm-up requests run before the profile (the worker's first steps are slow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_RATIO = {"torch": 0.20, "zero-compute": 0.15}  # |simulated / measured - 1| (issues [14], [29])
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "tpot_mean_ms")


def poisson_send_times(rate_rps: float, n: int, seed: int) -> list[float]:
    """Send offsets (s from the start) of ``n`` Poisson arrivals at ``rate_rps`` (exponential gaps)."""
    if not rate_rps > 0 or n < 0:
        raise ValueError(f"rate_rps must be > 0 and n >= 0, got {rate_rps!r}, {n!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_rps)
    return out


def quantile(values: list[float], q: float) -> float:
    """q-quantile (0..1) with linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(results: list[Any]) -> dict[str, float]:
    """TTFT p50 / p99 (ms), mean TPOT (ms) and mean prompt tokens of the ``ok`` results (bench fairness
    ``Result``: ttft_ms, e2e_ms, completion_tokens, prompt_tokens); ``n_ok`` / ``n`` counts."""
    ok = [r for r in results if r.status == "ok" and r.ttft_ms is not None and r.completion_tokens > 1]
    ttft = [r.ttft_ms for r in ok]
    tpot = [(r.e2e_ms - r.ttft_ms) / (r.completion_tokens - 1) for r in ok]
    return {"n": len(results), "n_ok": len(ok), "ttft_p50_ms": quantile(ttft, 0.5),
            "ttft_p99_ms": quantile(ttft, 0.99), "tpot_mean_ms": sum(tpot) / len(tpot) if tpot else math.nan,
            "itl_p50_ms": quantile(tpot, 0.5),  # median over requests of each one's mean inter-token gap
            "prompt_tokens_mean": sum(r.prompt_tokens for r in ok) / len(ok) if ok else math.nan}


def compare(measured: dict[str, float], simulated: dict[str, float], within: float = TARGET_RATIO["torch"]
            ) -> dict[str, dict[str, Any]]:
    """Per figure of FIGURES: measured, simulated, ratio simulated / measured and ``met`` (|ratio - 1| <=
    ``within``)."""
    out = {}
    for k in FIGURES:
        m, s = measured.get(k, math.nan), simulated.get(k, math.nan)
        ratio = s / m if m and math.isfinite(m) and math.isfinite(s) else math.nan
        out[k] = {"measured": m, "simulated": s, "ratio": ratio,
                  "met": bool(math.isfinite(ratio) and abs(ratio - 1) <= within)}
    return out


# -- the simulated side ------------------------------------------------------------------------------

SIM_TICK_S = 0.5  # this machine's requests last ~3 s: a finer step than the fleet's 5 s tick


def curve_warnings(curve: Any) -> list[str]:
    """Signs that a profile was disturbed (other load on the cores): decode tokens/s falling as the batch
    grows. A batched decode step never serves fewer tokens/s at a larger batch on an otherwise idle
    machine, and the simulator follows the curve it is given (its fluid model matches a per-request
    processor-sharing reference on the same curve within ~10 %: tests/unit/test_sim_small_scale.py), so
    such a curve, not the latency model, decides the comparison. One message per falling segment."""
    pts = list(curve.decode)
    return [f"decode tokens/s falls from {a.tokens_per_s:.2f} at batch {a.batch} to {b.tokens_per_s:.2f} at "
            f"batch {b.batch} (ITL {a.itl_ms:.0f} -> {b.itl_ms:.0f} ms): the profile was disturbed; re-profile "
            f"on a quiet machine" for a, b in zip(pts, pts[1:]) if b.tokens_per_s < a.tokens_per_s]


def machine_inputs(curve: Any, slots: int, slo_ttft_ms: float = 60_000.0, slo_itl_ms: float = 10_000.0) -> Any:
    """The shipped inputs file with this machine as its only accelerator type (``local``: the measured
    curve, ``slots`` KV slots, the inputs' first type's prices — cost is not compared here), no spot
    preemption, a wide SLO (this check compares latencies, not attainment) and a SIM_TICK_S step (policy
    called every tick)."""
    import dataclasses

    from actors.autoscaler.signals import Slo
    from control.sim.api import AccelType
    from control.sim.inputs import load_inputs

    base = load_inputs()
    ref = next(iter(base.types.values()))
    local = AccelType("local", ref.on_demand_per_h, ref.spot_per_h, 1, 3.1, dataclasses.replace(curve, pool="local"),
                      "measured by actorserve profile on this machine (bench/sim_check.py)", int(slots))
    spot = dataclasses.replace(base.spot, preemption_rate_per_h={"local": 0.0}, correlated_at_s=1e12)
    return dataclasses.replace(base, types={"local": local}, spot=spot, slo=Slo(slo_ttft_ms, slo_itl_ms),
                               tick_s=SIM_TICK_S, decide_every_s=SIM_TICK_S)


class Recorder:
    """A fixed one-replica fleet that records, every tick after ``skip_s``, the arrivals (req/s) and the
    engine's TTFT p90 / ITL of the pool (the figures its PoolView gives a policy)."""

    name = "sim-check"

    def __init__(self, key: str = "local/on_demand", skip_s: float = 60.0) -> None:
        from control.sim.plan import FixedFleet

        self.key, self.skip_s = key, skip_s
        self.fleet = FixedFleet({key: 1}, self.name)
        self.samples: list[tuple[float, float, float]] = []

    def decide(self, view: Any) -> dict[str, int]:
        pv = view.pools.get(self.key)
        if pv is not None and pv.ready and view.now_s >= self.skip_s and view.arrival_rps > 0:
            self.samples.append((view.arrival_rps, pv.ttft_ms_p90, pv.itl_ms_p90))
        return self.fleet.decide(view)


def weighted_quantile(samples: list[tuple[float, float]], q: float) -> float:
    """q-quantile of values weighted by their weights: ``samples`` = [(weight, value), ...]."""
    pts = sorted((v, w) for w, v in samples if w > 0)
    total = sum(w for _, w in pts)
    if not pts or total <= 0:
        return math.nan
    acc = 0.0
    for v, w in pts:
        acc += w
        if acc >= q * total - 1e-12:
            return v
    return pts[-1][0]


def simulated_latency(inputs: Any, rate_rps: float, prompt_tokens: int, output_tokens: int,
                      duration_s: float, seed: int = 0) -> dict[str, float]:
    """The simulator's TTFT p50 / p99 and mean TPOT (ms) for one replica of ``inputs``' only type at a
    constant Poisson ``rate_rps``: quantiles over ticks (weighted by arrivals) of the pool's per-tick TTFT
    p90 (one prompt length: the per-tick spread is nil, so these are the model's spread over time), and the
    arrivals-weighted mean of its per-tick ITL (the engine's TPOT)."""
    from control.sim.engine import simulate
    from control.sim.plan import PlanRequest, constant_trace, verify_inputs

    req = PlanRequest(rate_rps, int(prompt_tokens), int(output_tokens), inputs.slo)
    inp = verify_inputs(inputs, req, duration_s)
    trace = constant_trace(req, duration_s, inp.tick_s, inp.spot.correlated_at_s, seed)
    rec = Recorder()
    simulate(inp, trace, rec, tick_s=inp.tick_s, seed=seed)
    ttft = [(a, t) for a, t, _ in rec.samples]
    w = sum(a for a, _, _ in rec.samples)
    return {"ttft_p50_ms": weighted_quantile(ttft, 0.5), "ttft_p99_ms": weighted_quantile(ttft, 0.99),
            "tpot_mean_ms": sum(a * i for a, _, i in rec.samples) / w if w > 0 else math.nan,
            "itl_p50_ms": weighted_quantile([(a, i) for a, _, i in rec.samples], 0.5),
            "ticks": len(rec.samples)}


# -- the live side -----------------------------------------------------------------------------------

def profile_curve(etcd_url: str, model: str, slots: int, dtype: str, out_dir: Path) -> Any:
    """This machine's ThroughputCurve, measured by ``actorserve profile`` (subprocess, ``--no-store``)."""
    from control.policy.curves import ThroughputCurve

    path = out_dir / "curve.json"
    batches = ",".join(str(b) for b in sorted({1, 2, max(1, slots // 2), slots}))
    cmd = [sys.executable, "-m", "control.ops.cli", "profile", model, "--etcd", etcd_url, "--no-store",
           "--batches", batches, "--prompts", "32,64,128", "--decode-tokens", "16", "--dtype", dtype,
           "--json", str(path)]
    subprocess.run(cmd, check=True, timeout=420)
    return ThroughputCurve.from_json(json.loads(path.read_text()))


async def poisson_load(url: str, key: str, workload: Any, rate_rps: float, n: int, seed: int,
                       tag: str) -> list[Any]:
    """``n`` streamed requests at Poisson times (bench fairness ``send``: TTFT at the first content chunk,
    usage read back); every result, once all are done."""
    import httpx

    from bench import fairness_workload as wl
    from bench.fairness_bench import DEFAULT_DEADLINE_MS, send

    out: list[Any] = []
    times = poisson_send_times(rate_rps, n, seed)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(DEFAULT_DEADLINE_MS / 1e3 + 10, pool=None)) as c:
        t0, tasks = time.monotonic(), []
        for i, at in enumerate(times):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(send(c, url, key, "bench-a", wl.spec(workload, tag, i),
                                                  DEFAULT_DEADLINE_MS, "interactive", out)))
        await asyncio.gather(*tasks)
    return out


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_times() -> list[int]:
    """The ``cpu`` line of /proc/stat (jiffies: user nice system idle iowait irq softirq steal ...)."""
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def steal_fraction(before: list[int], after: list[int]) -> float:
    """Share of CPU time the hypervisor gave to others (steal) between two :func:`cpu_times` readings."""
    delta = [b - a for a, b in zip(before, after)]
    return round(delta[7] / sum(delta), 4) if len(delta) > 7 and sum(delta) > 0 else 0.0


def phase_requests(rate_rps: float, requests: int, max_phase_s: float) -> int:
    """Requests of one rate's phase: ``requests``, fewer when that would take longer than ``max_phase_s``
    (at least 10)."""
    return max(10, min(requests, math.ceil(rate_rps * max_phase_s)))


class _Stack:
    """The bench stack (bench fairness's: default model, one worker of ``--slots`` sequences, no autoscaler) with
    its tenant, warmed up; ``worker_args`` added to the worker's command line. A context manager: stopped on
    exit."""

    def __init__(self, args: argparse.Namespace, worker_args: tuple[str, ...] = ()) -> None:
        from control.ops.stack_config import StackConfig
        from control.ops.supervisor import Supervisor

        self.args = args
        self.sup = Supervisor(StackConfig(Path(args.state_dir), port=0, supervise=False, actor_args={
            "worker": ["--max-num-seqs", str(args.slots), "--dtype", args.dtype, *worker_args]}))

    def __enter__(self) -> "_Stack":
        from bench.fairness_stack import setup_tenants
        from bench.fairness_workload import Workload

        self.sup.start()
        try:
            self.sup.wait_ready(timeout=240)
            self.key = asyncio.run(setup_tenants(self.sup.etcd_url, ("bench-a",)))["bench-a"]
            time.sleep(2)  # gateways pick the tenant up
            w, a = self.args.prompt_words, self.args
            self.workload = Workload(w, w, a.output_tokens, a.output_tokens, seed=a.seed)
            self.url = self.sup.http_url + "/v1/chat/completions"
            asyncio.run(poisson_load(self.url, self.key, self.workload, 2.0, 6, a.seed, "warmup"))  # first steps
            time.sleep(3)  # let the warm-up streams end and the worker go idle before a profile measures it
        except BaseException:
            self.sup.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.sup.stop()

    def curve(self) -> Any:
        """``--curve``'s ThroughputCurve, else this stack's worker profiled now."""
        from bench.fairness_stack import MODEL
        from control.policy.curves import ThroughputCurve

        if self.args.curve:
            return ThroughputCurve.from_json(json.loads(Path(self.args.curve).read_text()))
        with tempfile.TemporaryDirectory() as tmp:
            return profile_curve(self.sup.etcd_url, f"{MODEL}@1", self.args.slots, self.args.dtype, Path(tmp))

    def loads(self, cap_rps: float) -> dict[str, Any]:
        """The Poisson phase of every ``--rates`` fraction of ``cap_rps``: {fraction: figures}."""
        out = {}
        for f in self.args.rates:
            rate, t = f * cap_rps, time.monotonic()
            n = phase_requests(rate, self.args.requests, self.args.max_phase_s)
            got = asyncio.run(poisson_load(self.url, self.key, self.workload, rate, n, self.args.seed, f"rate-{f}"))
            out[str(f)] = {"rate_rps": rate, "wall_s": round(time.monotonic() - t, 1), **summarise(got)}
            print(f"[sim-check] {f:.2f} x capacity = {rate:.2f} req/s: {out[str(f)]}", flush=True)
        return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The measured side of the report: the curve (``--curve``, or profiled on the real engine's stack), then the
    Poisson loads on the real engine (``--engine torch``) or on a stack whose worker is the zero-compute engine
    sleeping the curve's step times (``--engine zero-compute``: no model compute competes with the stack for the
    cores, so what is compared is queueing, batching and scheduling)."""
    from control.policy.curves import ThroughputCurve

    res: dict[str, Any] = {"loadavg_1m_start": _load(), "engine": args.engine}
    cpu0 = cpu_times()
    t = time.monotonic()
    if args.engine == "torch":
        with _Stack(args) as stack:
            curve = stack.curve()
            res["profile_wall_s"] = round(time.monotonic() - t, 1)
            res["rates"] = stack.loads(curve.tokens_per_s_at(args.slots) / args.output_tokens)
    else:
        if args.curve:
            curve = ThroughputCurve.from_json(json.loads(Path(args.curve).read_text()))
        else:
            with _Stack(args) as stack:
                curve = stack.curve()
        res["profile_wall_s"] = round(time.monotonic() - t, 1)
        path = Path(args.state_dir).resolve() / "zero-compute-curve.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(curve.to_json()))
        with _Stack(args, ("--engine", "zero-compute", "--zero-compute-curve", str(path))) as stack:
            res["rates"] = stack.loads(curve.tokens_per_s_at(args.slots) / args.output_tokens)
    res["curve"] = curve.to_json()
    res["curve_warnings"] = curve_warnings(curve)
    res["capacity_rps"] = curve.tokens_per_s_at(args.slots) / args.output_tokens
    res["loadavg_1m_end"] = _load()
    res["cpu_steal_fraction"] = steal_fraction(cpu0, cpu_times())
    return res


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measured (live stack) and simulated figures per rate, their ratios and ``targets``."""
    from control.policy.curves import ThroughputCurve

    t0 = time.monotonic()
    res = measure(args)
    if args.json:  # the measured side first: a failure below keeps it
        Path(args.json + ".measured").write_text(json.dumps(res, indent=2, sort_keys=True))
    inputs = machine_inputs(ThroughputCurve.from_json(res["curve"]), args.slots)
    met = []
    for f, m in res["rates"].items():
        sim = simulated_latency(inputs, m["rate_rps"], round(m["prompt_tokens_mean"]), args.output_tokens,
                                args.sim_s, args.seed)
        m["simulated"] = sim
        m["compare"] = compare(m, sim, TARGET_RATIO[args.engine])
        met += [c["met"] for c in m["compare"].values()]
    pct = round(100 * TARGET_RATIO[args.engine])
    res["targets"] = {f"latency_within_{pct}pct": {"met": all(met), "met_count": sum(met), "of": len(met)}}
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def print_table(res: dict[str, Any]) -> None:
    """Measured vs simulated per rate and figure."""
    c = res["curve"]
    print(f"curve: {c.get('cpu', '?')}; decode " + ", ".join(
        f"b{p['batch']} {p['tokens_per_s']:.0f} tok/s ITL {p['itl_ms']:.1f} ms" for p in c["decode"]))
    pct = round(100 * TARGET_RATIO[res.get("engine", "torch")])
    print(f"engine: {res.get('engine', 'torch')} (zero-compute: the worker sleeps the curve's step times)")
    rows = [("rate", "req/s", "figure", "measured ms", "simulated ms", "sim/meas", f"±{pct} %")]
    for f, m in res["rates"].items():
        for k, v in m["compare"].items():
            rows.append((f, f"{m['rate_rps']:.2f}", k, f"{v['measured']:.1f}", f"{v['simulated']:.1f}",
                         f"{v['ratio']:.2f}", "met" if v["met"] else "MISSED"))
    for w in res.get("curve_warnings", []):
        print(f"WARNING: {w}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
    print(f"load average (1 min): {res['loadavg_1m_start']} at start, {res['loadavg_1m_end']} at end; CPU steal "
          f"{100 * res['cpu_steal_fraction']:.1f} %; wall {res['wall_s']} s")


def _fractions(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of numbers") from None
    if not out or any(not 0 < f < 1.5 for f in out):
        raise argparse.ArgumentTypeError(f"{value!r}: give fractions of capacity in (0, 1.5)")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench sim-check``."""
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--state-dir", default=".actorserve-bench-sim-check", help="state dir of the bench stack")
    parser.add_argument("--rates", type=_fractions, default=(0.25, 0.5, 0.75), metavar="F1,F2,...",
                        help="offered loads as fractions of the curve's capacity at --slots (default 0.25,0.5,0.75)")
    parser.add_argument("--requests", type=int, default=60, help="requests per rate (default 60)")
    parser.add_argument("--max-phase-s", type=float, default=50.0,
                        help="longest phase per rate: fewer requests when --requests would take longer (default 50)")
    parser.add_argument("--prompt-words", type=int, default=20, help="prompt words of every request (default 20)")
    parser.add_argument("--output-tokens", type=int, default=32, help="output tokens of every request (default 32)")
    parser.add_argument("--slots", type=int, default=8, help="worker sequence slots (max_num_seqs; default 8)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="worker and profile dtype (default float32, the worker's default)")
    parser.add_argument("--sim-s", type=float, default=1800.0, help="simulated seconds per rate (default 1800)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and prompts")
    parser.add_argument("--curve", default=None, metavar="PATH",
                        help="use this curve JSON (actorserve profile --json) instead of profiling now")
    parser.add_argument("--engine", default="torch", choices=tuple(TARGET_RATIO),
                        help="torch: load the real engine (target ±20 %%); zero-compute: a worker that sleeps the "
                        "curve's step times (profiled on the real engine first unless --curve), target ±15 %%")


def main(args: argparse.Namespace) -> int:
    """Entry point used by the CLI: 0 when every figure is within the engine's bound, else 1 (the table says
    which)."""
    import signal

    from bench.cli_common import write_json

    def _interrupt(signum, frame):  # SIGTERM (e.g. timeout): stop the stack in measure()'s finally
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _interrupt)
    res = run(args)
    print_table(res)
    write_json(res, args.json)
    return 0 if all(t["met"] for t in res["targets"].values()) else 1


if __name__ == "__main__":
    from bench.cli_common import standalone

    sys.exit(standalone("actorserve bench sim-check", __doc__, add_arguments, main))
