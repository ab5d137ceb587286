"""``actorserve bench platform``: what the platform itself costs, measured with the zero-compute engine.

One run, loopback only, every load bounded in count. It starts the stack ``make run`` starts (``actorserve up``
as a child process: supervisor, etcd, nats-server, gateway, validator, scheduler, worker, jobs, rollout;
``--no-autoscaler`` so that the process set stays fixed while it is measured) with the worker on
``--engine zero-compute`` (actors/worker/zero_compute.py: deterministic tokens, no model compute), then:

1. warm-up: ``--warmup-requests`` requests (not measured);
2. idle: CPU of every stack process over ``--idle-s`` -> its idle rate (CPU s per wall s);
3. per concurrency of ``--concurrency`` (e.g. 16,64): a closed loop of that many clients sends ``--requests``
   non-streamed chat completions with ``max_tokens = 1`` (a separate process, bench/platform_load.py, on the
   same cores; its own CPU reported apart, never in the sums). Marginal CPU of a process = its CPU over the
   phase minus its idle rate x the phase's wall time; ``cpu_ms_per_request`` = the sum over every stack
   process / ok requests; ``req_s`` = ok requests / the load generator's wall time (saturation: the clients
   never wait between requests);
4. streams: ``--stream-requests`` streamed requests of ``--stream-tokens`` tokens (ignore_eos) at
   ``--stream-concurrency``: ``cpu_us_per_token`` = (marginal CPU - requests x the per-request cost measured at
   the same concurrency in step 3, or the nearest level) / (tokens - requests) -- the cost of one more token in
   a stream, its request's fixed cost taken out; ``cpu_us_per_token_raw`` = marginal CPU / tokens.

Each phase also records NATS messages (nats-server ``/varz`` in_msgs / out_msgs) and etcd gRPC calls by method
(etcd ``/metrics``) per request. JSON keys: ``cpu_ms_per_request``, ``req_s``, ``cpu_us_per_token`` (top level:
the worst per-request cost and the best req/s over the levels), ``levels.<c>`` (per level: ``per_process_ms``,
``loadgen_cpu_ms_per_request``, ``nats_msgs_per_request``, ``jetstream_per_request`` (``js_stored``: messages
written to JetStream stores, stream publishes and KV puts; ``js_api``: JetStream API calls),
``etcd_calls_per_request``), ``stream``, ``idle`` (``per_process_cpu_pct``), ``targets``, ``cpu``, ``load_avg``.
docs/bench.md; decisions 0029 and 0052.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

from bench import platform_cpu as pc

# issue [25]: <= 3 ms of CPU per request over every process, >= 450 req/s with the load generator beside the
# stack, <= 40 µs of CPU per streamed token (the median of three runs is what the issue judges)
TARGETS = (("cpu_ms_per_request", "<=", 3.0), ("req_s", ">=", 450.0), ("cpu_us_per_token", "<=", 40.0))
MODEL = "smollm2-135m-instruct"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``actorserve bench platform``."""
    p.add_argument("--json", metavar="PATH", default=None, help="write the result JSON here")
    p.add_argument("--concurrency", default="16,64", help="comma-separated client counts (default 16,64)")
    p.add_argument("--requests", type=int, default=1000, help="1-token requests per concurrency (default 1000)")
    p.add_argument("--warmup-requests", type=int, default=200)
    p.add_argument("--idle-s", type=float, default=10.0, help="idle window (s, default 10)")
    p.add_argument("--stream-requests", type=int, default=64)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--stream-concurrency", type=int, default=16)
    p.add_argument("--state-dir", default=None, help="state directory of the stack (default: a new temp dir)")
    p.add_argument("--worker-args", default="", help="extra worker options (added to --engine zero-compute)")
    p.add_argument("--gateway-args", default="", help="extra gateway options (e.g. --no-step-frames)")
    p.add_argument("--log-level", default=None, help="log level of the stack (default: up's, INFO)")
    p.add_argument("--tap", type=int, default=0, metavar="N",
                   help="after the measured phases: NATS messages by subject pattern of N one-token requests "
                        "(a wire tap, bench/platform_tap.py; idle background subtracted); 0 = skip (default)")


