"""The two sides of ``actorserve bench serve`` (bench/serve_bench.py) as child processes.

* :class:`OursStack`: ``actorserve up`` exactly as ``make run`` starts it (default worker options, the
  autoscaler on), in a fresh state directory, on a free port; ready when it prints its ready line.
* :class:`LlamaServer`: llama.cpp's ``llama-server`` on the same GGUF file, configured by :func:`peer_config`
  (``--threads`` for generation and batches, ``--parallel`` = the largest level, ``-c`` = slots x
  per-slot context); ready when ``GET /health`` answers 200.

Both bind 127.0.0.1 and run in their own session (stopped by SIGTERM, then SIGKILL of the group). The pure
parts (``peer_config``, ``find_llama_server``, ``cpu_info``) import nothing heavy.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# ISA flags that decide which kernels either engine can use (``/proc/cpuinfo`` spelling).
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")


def cpu_info(text: str | None = None) -> dict[str, Any]:
    """``{"model": <model name>, "flags": [the ISA_FLAGS present], "cpus": <logical CPUs this process may
    use>}`` from ``/proc/cpuinfo`` (or ``text``). Missing fields read as "" / []."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            text = ""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"model": model, "flags": [f for f in ISA_FLAGS if f in flags], "cpus": cpus}


def peer_config(max_streams: int, prompt_tokens_max: int, max_tokens: int, threads: int = 2,
                margin_tokens: int = 64, round_to: int = 256) -> dict[str, Any]:
    """llama-server's slots and context for a run whose largest level has ``max_streams`` concurrent
    streams: ``parallel`` = ``max_streams`` (one slot per stream, so none waits for a slot), ``ctx_per_slot``
    = prompt_tokens_max + max_tokens + margin_tokens rounded up to ``round_to`` (without ``--kv-unified``
    llama-server splits ``-c`` evenly over the slots), ``ctx_size`` = parallel x ctx_per_slot. Raises
    ValueError on a non-positive count."""
    for name, v in (("max_streams", max_streams), ("max_tokens", max_tokens), ("threads", threads),
                    ("round_to", round_to)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if prompt_tokens_max < 0:
        raise ValueError(f"prompt_tokens_max must be >= 0, got {prompt_tokens_max}")
    need = prompt_tokens_max + max_tokens + margin_tokens
    per_slot = -(-need // round_to) * round_to
    return {"parallel": max_streams, "ctx_per_slot": per_slot, "ctx_size": per_slot * max_streams,
            "threads": threads, "threads_batch": threads, "prompt_tokens_max": prompt_tokens_max,
            "max_tokens": max_tokens, "kv_unified": False}


def llama_server_argv(binary: str, gguf: str, port: int, cfg: dict[str, Any]) -> list[str]:
    """The command line of the peer for :func:`peer_config`'s ``cfg`` (CPU only, loopback, no web UI)."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(cfg["threads"]),
            "-tb", str(cfg["threads_batch"]), "--parallel", str(cfg["parallel"]), "-c", str(cfg["ctx_size"]),
            "-ngl", "0", "--no-webui"]


def find_llama_server(path: str | None) -> str:
    """The llama-server binary: ``path`` (``--llama-server``), else ``$LLAMA_SERVER``, else
    ``llama-server`` on PATH. FileNotFoundError naming the option when none is an executable file."""
    cand = path or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not cand or not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
        raise FileNotFoundError(
            f"llama-server not found ({cand or 'no --llama-server, $LLAMA_SERVER or PATH entry'}): build it "
            "as docs/bench.md says and pass --llama-server PATH, or use --peer-url URL")
    return cand


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Child:
    """A child process in its own session with its output in ``log``; ``stop()``: SIGTERM, then SIGKILL of
    its group after ``grace_s``."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log = argv, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                     env=env, start_new_session=True)

    def tail(self, n: int = 2000) -> str:
        """The last ``n`` characters of its log."""
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 40.0) -> None:
        """Stop it (idempotent)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._out.close()


class LlamaServer(_Child):
    """llama-server on ``gguf`` with ``cfg`` (:func:`peer_config`), on a free loopback port."""

    def __init__(self, binary: str, gguf: str, cfg: dict[str, Any], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(llama_server_argv(binary, gguf, self.port, cfg), log)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until ``GET /health`` answers 200; RuntimeError with its log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"llama-server not ready (status {self.proc.poll()}):\n{self.tail()}")


class OursStack(_Child):
    """``actorserve up --state-dir DIR --port 0`` (what ``make run`` runs, with its defaults) plus
    ``extra_args``; ``url`` and ``api_key`` once :meth:`wait_ready` returned."""

    READY = "actorserve is ready:"

    def __init__(self, state_dir: Path, extra_args: list[str] | None = None) -> None:
        self.state_dir = state_dir
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACTORSERVE_")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        argv = [sys.executable, "-m", "control.ops.cli", "up", "--state-dir", str(state_dir), "--port", "0",
                *(extra_args or [])]
        super().__init__(argv, state_dir / "up.log", env)
        self.url, self.api_key = "", ""
        self.model_lines: list[str] = []

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until the ready line is in its log (sets ``url``, ``api_key`` and ``model_lines``: the worker's
        lines about its kernel / dtype choice); RuntimeError with the log's tail on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.tail(10**6)
            if self.READY in text:
                self.url = text.split(self.READY, 1)[1].split()[0].removesuffix("/v1")
                self.api_key = (self.state_dir / "dev-api-key").read_text().strip()
                self.model_lines = [ln.strip()[:300] for ln in text.splitlines()
                                    if any(w in ln.lower() for w in ("choice", "dtype", "quantiz", "kernel"))][:10]
                return
            time.sleep(0.5)
        raise RuntimeError(f"actorserve up not ready (status {self.proc.poll()}):\n{self.tail()}")
