"""Durable journal of a scheduler's queued requests, so a standby can recover them after a failover.

The active scheduler appends each accepted request before acknowledging it and removes the entry
once a worker took the request (from then on the worker streams it; the queue no longer holds it).
A scheduler that wins the election replays what is left: exactly the requests that were queued, not
dispatched, when its predecessor died.

``JetStreamJournal``: one JetStream stream per model version (file storage, capped), subject
``as.int.sched.<name>.<version>.journal``, de-duplicated by request id (``Nats-Msg-Id``).
``MemoryJournal``: the same contract in memory, for unit tests of the scheduler's logic.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from bus import streams, subjects
from bus.messages import GenerateRequest

log = logging.getLogger(__name__)

MAX_JOURNAL_BYTES = streams.JOURNAL_MAX_BYTES  # per model version: queued requests only, so small
REMOVE_WAIT_S = 0.25  # the most JetStreamJournal.remove holds its caller (the dispatch loop) (s)


class Journal(Protocol):
    """Append / remove / replay queued requests."""

    async def append(self, req: GenerateRequest) -> None: ...

    async def remove(self, request_id: str) -> None: ...

    async def replay(self) -> list[GenerateRequest]: ...


class MemoryJournal:
    """In-memory journal (unit tests; survives a SchedulerService instance, not a process)."""

    def __init__(self) -> None:
        self.entries: dict[str, GenerateRequest] = {}

    async def append(self, req: GenerateRequest) -> None:
        """Record ``req`` as queued."""
        self.entries[req.request_id] = req

    async def remove(self, request_id: str) -> None:
        """Forget a request (dispatched or ended)."""
        self.entries.pop(request_id, None)

    async def replay(self) -> list[GenerateRequest]:
        """Every request still recorded, oldest first."""
        return list(self.entries.values())


def stream_name(name: str, version: str) -> str:
    """JetStream stream name of a version's journal (``bus.streams.journal_stream``)."""
    return streams.journal_stream(name, version)


class JetStreamJournal:
    """Journal in a JetStream stream. Create with ``await JetStreamJournal.open(nats_bus, name, version)``."""

    def __init__(self, js, name: str, version: str) -> None:
        self.js, self.config = js, streams.journal(name, version)
        self.stream, self.subject = self.config.name, subjects.sched_journal(name, version)
        self._seq: dict[str, int] = {}  # request id -> stream sequence
        self._pending: set[asyncio.Future] = set()  # deletes still waiting for the server (see remove)

    @classmethod
    async def open(cls, bus, name: str, version: str) -> "JetStreamJournal":
        """Bind (creating if needed) the version's stream. ``bus``: a connected NatsBus."""
        j = cls(bus.js(), name, version)
        await j.js.ensure_stream(j.config)
        return j

    async def append(self, req: GenerateRequest) -> None:
        """Persist ``req`` (acknowledged by the server before returning). A "no leader" answer is not waited
        out here (``ride_out_s=0``): the scheduler takes submits one at a time, and one wait would hold every
        submit behind it; the refusal (journal_unavailable) is retried by the validator, per request."""
        self._seq[req.request_id] = await self.js.publish(self.subject, req.encode(), msg_id=req.request_id,
                                                          timeout=2.0, ride_out_s=0.0)

    async def remove(self, request_id: str) -> None:
        """Delete the request's entry (best effort: a leftover entry is skipped at replay if stale).

        Waits at most REMOVE_WAIT_S for the server: the scheduler's dispatch loop calls this after every
        dispatch, and a JetStream request lost in a nats-server restart would otherwise hold that loop
        for the whole JetStream timeout (5 s per dispatched request: the post-restart stall of issue 21).
        A delete still pending then completes (or fails, logged) in the background."""
        seq = self._seq.pop(request_id, None)
        if seq is None:
            return
        task = asyncio.ensure_future(self._delete(request_id, seq))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        await asyncio.wait([task], timeout=REMOVE_WAIT_S)

    async def _delete(self, request_id: str, seq: int) -> None:
        try:
            await self.js.delete_msg(self.stream, seq)
        except Exception as exc:  # already gone, or the server is away: replay checks deadlines
            log.warning("journal delete of %s failed: %s", request_id, exc)

    async def replay(self) -> list[GenerateRequest]:
        """Every request left in the stream, oldest first; entries become this instance's to remove."""
        out, seq = [], 1
        while (found := await self.js.next_msg(self.stream, self.subject, seq)) is not None:
            seq, data = found
            try:
                req = GenerateRequest.decode(data)
                self._seq[req.request_id] = seq
                out.append(req)
            except ValueError as exc:
                log.warning("skipping undecodable journal entry %d: %s", seq, exc)
            seq += 1
        return out
