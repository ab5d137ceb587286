#!/usr/bin/env python3
"""``actorserve-probe [--require TEXT] [URL]``: exit 0 when ``GET URL`` answers 2xx within 2 s (and, with
``--require``, its body contains TEXT), else 1 (one line on stderr).

The container health check of the image (Dockerfile ``HEALTHCHECK``) and the exec probe of the actors
that serve no HTTP port of their own (docs/deployment.md): the gateway's ``/readyz`` on its port, or an
actor's loopback ``/metrics`` (``--metrics-port``). URL defaults to ``$ACTORSERVE_PROBE_URL``, else
``http://127.0.0.1:8000/readyz``. Standard library only, loopback only (refuses other hosts).

A worker's readiness probe requires ``actorserve_kv_cache_usage_perc`` in its /metrics: the gauge appears
once the engine is loaded and the worker's service runs (actors/worker/actor.py ``_track_gauges``), so a
rolling update does not retire an old worker before the new one can serve.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/readyz"
TIMEOUT_S = 2.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def probe(url: str, timeout_s: float = TIMEOUT_S, require: str | None = None) -> str | None:
    """None when ``GET url`` answers 2xx within ``timeout_s`` seconds (with ``require`` in its body when
    given), else the reason (a string). Raises ValueError for a URL that is not http(s) on a loopback host."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"probe URL {url!r} must be http(s) on a loopback host")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (loopback only)
            if not 200 <= resp.status < 300:
                return f"status {resp.status}"
            if require is not None and require.encode() not in resp.read(8 * 1024 * 1024):
                return f"{require!r} not in the body"
            return None
    except urllib.error.HTTPError as e:
        return f"status {e.code}"
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Probe ``[--require TEXT] [URL]`` (URL defaults as above); 0 healthy, 1 not, 2 bad usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    require = None
    if argv[:1] == ["--require"]:
        if len(argv) < 2:
            print("actorserve-probe: --require needs TEXT", file=sys.stderr)
            return 2
        require, argv = argv[1], argv[2:]
    if len(argv) > 1:
        print("usage: actorserve-probe [--require TEXT] [URL]", file=sys.stderr)
        return 2
    url = argv[0] if argv else os.environ.get("ACTORSERVE_PROBE_URL") or DEFAULT_URL
    try:
        why = probe(url, require=require)
    except ValueError as e:
        print(f"actorserve-probe: {e}", file=sys.stderr)
        return 2
    if why is not None:
        print(f"actorserve-probe: {url}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
