"""NATS wire tap of ``actorserve bench platform --tap``: messages by subject pattern while a load runs.

Run as ``python -m bench.platform_tap --nats URL --seconds S`` (its own process, outside the measured
phases: a subscriber to ``>`` makes nats-server copy every message once more). Prints one JSON object:
``{"patterns": {pattern: messages}, "bytes": {pattern: bytes}, "total": messages}``, where a subject's
pattern has every id-like token (a digit in it, or 12+ characters) replaced by ``*`` and inbox subjects cut
to ``_INBOX*.<tenant>.*`` (docs/architecture.md lists the subjects).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys

import orjson

from bus import subjects

_ID = re.compile(r"\d|^[0-9a-f-]{12,}$|^.{20,}$")


def pattern(subject: str) -> str:
    """The subject with id-like tokens replaced by ``*``; inboxes keep their first two tokens."""
    toks = subject.split(".")
    if toks[0].startswith(subjects.INBOX):
        return ".".join(toks[:2] + ["*"]) if len(toks) > 2 else toks[0] + ".*"
    return ".".join("*" if _ID.search(t) else t for t in toks)


async def tap(url: str, seconds: float) -> dict:
    """Subscribe to ``>`` for ``seconds``; counts by pattern."""
    from bus.nats_bus import NatsBus

    bus = await NatsBus.connect(url, name="bench-platform-tap")
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}

    async def on(msg) -> None:
        p = pattern(msg.subject)
        counts[p] = counts.get(p, 0) + 1
        sizes[p] = sizes.get(p, 0) + len(msg.data)
    await bus.subscribe(">", on)
    print("ready", file=sys.stderr, flush=True)
    await asyncio.sleep(seconds)
    await bus.close()
    return {"patterns": dict(sorted(counts.items(), key=lambda kv: -kv[1])), "bytes": sizes,
            "total": sum(counts.values())}


def main(argv: list[str] | None = None) -> int:
    """Parse ``--nats`` / ``--seconds``, tap, print the JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.platform_tap")
    p.add_argument("--nats", required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    a = p.parse_args(argv)
    print(orjson.dumps(asyncio.run(tap(a.nats, a.seconds))).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
