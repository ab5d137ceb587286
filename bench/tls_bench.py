"""TLS cost: the same fixed request loop against ``actorserve up`` without and with ``--tls``
(issue 21 target: TLS costs <= 10 % of req/s; docs/security.md).

    python -m bench.tls_bench [--requests 200] [--concurrency 8] [--rounds 3] [--model-file PATH | --tiny] [--json]

Both stacks (``actorserve up`` child processes, one gateway and one worker each, serving what ``up``
serves by default — SmolLM2-135M-Instruct — or ``--model-file``, or with ``--tiny`` the tiny random Llama of
bench/tiny_model.py) run side by side on loopback; the loop is
``--requests`` non-streaming chat completions with ``max_tokens=1`` from ``--concurrency`` clients on
keep-alive connections (``--fresh-connections``: a new connection, so a TLS handshake, per request),
measured in ``--rounds`` alternating rounds (plain, tls, plain, tls, ...) so that a noisy neighbour
hurts both alike; the median round of each is reported. With TLS every hop is encrypted: client ->
gateway HTTPS, every actor <-> nats-server, every actor <-> etcd (mutual TLS).

JSON keys: plain_req_s, tls_req_s (medians), tls_cost_pct (100 * (1 - tls / plain)); plain_cpu_ms_per_req,
tls_cpu_ms_per_req (median CPU time the whole stack — every process in its pids.json — spent per request,
from /proc: robust where other work shares the cores, and what bounds req/s on a saturated machine),
tls_cpu_cost_pct (100 * (tls / plain - 1)); paired_tls_cost_pct, paired_tls_cpu_cost_pct (the same from the
median of the per-round ratios: each round measures both modes back to back, in alternating order, so the
pairs see the same background load); rounds, cpu_ms_per_req (each round per mode), errors (non-200
answers; the run fails if any), requests, concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `actorserve up` serves without --model-file


class UpProcess:
    """One ``actorserve up`` (``--tls`` optional) as a child process in its own session: ``start()``,
    ``wait_ready()`` (parses "actorserve is ready: URL" from its stdout), ``stop()`` (SIGTERM, then
    SIGKILL of its group after 40 s)."""

    def __init__(self, state_dir: Path, model_file: str | None, model_name: str | None, tls: bool) -> None:
        self.state_dir, self.tls = state_dir, tls
        model = ["--model-file", model_file, "--model-name", model_name or "tiny"] if model_file else []
        self.argv = [sys.executable, "-m", "control.ops.cli", "up", "--state-dir", str(state_dir), "--port", "0",
                     *model, "--worker-args", f"--kv-cache-bytes {64 * 1024 * 1024}"] + (["--tls"] if tls else [])
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.http_url = ""

    def start(self) -> "UpProcess":
        """Start ``up`` (without the caller's ACTORSERVE_* variables); returns self."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORSERVE_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=open(self.state_dir / "up.stderr", "wb"),
                                     text=True, cwd=str(ROOT), env=env, start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        return self

    def wait_ready(self, timeout: float) -> None:
        """Block until ``up`` printed its ready line (sets ``http_url``); RuntimeError with its stderr's tail
        if it exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if "actorserve is ready:" in line:
                    self.http_url = line.split("actorserve is ready:", 1)[1].split()[0].removesuffix("/v1")
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = (self.state_dir / "up.stderr").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"`{' '.join(self.argv[3:])}` not ready (status {self.proc.poll()}):\n{tail}")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by every process of the stack (pids.json: supervisor,
        nats-server, etcd, the actors), from /proc/<pid>/stat."""
        pids = json.loads((self.state_dir / "pids.json").read_text())
        total = 0
        for pid in pids.values():
            if not isinstance(pid, int):
                continue
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        return total / os.sysconf("SC_CLK_TCK")

    @property
    def dev_api_key(self) -> str:
        """The dev tenant's API key ``up`` wrote into the state directory."""
        return (self.state_dir / "dev-api-key").read_text().strip()

    def stop(self) -> None:
        """SIGTERM ``up`` (it stops its stack) and wait; SIGKILL its process group after 40 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


async def _loop(url: str, key: str, model: str, n: int, concurrency: int, verify: Any,
                fresh: bool) -> tuple[float, int]:
    """``n`` chat requests (max_tokens=1) from ``concurrency`` workers; returns (req/s, errors)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_keepalive_connections=0 if fresh else concurrency, max_connections=concurrency)
    errors = 0
    left = iter(range(n))

    async with httpx.AsyncClient(verify=verify, timeout=60, limits=limits, headers=headers) as c:
        async def worker() -> None:
            nonlocal errors
            for _ in left:
                r = await c.post(f"{url}/v1/chat/completions", json=body)
                errors += r.status_code != 200
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0), errors


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start both stacks, warm them up, run the alternating rounds; return the JSON report."""
    model_file = args.model_file
    tmp = Path(tempfile.mkdtemp(prefix="tls-bench-"))
    if args.tiny:
        from bench.tiny_model import write_tiny_llama_gguf
        model_file = write_tiny_llama_gguf(str(tmp / "tiny.gguf"))
    model = (args.model_name or "tiny") if model_file else DEFAULT_MODEL
    stacks = {"plain": UpProcess(tmp / "plain", model_file, model, False),
              "tls": UpProcess(tmp / "tls", model_file, model, True)}
    try:
        for s in stacks.values():
            s.start().wait_ready(args.ready_timeout)
        verify = {"plain": True, "tls": ssl.create_default_context(cafile=str(tmp / "tls" / "tls" / "ca.pem"))}
        rounds: dict[str, list[float]] = {"plain": [], "tls": []}
        cpu_ms: dict[str, list[float]] = {"plain": [], "tls": []}
        errors = 0
        for mode, s in stacks.items():  # warm-up: connections, JIT-ish first requests
            asyncio.run(_loop(s.http_url, s.dev_api_key, model, 2 * args.concurrency, args.concurrency,
                              verify[mode], args.fresh_connections))
        for i in range(args.rounds):
            order = ("plain", "tls") if i % 2 == 0 else ("tls", "plain")  # cancels a drift of the background load
            for mode, s in ((m, stacks[m]) for m in order):
                cpu0 = s.cpu_s()
                rate, errs = asyncio.run(_loop(s.http_url, s.dev_api_key, model, args.requests, args.concurrency,
                                               verify[mode], args.fresh_connections))
                cpu = 1000.0 * (s.cpu_s() - cpu0) / args.requests
                rounds[mode].append(round(rate, 2))
                cpu_ms[mode].append(round(cpu, 2))
                errors += errs
                print(f"{mode:>5}: {rate:7.1f} req/s, {cpu:6.2f} CPU ms/request ({errs} errors)", file=sys.stderr,
                      flush=True)
    finally:
        for s in stacks.values():
            s.stop()
    plain, tls = statistics.median(rounds["plain"]), statistics.median(rounds["tls"])
    cpu_plain, cpu_tls = statistics.median(cpu_ms["plain"]), statistics.median(cpu_ms["tls"])
    rate_ratio = statistics.median(t / p for p, t in zip(rounds["plain"], rounds["tls"]))
    cpu_ratio = statistics.median(t / p for p, t in zip(cpu_ms["plain"], cpu_ms["tls"]))
    return {"plain_req_s": round(plain, 2), "tls_req_s": round(tls, 2),
            "tls_cost_pct": round(100.0 * (1.0 - tls / plain), 1),
            "plain_cpu_ms_per_req": round(cpu_plain, 2), "tls_cpu_ms_per_req": round(cpu_tls, 2),
            "tls_cpu_cost_pct": round(100.0 * (cpu_tls / cpu_plain - 1.0), 1),
            "paired_tls_cost_pct": round(100.0 * (1.0 - rate_ratio), 1),
            "paired_tls_cpu_cost_pct": round(100.0 * (cpu_ratio - 1.0), 1),
            "rounds": rounds, "cpu_ms_per_req": cpu_ms, "errors": errors,
            "requests": args.requests, "concurrency": args.concurrency,
            "fresh_connections": bool(args.fresh_connections),
            "model": "tiny (random)" if args.tiny else (args.model_file or DEFAULT_MODEL)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of the TLS benchmark."""
    p.add_argument("--requests", type=int, default=200, help="requests per round (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode (default 3)")
    p.add_argument("--model-file", default=None, help=f"GGUF to serve (default: `up`'s, {DEFAULT_MODEL})")
    p.add_argument("--model-name", default=None, help="name to register --model-file under (default tiny)")
    p.add_argument("--tiny", action="store_true", help="serve the tiny random Llama (bench/tiny_model.py): the "
                   "platform's own cost per request, almost no model compute (the worst case for TLS's share)")
    p.add_argument("--fresh-connections", action="store_true", help="a new connection (handshake) per request")
    p.add_argument("--ready-timeout", type=float, default=240.0, help="seconds to wait for each stack")
    p.add_argument("--json", action="store_true", help="print only the JSON report")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the report; 1 if any request failed."""
    p = argparse.ArgumentParser(prog="python -m bench.tls_bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    for name in ("requests", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
        print(f"TLS costs {report['tls_cost_pct']} % of req/s ({report['plain_req_s']} -> {report['tls_req_s']}) "
              f"and {report['tls_cpu_cost_pct']} % more CPU per request ({report['plain_cpu_ms_per_req']} -> "
              f"{report['tls_cpu_ms_per_req']} ms); paired: {report['paired_tls_cost_pct']} % req/s, "
              f"{report['paired_tls_cpu_cost_pct']} % CPU")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
