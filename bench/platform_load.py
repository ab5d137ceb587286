"""Load generator of ``actorserve bench platform`` (bench/platform_bench.py), run as its own process
(``python -m bench.platform_load``) so that its CPU is measured apart from the stack's.

A closed loop: ``--concurrency`` clients (aiohttp, one keep-alive connection each) send
``--requests`` chat completions in all to ``--url`` (loopback only), each ``max_tokens = --max-tokens``
with ``ignore_eos``; streamed (SSE, ``stream_options.include_usage``) with ``--stream``. Prints one JSON
object on stdout: ``ok``, ``failed``, ``errors`` (first 3), ``wall_s`` (first send to last answer, s),
``req_s`` (ok / wall_s), ``completion_tokens`` (sum of usage), ``cpu_s`` (this process: user + system,
``resource.getrusage``), ``e2e_ms_p50`` / ``_p99``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from urllib.parse import urlparse

import orjson


def _body(model: str, max_tokens: int, stream: bool, i: int) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": f"platform bench request {i}"}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return orjson.dumps(body)


async def _one(session, url: str, body: bytes, stream: bool) -> tuple[bool, int, str]:
    """(ok, completion tokens, error text) of one request."""
    async with session.post(url, data=body) as r:
        if r.status != 200:
            return False, 0, f"{r.status} {(await r.text())[:160]}"
        if not stream:
            obj = orjson.loads(await r.read())
            return True, int((obj.get("usage") or {}).get("completion_tokens", 0)), ""
        tokens, ok = 0, False
        async for line in r.content:
            if line.startswith(b"data: {"):
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    return False, tokens, str(obj["error"])[:160]
                if obj.get("usage"):
                    tokens, ok = int(obj["usage"].get("completion_tokens", 0)), True
        return ok, tokens, "" if ok else "stream ended without usage"


async def run(args: argparse.Namespace) -> dict:
    """Run the closed loop; returns the result dict (see module docstring)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {args.key}", "Content-Type": "application/json"}
    conn = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=args.concurrency)
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    lat: list[float] = []
    res = {"ok": 0, "failed": 0, "errors": [], "completion_tokens": 0}
    todo = iter(range(args.requests))

    async def client(session) -> None:
        for i in todo:
            t = time.perf_counter()
            try:
                ok, tokens, err = await _one(session, args.url, _body(args.model, args.max_tokens, args.stream, i),
                                             args.stream)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                ok, tokens, err = False, 0, repr(exc)[:160]
            lat.append(time.perf_counter() - t)
            res["ok" if ok else "failed"] += 1
            res["completion_tokens"] += tokens
            if err and len(res["errors"]) < 3:
                res["errors"].append(err)

    async with aiohttp.ClientSession(connector=conn, headers=headers, timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    lat.sort()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    res.update(wall_s=round(wall, 3), req_s=round(res["ok"] / wall, 1) if wall > 0 else 0.0,
               cpu_s=round(ru.ru_utime + ru.ru_stime, 3),
               e2e_ms_p50=round(lat[len(lat) // 2] * 1e3, 2) if lat else None,
               e2e_ms_p99=round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 2) if lat else None)
    return res


def main(argv: list[str] | None = None) -> int:
    """Parse options, refuse a non-loopback URL (exit 2), run, print the JSON result."""
    p = argparse.ArgumentParser(prog="python -m bench.platform_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="chat completions URL (loopback)")
    p.add_argument("--key", required=True, help="API key")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("platform_load: only loopback targets", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1:
        print("platform_load: --concurrency, --requests and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    print(orjson.dumps(asyncio.run(run(args))).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