def _levels(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency: not a list of integers: {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit("--concurrency: each level must be >= 1")
    return out


class Stack:
    """``actorserve up`` as a child process on ``state_dir`` (port 0, no autoscaler, zero-compute worker)."""

    def __init__(self, state_dir: Path, worker_args: str, log_level: str | None, gateway_args: str = "") -> None:
        self.state_dir = state_dir
        cmd = [sys.executable, "-m", "control.ops.cli", "up", "--state-dir", str(state_dir), "--port", "0",
               "--no-autoscaler", "--worker-args", f"--engine zero-compute {worker_args}".strip()]
        cmd += [f"--gateway-args={gateway_args}"] if gateway_args else []
        cmd += ["--log-level", log_level] if log_level else []
        state_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(state_dir / "bench-up.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http_url = self.etcd_url = ""

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until endpoints.json names the gateway and its /readyz answers 200; RuntimeError otherwise."""
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"actorserve up exited ({self.proc.returncode}); see {self.log.name}")
            try:
                ep = orjson.loads((self.state_dir / "endpoints.json").read_bytes())
                self.http_url, self.etcd_url = ep.get("http_url") or "", ep.get("etcd_url") or ""
                with urllib.request.urlopen(self.http_url + "/readyz", timeout=2) as r:  # noqa: S310
                    if r.status == 200 and (self.state_dir / "dev-api-key").exists():
                        return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the stack was not ready in {timeout_s:.0f} s; see {self.log.name}")

    def check_zero_compute(self) -> None:
        """RuntimeError unless every live worker's etcd record says ``"engine": "zero-compute"`` (a figure of
        the platform with a real model behind it would be a different figure)."""
        out = subprocess.run([sys.executable, "-m", "control.ops.cli", "status", "--json", "--state-dir",
                              str(self.state_dir)], capture_output=True, timeout=60)
        workers = orjson.loads(out.stdout).get("workers", {}) if out.returncode == 0 else {}
        engines = [w.get("engine") for ws in workers.values() for w in ws.values()]
        if not engines or any(e != "zero-compute" for e in engines):
            raise RuntimeError(f"workers are not all zero-compute (engines {engines}); refusing to measure")

    def pids(self) -> dict[str, int]:
        """Every process of the stack by name (pids.json: supervisor, nats, etcd, each actor)."""
        data = orjson.loads((self.state_dir / "pids.json").read_bytes())
        return {k: v for k, v in data.items() if isinstance(v, int)}

    def key(self) -> str:
        return (self.state_dir / "dev-api-key").read_text().strip()

    def stop(self) -> None:
        """SIGTERM ``up`` (it stops every actor and server), SIGKILL after 60 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def _loadgen(stack: Stack, concurrency: int, requests: int, max_tokens: int, stream: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.platform_load", "--url", stack.http_url + "/v1/chat/completions",
           "--key", stack.key(), "--model", MODEL, "--concurrency", str(concurrency), "--requests", str(requests),
           "--max-tokens", str(max_tokens)] + (["--stream"] if stream else [])
    out = subprocess.run(cmd, capture_output=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({out.returncode}): {out.stderr.decode()[-400:]}")
    return orjson.loads(out.stdout.splitlines()[-1])


def _snapshot(stack: Stack, pids: dict[str, int], nats_mon: str | None) -> dict:
    return {"t": time.monotonic(), "cpu": pc.stack_cpu_s(pids), "etcd": pc.etcd_requests(stack.etcd_url),
            "nats": {**pc.nats_counters(nats_mon), **pc.jetstream_counters(nats_mon)} if nats_mon else {}}


def _marginal(a: dict, b: dict, idle_rate: dict[str, float]) -> tuple[float, dict[str, float]]:
    """(wall s, {name: marginal CPU s}) between snapshots ``a`` and ``b``."""
    wall = b["t"] - a["t"]
    return wall, {n: b["cpu"].get(n, 0.0) - a["cpu"].get(n, 0.0) - idle_rate.get(n, 0.0) * wall for n in b["cpu"]}


def _phase(stack: Stack, pids, nats_mon, idle, concurrency: int, requests: int, tokens: int,
           stream: bool) -> dict:
    """One measured load phase: the load generator's result plus marginal CPU, NATS and etcd deltas."""
    a = _snapshot(stack, pids, nats_mon)
    load = _loadgen(stack, concurrency, requests, tokens, stream)
    b = _snapshot(stack, pids, nats_mon)
    wall, marg = _marginal(a, b, idle["cpu"])
    n, etcd_idle = max(1, load["ok"]), idle["etcd"]
    nats = {k: v - idle["nats"].get(k, 0.0) * wall for k, v in pc.delta(b["nats"], a["nats"]).items()}
    return {"load": load, "wall_s": round(wall, 2), "marginal_cpu_s": round(sum(marg.values()), 3),
            "per_process_ms": {k: round(v / n * 1e3, 3) for k, v in sorted(marg.items())},
            "cpu_ms_per_request": round(sum(marg.values()) / n * 1e3, 3),
            "loadgen_cpu_ms_per_request": round(load["cpu_s"] / n * 1e3, 3),
            "nats_msgs_per_request": {k: round(v / n, 2) for k, v in nats.items() if k.endswith("msgs")},
            "jetstream_per_request": {k: round(nats.get(k, 0.0) / n, 2) for k in ("js_stored", "js_api")},
            "etcd_calls_per_request": {k: round((v - etcd_idle.get(k, 0.0) * wall) / n, 3)
                                       for k, v in pc.delta(b["etcd"], a["etcd"]).items()}}


def _tap_once(stack: Stack, seconds: float, requests: int, tokens: int = 1, stream: bool = False) -> dict:
    ep = orjson.loads((stack.state_dir / "endpoints.json").read_bytes())
    cmd = [sys.executable, "-m", "bench.platform_tap", "--nats", ep["nats_url"], "--seconds", str(seconds)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[1])
    proc.stderr.readline()  # "ready": subscribed
    if requests:
        _loadgen(stack, 16, requests, tokens, stream)
    out, err = proc.communicate(timeout=seconds + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"tap failed: {err.decode()[-300:]}")
    return orjson.loads(out.splitlines()[-1])


def _tap(stack: Stack, requests: int, seconds: float = 8.0, tokens: int = 1, stream: bool = False) -> dict:
    """Messages per request by subject pattern: a tapped load of ``requests`` (``tokens`` each, streamed or
    not, 16 clients) minus an idle tap as long."""
    idle, load = _tap_once(stack, seconds, 0), _tap_once(stack, seconds, requests, tokens, stream)
    per = {p: round((n - idle["patterns"].get(p, 0)) / requests, 3) for p, n in load["patterns"].items()}
    return {"requests": requests, "seconds": seconds, "idle_msgs_per_s": round(idle["total"] / seconds, 1),
            "msgs_per_request": round((load["total"] - idle["total"]) / requests, 2),
            "by_pattern_per_request": {p: v for p, v in sorted(per.items(), key=lambda kv: -kv[1]) if v > 0.005},
            "idle_by_pattern_per_s": {p: round(n / seconds, 2) for p, n in idle["patterns"].items()}}


def run(args: argparse.Namespace) -> dict:
    """Start the stack, run the phases, stop it; returns the result dict (module docstring)."""
    levels = _levels(args.concurrency)
    tmp = None if args.state_dir else tempfile.mkdtemp(prefix="actorserve-bench-platform-")
    stack = Stack(Path(args.state_dir or tmp), args.worker_args, args.log_level, args.gateway_args)
    res: dict = {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "levels": {}}
    try:
        stack.wait_ready()
        stack.check_zero_compute()
        pids, nats_mon = stack.pids(), pc.nats_monitor_url(stack.state_dir)
        res["processes"] = sorted(pids)
        print(f"[bench platform] stack up: {', '.join(sorted(pids))}; warm-up ...", flush=True)
        _loadgen(stack, 16, args.warmup_requests, 1, False)
        a = _snapshot(stack, pids, nats_mon)
        time.sleep(args.idle_s)
        b = _snapshot(stack, pids, nats_mon)
        wall = b["t"] - a["t"]
        idle_rate = {n: (b["cpu"][n] - a["cpu"].get(n, 0.0)) / wall for n in b["cpu"]}
        idle = {"cpu": idle_rate, "etcd": {k: v / wall for k, v in pc.delta(b["etcd"], a["etcd"]).items()},
                "nats": {k: v / wall for k, v in pc.delta(b["nats"], a["nats"]).items()}}
        res["idle"] = {"wall_s": round(wall, 2), "total_cpu_pct": round(sum(idle_rate.values()) * 100, 2),
                       "per_process_cpu_pct": {k: round(v * 100, 2) for k, v in sorted(idle_rate.items())},
                       "etcd_calls_per_s": {k: round(v / wall, 2) for k, v in pc.delta(b["etcd"], a["etcd"]).items()}}
        for c in levels:
            print(f"[bench platform] {args.requests} one-token requests at concurrency {c} ...", flush=True)
            res["levels"][str(c)] = _phase(stack, pids, nats_mon, idle, c, args.requests, 1, False)
        print(f"[bench platform] {args.stream_requests} streams of {args.stream_tokens} tokens ...", flush=True)
        res["stream"] = st = _phase(stack, pids, nats_mon, idle, args.stream_concurrency,
                                    args.stream_requests, args.stream_tokens, True)
        if args.tap:
            res["tap"] = _tap(stack, args.tap)
            res["tap_stream"] = _tap(stack, max(16, args.tap // 8), tokens=args.stream_tokens, stream=True)
    finally:
        stack.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    _summarise(res, st, args.stream_concurrency)
    return res


def _summarise(res: dict, st: dict, stream_c: int) -> None:
    """Top-level keys and targets from the phases."""
    lv = res["levels"]
    res["cpu_ms_per_request"] = max(v["cpu_ms_per_request"] for v in lv.values())
    res["req_s"] = max(v["load"]["req_s"] for v in lv.values())
    nearest = min(lv, key=lambda c: abs(int(c) - stream_c))
    n, tokens = st["load"]["ok"], st["load"]["completion_tokens"]
    fixed = n * lv[nearest]["cpu_ms_per_request"] / 1e3
    res["cpu_us_per_token"] = round((st["marginal_cpu_s"] - fixed) / max(1, tokens - n) * 1e6, 2)
    res["cpu_us_per_token_raw"] = round(st["marginal_cpu_s"] / max(1, tokens) * 1e6, 2)
    res["stream_tokens_per_s"] = round(tokens / st["load"]["wall_s"], 1) if st["load"]["wall_s"] else 0.0
    res["load_avg"] = os.getloadavg()
    res["targets"] = {k: {"value": res[k], "target": f"{op} {t:g}",
                          "met": res[k] <= t if op == "<=" else res[k] >= t} for k, op, t in TARGETS}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def print_table(res: dict) -> None:
    """Per-process marginal CPU per request at each level, then the targets."""
    lv = res["levels"]
    names = sorted({n for v in lv.values() for n in v["per_process_ms"]})
    print(f"\nplatform cost on {res['cpu']} ({res['cores']} cores), load avg {res['load_avg'][0]:.2f}")
    print(f"{'process':<14}" + "".join(f"{'c=' + c + ' ms/req':>16}" for c in lv) + f"{'idle %CPU':>12}")
    for n in names:
        print(f"{n:<14}" + "".join(f"{lv[c]['per_process_ms'].get(n, 0.0):>16.3f}" for c in lv)
              + f"{res['idle']['per_process_cpu_pct'].get(n, 0.0):>12.2f}")
    print(f"{'SUM':<14}" + "".join(f"{lv[c]['cpu_ms_per_request']:>16.3f}" for c in lv)
          + f"{res['idle']['total_cpu_pct']:>12.2f}")
    print(f"{'loadgen (apart)':<14}" + "".join(f"{lv[c]['loadgen_cpu_ms_per_request']:>16.3f}" for c in lv))
    print(f"{'req/s':<14}" + "".join(f"{lv[c]['load']['req_s']:>16.1f}" for c in lv))
    for what, key in (("NATS msgs/req", "in_msgs"), ("JS stored/req", "js_stored"), ("JS API/req", "js_api")):
        src = "nats_msgs_per_request" if key == "in_msgs" else "jetstream_per_request"
        print(f"{what:<14}" + "".join(f"{lv[c].get(src, {}).get(key, 0.0):>16.2f}" for c in lv)
              + f"   stream: {res['stream'].get(src, {}).get(key, 0.0):.2f}")
    print(f"stream: {res['stream_tokens_per_s']} tok/s, {res['cpu_us_per_token']} µs/token marginal "
          f"({res['cpu_us_per_token_raw']} µs/token with the per-request cost in)")
    for k, t in res["targets"].items():
        print(f"  {k:<20} {t['value']:>10} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")


def main(args: argparse.Namespace) -> int:
    """``actorserve bench platform``: run, print the table, write ``--json``; 0 when it ran (targets aside)."""
    res = run(args)
    print_table(res)
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(res, option=orjson.OPT_INDENT_2))
        print(f"wrote {args.json}")
    return 0
