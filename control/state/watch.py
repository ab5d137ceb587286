"""Watching an etcd prefix without losing or repeating an event: list-then-watch, resume after a broken
stream, resync after compaction, quiet retries while etcd is away.

Used through ``Registry.watch_prefix``; needs only the registry's ``client``, ``_call`` (bounded call) and
``get_prefix_json_rev`` (no import of the registry module).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator

import aetcd.exceptions
import orjson

from control.state.leases import OutageLog

log = logging.getLogger(__name__)

Event = tuple[str, str, Any]  # ("put", key, decoded value) | ("delete", key, None)


async def watch_prefix(reg: Any, prefix: str, *, start_revision: int | None = None, include_existing: bool = False,
                       retry_delay: float = 0.5, max_retry_delay: float = 2.0) -> AsyncIterator[Event]:
    """Yield ``(event, key, value)`` for every change under ``prefix``, forever (``reg``: a Registry).

    ``event`` is ``"put"`` (value = decoded JSON) or ``"delete"`` (value None). With
    ``include_existing`` the current keys are yielded first as puts (list-then-watch, no gap).
    On a broken stream it reconnects with backoff (``retry_delay`` doubling up to
    ``max_retry_delay`` seconds) and resumes after the last seen revision, so no event is lost
    or repeated. If that revision was compacted it resyncs: current keys as puts, and deletes
    for keys it had seen that are gone. Non-JSON values are logged and skipped. While etcd is
    away (also for the first listing) it keeps retrying and logs once per outage, not per try.
    Stop by breaking out of the loop / closing the generator.
    """
    known: set[str] = set()
    next_rev = start_revision
    outage = OutageLog(log, f"watch on {prefix}")
    if include_existing or next_rev is None:
        snap_rev, snapshot = await snapshot_retrying(reg, prefix, retry_delay, max_retry_delay, outage)
        if include_existing:
            for item in _resync(known, snapshot):
                yield item
        next_rev = snap_rev + 1 if next_rev is None else next_rev
    delay = retry_delay
    while True:
        watch = None
        try:
            watch = await reg._call(reg.client.watch_prefix(prefix.encode("utf-8"), start_revision=next_rev))
            delay = retry_delay
            outage.ok()
            async for ev in watch:
                next_rev = int(ev.kv.mod_revision) + 1
                item = _event(prefix, ev, known)
                if item is not None:
                    yield item
            # The iterator ended without an error: the watch was cancelled under us (etcd going away).
            outage.failed(RuntimeError("watch stream ended"))
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_retry_delay)
        except aetcd.exceptions.RevisionCompactedError as e:
            log.warning("watch on %s: revision %s compacted (%r); resyncing", prefix, next_rev, e)
            snap_rev, snapshot = await snapshot_retrying(reg, prefix, retry_delay, max_retry_delay, outage)
            for item in _resync(known, snapshot):
                yield item
            next_rev = snap_rev + 1
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            if not outage.failed(e):
                log.debug("watch on %s failed (%r); reconnecting in %.1f s", prefix, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_retry_delay)
        finally:
            if watch is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(watch.cancel(), 1.0)


def _event(prefix: str, ev: Any, known: set[str]) -> Event | None:
    """The event of one etcd watch event (None for a non-JSON value, logged); keeps ``known`` current."""
    k = ev.kv.key.decode("utf-8")
    if ev.kind == "DELETE":
        known.discard(k)
        return "delete", k, None
    try:
        v = orjson.loads(ev.kv.value)
    except orjson.JSONDecodeError:
        log.warning("watch %s: skipping non-JSON value at %s", prefix, k)
        return None
    known.add(k)
    return "put", k, v


def _resync(known: set[str], snapshot: dict[str, Any]) -> list[Event]:
    """Deletes of the keys in ``known`` that ``snapshot`` lacks (sorted), then every snapshot key as a put;
    ``known`` becomes the snapshot's keys."""
    gone = sorted(known - snapshot.keys())
    known.clear()
    known.update(snapshot)
    return [("delete", k, None) for k in gone] + [("put", k, v) for k, v in snapshot.items()]


async def snapshot_retrying(reg: Any, prefix: str, delay: float, max_delay: float,
                            outage: OutageLog | None = None) -> tuple[int, dict[str, Any]]:
    """``reg.get_prefix_json_rev(prefix)``, retried with backoff (``delay`` doubling up to ``max_delay`` s)
    until etcd answers; failures logged once per outage."""
    outage = outage or OutageLog(log, f"listing of {prefix}")
    while True:
        try:
            out = await reg.get_prefix_json_rev(prefix)
            outage.ok()
            return out
        except Exception as e:
            outage.failed(e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
