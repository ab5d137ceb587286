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

import logging
from typing import Protocol

from bus import subjects
from bus.messages import GenerateRequest

log = logging.getLogger(__name__)

MAX_JOURNAL_BYTES = 32 * 1024 * 1024  # per model version: queued requests only, so small


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
    """JetStream stream name of a version's journal (no dots allowed in stream names)."""
    return f"SCHED_{name}_{version}"


class JetStreamJournal:
    """Journal in a JetStream stream. Create with ``await JetStreamJournal.open(nats_bus, name, version)``."""

    def __init__(self, js, name: str, version: str) -> None:
        self.js, self.stream = js, stream_name(name, version)
        self.subject = subjects.sched_journal(name, version)
        self._seq: dict[str, int] = {}  # request id -> stream sequence

    @classmethod
    async def open(cls, bus, name: str, version: str) -> "JetStreamJournal":
        """Bind (creating if needed) the version's stream. ``bus``: a connected NatsBus."""
        from nats.js.api import RetentionPolicy, StorageType, StreamConfig
        from nats.js.errors import NotFoundError
        j = cls(bus.client.jetstream(), name, version)
        try:
            await j.js.stream_info(j.stream)
        except NotFoundError:
            await j.js.add_stream(StreamConfig(name=j.stream, subjects=[j.subject], storage=StorageType.FILE,
                                               retention=RetentionPolicy.LIMITS, max_bytes=MAX_JOURNAL_BYTES,
                                               max_age=24 * 3600, duplicate_window=120))
        return j

    async def append(self, req: GenerateRequest) -> None:
        """Persist ``req`` (acknowledged by the server before returning)."""
        ack = await self.js.publish(self.subject, req.encode(), timeout=2.0,
                                    headers={"Nats-Msg-Id": req.request_id})
        self._seq[req.request_id] = ack.seq

    async def remove(self, request_id: str) -> None:
        """Delete the request's entry (best effort: a leftover entry is skipped at replay if stale)."""
        seq = self._seq.pop(request_id, None)
        if seq is None:
            return
        try:
            await self.js.delete_msg(self.stream, seq)
        except Exception as exc:  # already gone, or the server is away: replay checks deadlines
            log.warning("journal delete of %s failed: %s", request_id, exc)

    async def replay(self) -> list[GenerateRequest]:
        """Every request left in the stream, oldest first; entries become this instance's to remove."""
        from nats.js.errors import NotFoundError
        out, seq = [], 1
        while True:
            try:
                msg = await self.js.get_msg(self.stream, seq=seq, subject=self.subject, next=True)
            except NotFoundError:
                return out
            try:
                req = GenerateRequest.decode(msg.data)
                self._seq[req.request_id] = msg.seq
                out.append(req)
            except ValueError as exc:
                log.warning("skipping undecodable journal entry %d: %s", msg.seq, exc)
            seq = msg.seq + 1
