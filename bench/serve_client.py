"""The load generator and pure statistics of ``actorserve bench serve`` (bench/serve_bench.py).

One *level* = ``n`` closed-loop clients over loopback that together send a fixed list of streamed chat
completions (``/v1/chat/completions``, ``stream: true``, ``stream_options.include_usage``) and read every
server-sent event. Request ``i`` of a level is the same on both sides (prompt, seed, sampling), built by
:func:`request_body`. Per request the client records when it sent the request, when each chunk that carried
text arrived (monotonic seconds) and the final ``usage``; :func:`level_stats` turns that into aggregate
streamed tok/s, TTFT and ITL percentiles and the completion-token check.

No torch, no nats; aiohttp is imported where a level runs (``actorserve --help`` imports this module).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

# A fixed word list: prompts are random draws from it behind a unique marker, so no two prompts of a run share a
# prefix past the chat template (neither side's prefix cache can serve one prompt from another).
WORDS = ("river mountain quiet engine garden window silver market yellow planet morning answer forest "
         "letter bridge candle winter orange music island sudden travel pencil dinner cotton harbor "
         "rocket meadow signal basket thunder lantern velvet puzzle copper ladder pepper falcon marble "
         "tunnel violet anchor blanket canyon dragon ember feather glacier hollow jacket kettle lemon "
         "magnet needle oyster pillow quarry ribbon saddle timber umbrella walnut").split()


@dataclass(frozen=True)
class Sampling:
    """The sampling both sides get, sent explicitly in every request (so neither server's defaults apply):
    temperature 0.8 (issue 15's load), every truncation off (``top_p`` 1, ``top_k`` 0, ``min_p`` 0), a
    fixed per-request seed (``seed + i``), ``ignore_eos`` so every request generates exactly
    ``max_tokens`` tokens. llama-server's /v1/chat/completions passes ``ignore_eos``, ``top_k``, ``min_p``
    and ``seed`` through to its sampler (tools/server/server-schema.cpp of the vendored llama.cpp)."""

    max_tokens: int = 128
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0


def prompt(seed: int, level: int, i: int, words: int = 32) -> str:
    """Request ``i`` of level ``level``'s user message: ``[serve-<level>-<i>]`` + ``words`` words drawn
    (with replacement, ``random.Random("<seed>/<level>/<i>")``) from ``WORDS``. Deterministic."""
    rng = random.Random(f"{seed}/{level}/{i}")
    return f"[serve-{level}-{i}] Continue this story: " + " ".join(rng.choice(WORDS) for _ in range(words))


def request_body(model: str, level: int, i: int, s: Sampling, prompt_words: int = 32) -> dict[str, Any]:
    """The JSON body of request ``i`` of level ``level`` (the same for ours and the peer but for ``model``)."""
    return {"model": model, "messages": [{"role": "user", "content": prompt(s.seed, level, i, prompt_words)}],
            "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
            "min_p": s.min_p, "seed": s.seed + i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


@dataclass
class Result:
    """One request as the client saw it. Times are ``time.monotonic()`` seconds. ``chunks``: arrival time
    of each event whose ``choices[].delta.content`` was non-empty; ``usage``: the final usage object (None:
    none came); ``error``: why it failed ("" when ok)."""

    sent: float
    chunks: list[float] = field(default_factory=list)
    usage: dict | None = None
    done: float | None = None
    http_status: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        """A 200 answer that ended with its usage chunk and no error event."""
        return self.http_status == 200 and self.usage is not None and not self.error

    @property
    def completion_tokens(self) -> int:
        """``usage.completion_tokens`` (0 without usage)."""
        return int((self.usage or {}).get("completion_tokens") or 0)


def parse_event(line: bytes | str) -> dict | None:
    """The JSON object of one SSE ``data: {...}`` line; None for other lines (comments, ``[DONE]``, blank).
    Raises ValueError on a ``data: {`` line that is not valid JSON."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", errors="replace")
    line = line.strip()
    if not line.startswith("data: {"):
        return None
    return json.loads(line[6:])


def absorb(res: Result, obj: dict, now: float) -> None:
    """Fold one parsed event into ``res``: a text chunk's arrival, the usage, or an error event."""
    if "error" in obj:
        res.error = json.dumps(obj["error"])[:300]
        return
    if any((c.get("delta") or {}).get("content") for c in obj.get("choices") or ()):
        res.chunks.append(now)
    if obj.get("usage"):
        res.usage = obj["usage"]


async def stream_one(session: Any, url: str, headers: dict[str, str], body: dict, timeout_s: float) -> Result:
    """Send one streamed chat request with aiohttp ``session`` and read it to the end (bounded by
    ``timeout_s``: then ``error`` = "timeout"). Never raises for HTTP or network errors: they land in
    ``Result.error``."""
    import aiohttp

    res = Result(time.monotonic())
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers=headers) as r:
                res.http_status = r.status
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                    return res
                async for line in r.content:
                    obj = parse_event(line)
                    if obj is not None:
                        absorb(res, obj, time.monotonic())
    except TimeoutError:
        res.error = res.error or f"timeout after {timeout_s:.0f} s"
    except (aiohttp.ClientError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        res.done = time.monotonic()
    if res.http_status == 200 and res.usage is None and not res.error:
        res.error = "stream ended without usage"
    return res


async def run_level(url: str, api_key: str | None, bodies: list[dict], streams: int, max_level_s: float,
                    request_timeout_s: float = 300.0) -> tuple[list[Result], float]:
    """Send ``bodies`` from ``streams`` closed-loop clients (each takes the next body when its last one
    ended). Returns (results in body order, wall seconds from the first send to the last end). Clients take
    no new body after ``max_level_s`` (those bodies are not sent: fewer results than bodies)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[Result | None] = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    # One connection per request on both sides: llama-server drops a keep-alive connection after a streamed
    # answer (the next request on it fails with "Server disconnected"); a loopback connect costs ~0.1 ms.
    conn = aiohttp.TCPConnector(limit=streams, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=request_timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()

        async def client() -> None:
            for i in todo:
                if time.monotonic() - t0 > max_level_s:
                    return
                results[i] = await stream_one(session, url, headers, bodies[i], request_timeout_s)

        await asyncio.gather(*(client() for _ in range(streams)))
        wall = time.monotonic() - t0
    return [r for r in results if r is not None], wall


# ------------------------------------------------------------------------------------------- pure statistics


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation between order statistics (numpy's
    default "linear" method); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def level_stats(results: list[Result], wall_s: float, max_tokens: int) -> dict[str, Any]:
    """Figures of one level on one side, over its ok requests.

    ``tok_s``: completion tokens (usage) of ok requests / ``wall_s``; ``ttft_p50_ms``/``p99``: send -> first
    text chunk; ``itl_p50_ms``/``p99``: gaps between consecutive text chunks of a request, pooled over
    requests (a chunk can carry more than one token: ``chunks_per_request`` says how many came);
    ``tpot_mean_ms``: (last chunk - first chunk) / (completion tokens - 1), mean over requests.
    ``token_check``: every request ok and its ``usage.completion_tokens == max_tokens``; ``chunk_check``:
    every ok request streamed at least one and at most ``completion_tokens`` text chunks (a server may put
    several tokens in one chunk, or none in a chunk whose token decodes to no text yet); ``errors``: up to 3
    error strings. Raises ValueError if ``wall_s`` <= 0.
    """
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ok = [r for r in results if r.ok]
    ttft = [r.chunks[0] - r.sent for r in ok if r.chunks]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:])]
    tpot = [(r.chunks[-1] - r.chunks[0]) / (r.completion_tokens - 1) for r in ok
            if len(r.chunks) > 1 and r.completion_tokens > 1]
    tokens = [r.completion_tokens for r in ok]
    chunks = [len(r.chunks) for r in ok]
    return {
        "requests": len(results), "ok": len(ok), "wall_s": round(wall_s, 3),
        "completion_tokens": sum(tokens), "tok_s": round(sum(tokens) / wall_s, 2),
        "ttft_p50_ms": _ms(pct(ttft, 0.5)), "ttft_p99_ms": _ms(pct(ttft, 0.99)),
        "itl_p50_ms": _ms(pct(itl, 0.5)), "itl_p99_ms": _ms(pct(itl, 0.99)),
        "tpot_mean_ms": _ms(sum(tpot) / len(tpot)) if tpot else None,
        "completion_tokens_min": min(tokens, default=0), "completion_tokens_max": max(tokens, default=0),
        "chunks_per_request_min": min(chunks, default=0), "chunks_per_request_max": max(chunks, default=0),
        "prompt_tokens": sum(int((r.usage or {}).get("prompt_tokens") or 0) for r in ok),
        "prompt_tokens_max": max((int((r.usage or {}).get("prompt_tokens") or 0) for r in ok), default=0),
        "token_check": bool(ok) and len(ok) == len(results) and all(t == max_tokens for t in tokens),
        "chunk_check": bool(ok) and all(1 <= c <= t for c, t in zip(chunks, tokens)),
        "errors": [r.error for r in results if not r.ok][:3],
    }
