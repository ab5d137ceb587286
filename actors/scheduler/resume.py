"""Migrated sequences at the scheduler: a worker that gives up a running sequence (preemption notice,
drain; actors/worker/migration.py) submits it again with ``GenerateRequest.resume`` set. It was admitted
already, so no admission rule applies (queue limits, deadline prediction, fair-share caps): it goes
ahead of the queue, straight to a worker other than the one that gave it up, with prefill priority
(``urgent``), and is tracked in flight there as having streamed (a loss of that worker ends it
``worker_lost`` instead of restarting it from its first token, which would repeat text).

The submit's answer is the hand-over's outcome: ``accepted`` once another worker acknowledged the
dispatch, refused when no other worker took it within ``PLACE_S`` seconds (or none is alive at all:
refused at once). Refused, the giver keeps the sequence and finishes it in place (until its notice's
deadline); the scheduler then counts it in flight there again. The placement runs as its own task, so
the submit subscription keeps serving while a hand-over waits for a slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from bus.errors import ServeError
from bus.messages import GenerateRequest

log = logging.getLogger(__name__)

PLACE_S = 2.0  # longest wait for a worker with a free slot before the giver keeps the sequence (s)
POLL_S = 0.05  # retry period of a placement while every other worker is full (s)

_tasks: set[asyncio.Task] = set()  # running placements (kept referenced until done)


class ResumeHost(Protocol):
    """What placing a migrated sequence uses of its scheduler (``SchedulerService`` implements it)."""

    cfg: Any  # SchedulerConfig (retry_after_s)
    table: Any  # WorkerTable: the workers, their in-flight requests, pick / on_refused
    requests: dict[str, GenerateRequest]  # dispatched, not done

    async def dispatch(self, worker_id: str, req: GenerateRequest, preempt: str = "", urgent: bool = False) -> bool:
        """Send ``req`` to ``worker_id``; True when it accepted."""

    async def ack(self, msg: Any, ok: bool, error: dict | None = None) -> None:
        """Answer the hand-over on ``msg``."""


def start(svc: ResumeHost, msg, req: GenerateRequest) -> None:
    """Place the migrated ``req`` (submitted on ``msg``) in the background (see module docstring)."""
    t = asyncio.create_task(handle(svc, msg, req))
    _tasks.add(t)
    t.add_done_callback(_tasks.discard)


def giver_of(req: GenerateRequest) -> str:
    """The worker that gave the sequence up ("" when the resume object does not say)."""
    return str((req.resume or {}).get("from_worker") or "")


def resumed_tokens(req: GenerateRequest) -> int:
    """Tokens the receiver must hold: prompt + generated so far."""
    return len(req.prompt_token_ids) + len((req.resume or {}).get("output_ids") or ())


async def handle(svc: ResumeHost, msg, req: GenerateRequest) -> None:
    """Take ``req`` out of its giver's in-flight table, dispatch it elsewhere, answer the giver."""
    rid, giver_id = req.request_id, giver_of(req)
    giver = svc.table.workers.get(giver_id)
    if giver is not None:
        giver.inflight.pop(rid, None)
        giver.draining = True  # its credits say so too; this closes the window before the next heartbeat
    held = svc.requests.pop(rid, None)
    t0 = time.monotonic()
    target = await place(svc, req, giver_id)
    if target is None:  # nobody took it: the giver finishes it in place
        if giver is not None:
            giver.inflight[rid] = True
        if held is not None:
            svc.requests[rid] = held
        log.warning("migration of %s from %s: no other worker took it within %.1f s", rid, giver_id,
                    time.monotonic() - t0)
        return await svc.ack(msg, False, ServeError(503, "no other worker of this version can take the sequence",
                                                     type="unavailable", code="no_worker_for_migration",
                                                     retryable=True, retry_after=svc.cfg.retry_after_s).to_wire())
    log.info("migrated %s from %s to %s (placed in %.0f ms)", rid, giver_id, target,
             (time.monotonic() - t0) * 1e3)
    await svc.ack(msg, True)


def others_alive(svc: ResumeHost, giver_id: str, now: float) -> bool:
    """True when a worker other than the giver is leased, not draining and heartbeating."""
    return any(w.worker_id != giver_id and w.leased and not w.draining
               and now - w.last_credit_ts <= svc.table.stale_after_s for w in svc.table.workers.values())


async def place(svc: ResumeHost, req: GenerateRequest, giver_id: str) -> str | None:
    """Dispatch ``req`` to a worker other than ``giver_id`` within PLACE_S s; its id, or None."""
    rid, n = req.request_id, resumed_tokens(req)
    t_end = time.monotonic() + PLACE_S
    while True:
        now = time.monotonic()
        w = svc.table.pick(n, now)
        if w is not None and w.worker_id != giver_id:
            w.take(rid, n)
            w.inflight[rid] = True  # it has streamed: a loss of this worker must not restart it from scratch
            if await svc.dispatch(w.worker_id, req, "", True):
                return w.worker_id
            svc.table.on_refused(w.worker_id, rid)
        elif not others_alive(svc, giver_id, now):
            return None
        if time.monotonic() >= t_end:
            return None
        await asyncio.sleep(POLL_S)
