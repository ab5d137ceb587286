"""Durable journal of a scheduler's queued requests, so a standby can recover them after a failover.

The active scheduler appends each accepted request before acknowledging it and removes the entry once a
worker took the request (from then on the worker streams it; the queue no longer holds it). A scheduler that
wins the election replays what is left: exactly the requests that were queued, not dispatched, when its
predecessor died (a removal still unwritten then is replayed: the window decision 0010 names).

``JetStreamJournal``: one JetStream stream per model version (file storage, capped), subject
``as.int.sched.<name>.<version>.journal``, de-duplicated by request id (``Nats-Msg-Id``); removals are
group-committed as tombstones and purged in bulk (decision 0054).
``MemoryJournal``: the same contract in memory, for unit tests of the scheduler's logic.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from typing import Protocol

from bus import streams, subjects
from bus.messages import GenerateRequest

log = logging.getLogger(__name__)

MAX_JOURNAL_BYTES = streams.JOURNAL_MAX_BYTES  # per model version: queued requests only, so small
PURGE_EVERY_S = 0.5  # at most one purge of removed entries per this many seconds (one STREAM.PURGE call)
COMPACT_MIN_DEAD = 1024  # dead messages held above the oldest live entry before it is written again at the tip
FLUSH_RETRY_S = 0.5  # between tombstone writes while the server does not answer (s)
MAX_UNCONTIGUOUS = 65536  # own sequences kept above a gap of _known_upto (then purging stops growing its floor)
TOMBSTONE_PREFIX = b'{"removed":'  # a tombstone's first bytes (a GenerateRequest encodes as another object)


class Journal(Protocol):
    """Append / remove / replay queued requests."""

    async def append(self, req: GenerateRequest) -> None: ...

    async def remove(self, request_id: str) -> None: ...

    async def flush(self, timeout: float = 2.0) -> None: ...

    def close(self) -> None: ...

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

    async def flush(self, timeout: float = 2.0) -> None:
        """Nothing to write: removals here take effect at once."""

    def close(self) -> None:
        """Nothing to stop."""

    async def replay(self) -> list[GenerateRequest]:
        """Every request still recorded, oldest first."""
        return list(self.entries.values())


def stream_name(name: str, version: str) -> str:
    """JetStream stream name of a version's journal (``bus.streams.journal_stream``)."""
    return streams.journal_stream(name, version)


class JetStreamJournal:
    """Journal in a JetStream stream. Create with ``await JetStreamJournal.open(nats_bus, name, version)``.

    Removals are group-committed (issue [25] item 2, decision 0054): ``remove`` returns at once; one background
    flush at a time writes the sequences of every entry removed since the last flush as one *tombstone* on the
    journal's subject (``{"removed": [sequence, ...]}``), and at most every PURGE_EVERY_S the stream is purged
    below its oldest live entry (one ``STREAM.PURGE`` with ``seq``). Replay applies entries and tombstones in
    stream order. Under load a flush carries every removal made during the previous flush's round trip, so a
    dispatched request costs a fraction of one write instead of a delete request, its reply and the server's
    advisory. A live entry that holds COMPACT_MIN_DEAD (and 4x the live count) dead messages behind it is
    written again at the tip (compaction), so a long-queued request does not make the stream grow.
    """

    def __init__(self, js, name: str, version: str) -> None:
        self.js, self.config = js, streams.journal(name, version)
        self.stream, self.subject = self.config.name, subjects.sched_journal(name, version)
        self._seq: dict[str, int] = {}  # live entry: request id -> stream sequence
        self._removed: list[int] = []  # sequences removed since the last tombstone (the next flush writes them)
        self._dead: list[int] = []  # ascending: removed entries and tombstones not yet purged
        self._tip = 0  # the highest sequence this instance has seen stored
        self._appending: dict[int, int] = {}  # write in flight -> its floor (the tip + 1 when it started)
        self._writes = 0  # writes started (keys of _appending)
        self._purged = 1  # every sequence below this one was purged by this instance
        self._last_purge = 0.0  # time.monotonic() of the last purge
        self._flusher: asyncio.Future | None = None
        self._storing: set[str] = set()  # request ids whose append is in flight
        self._closed = False  # close(): no purge or compaction (the stream is another scheduler's now)
        self._known_upto = 0  # every sequence up to this one was stored by this instance or read by its replay
        self._mine: set[int] = set()  # sequences this instance stored above _known_upto (not contiguous yet)
        self._gone_early: set[str] = set()  # of those, the ones removed meanwhile

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
        rid = req.request_id
        self._storing.add(rid)
        try:
            seq = await self._store(req.encode(), f"{rid}/{req.marks.get('sched_in', '')}")  # one id a take
        except BaseException:
            self._gone_early.discard(rid)  # not journaled: a later append of the same id starts afresh
            raise
        finally:
            self._storing.discard(rid)
        if rid in self._gone_early:  # removed while its append was in flight: remove it now
            self._gone_early.discard(rid)
            self._seq[rid] = seq
            await self.remove(rid)
        else:
            self._seq[rid] = seq

    async def _store(self, data: bytes, msg_id: str | None) -> int:
        """Publish ``data`` on the journal subject and return its sequence. While the write is in flight no
        purge reaches the tip it started from (its sequence is not known yet)."""
        token, self._writes = self._writes, self._writes + 1
        self._appending[token] = self._tip + 1
        try:
            seq = await self.js.publish(self.subject, data, msg_id=msg_id, timeout=2.0, ride_out_s=0.0)
        finally:
            del self._appending[token]
        self._tip = max(self._tip, seq)
        self._own(seq)
        return seq

    def _own(self, seq: int) -> None:
        """Count ``seq`` as known; ``_known_upto`` advances over what is contiguous (a sequence another scheduler
        wrote leaves a gap it never passes: nothing at or above that one is ever purged by this instance)."""
        if seq > self._known_upto and len(self._mine) < MAX_UNCONTIGUOUS:  # past it: purging stays where it is
            self._mine.add(seq)
        while self._known_upto + 1 in self._mine:
            self._known_upto += 1
            self._mine.discard(self._known_upto)

    async def remove(self, request_id: str) -> None:
        """Forget the request's entry. Never waits for the server: the next flush writes it, in the
        background (``flush`` waits for it)."""
        seq = self._seq.pop(request_id, None)
        if seq is None:
            if request_id in self._storing:  # dispatched before its append was acknowledged
                self._gone_early.add(request_id)
            return
        self._removed.append(seq)
        bisect.insort(self._dead, seq)
        self._start_flush()

    def _start_flush(self) -> None:
        """Start the background flush unless one runs."""
        if self._removed and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.ensure_future(self._flush_loop())

    def close(self) -> None:
        """Stop purging and compacting (a scheduler that stood down: the next active one writes the stream, and
        a purge below this instance's floor could take that one's entries). Tombstones still go out."""
        self._closed = True

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout`` s) until every removal so far is written (a scheduler stepping down)."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.wait([self._flusher], timeout=timeout)

    async def _flush_loop(self) -> None:
        """Write tombstones until no removal is left, retrying every FLUSH_RETRY_S while the server does not
        answer (a failover meanwhile replays those entries); compact and purge when due."""
        while self._removed:
            batch = list(self._removed)
            try:
                seq = await self._store(json.dumps({"removed": batch}).encode(), None)
            except Exception as exc:
                log.warning("journal tombstone of %d removals failed (retrying): %s", len(batch), exc)
                await asyncio.sleep(FLUSH_RETRY_S)
                continue
            del self._removed[:len(batch)]
            bisect.insort(self._dead, seq)
            await self._maybe_compact()
            await self._maybe_purge()

    def _floor(self) -> int:
        """The lowest sequence that must be kept: the oldest live entry, a write in flight's floor, or the first
        sequence this instance does not know (another scheduler's: a successor's entries, a predecessor's late
        tombstone)."""
        return min([*self._seq.values(), *self._appending.values(), self._tip + 1, self._known_upto + 1])

    async def _maybe_purge(self) -> None:
        """Purge below the floor (:meth:`_floor`), at most every PURGE_EVERY_S, never after close()."""
        if self._closed or time.monotonic() - self._last_purge < PURGE_EVERY_S:
            return
        try:
            await self._close_gaps()
            floor = self._floor()
            if floor <= self._purged:
                return
            await self.js.purge(self.stream, floor)
        except Exception as exc:  # the next flush tries again; replay skips what tombstones name
            log.warning("journal purge below %d failed: %s", floor, exc)
            return
        self._purged, self._last_purge = floor, time.monotonic()
        del self._dead[:bisect.bisect_left(self._dead, floor)]

    async def _close_gaps(self, limit: int = 64) -> None:
        """Advance ``_known_upto`` over sequences this instance did not store but may purge: gone ones (deleted,
        purged, a publish that was never stored), tombstones, and its own entries whose acknowledgement it missed
        (a timed-out append: the sequence holds a request it journaled or removed). An entry of a request it
        does not know (another scheduler's) stops it. Reads at most ``limit`` messages."""
        for _ in range(limit):
            if not self._mine or self._known_upto + 1 in self._mine:
                return
            got = await self.js.next_msg(self.stream, self.subject, self._known_upto + 1)
            if got is None:
                return
            seq, data = got
            if seq > self._known_upto + 1:  # the sequences before it are gone
                self._known_upto = seq - 1
            elif data.startswith(TOMBSTONE_PREFIX) or self._is_dead(seq) or seq in self._seq.values():
                self._known_upto = seq
            else:
                return  # an entry this instance never held: not its to purge
            self._own(self._known_upto)

    async def _maybe_compact(self) -> None:
        """Write again at the tip each live entry below the newest dead message once COMPACT_MIN_DEAD (and 4x
        the live count) dead messages are held above the floor, so the next purge frees them; the old copy
        is removed like any entry (replay keeps a request's newest copy meanwhile)."""
        floor = self._floor()
        held = len(self._dead) - bisect.bisect_left(self._dead, floor)
        if (self._closed or not self._seq or min(self._seq.values()) > floor  # not a live entry holding it
                or held < max(COMPACT_MIN_DEAD, 4 * len(self._seq))):
            return
        top = self._dead[-1]
        for rid, seq in [(r, s) for r, s in self._seq.items() if s < top]:
            try:
                got = await self.js.next_msg(self.stream, self.subject, seq)
                if got is None or got[0] != seq or self._seq.get(rid) != seq:
                    continue  # removed meanwhile, or discarded by the stream's limits
                copy = await self._store(got[1], f"{rid}@{seq}")
            except Exception as exc:  # kept where it is; the next flush tries again
                log.warning("journal compaction of %s failed: %s", rid, exc)
                return
            if self._seq.get(rid) == seq:  # still live: the copy stands for it, the old one goes
                self._seq[rid], dead = copy, seq
            else:  # removed while the copy was written (the old sequence is tombstoned already): the copy goes
                dead = copy
            self._removed.append(dead)
            bisect.insort(self._dead, dead)

    async def replay(self) -> list[GenerateRequest]:
        """Every request left in the stream, in the order it was first journaled: entries no tombstone names
        (by sequence), a compacted request's newest copy. Its entries become this instance's to remove."""
        entries: dict[int, GenerateRequest] = {}
        seq, last = 1, await self.js.last_seq(self.stream)  # everything up to it is read below, or gone
        while (found := await self.js.next_msg(self.stream, self.subject, seq)) is not None:
            seq, data = found
            self._tip = max(self._tip, seq)
            if data.startswith(TOMBSTONE_PREFIX):
                self._dead.append(seq)
                for gone in json.loads(data).get("removed", []):
                    if entries.pop(gone, None) is not None:
                        self._dead.append(gone)
            elif (req := _decode(seq, data)) is not None:
                entries[seq] = req
            seq += 1
        self._known_upto = max(self._known_upto, self._tip, last)  # read: every message up to here, the gaps gone
        self._own(self._known_upto)
        return self._adopt(entries)

    def _adopt(self, entries: dict[int, GenerateRequest]) -> list[GenerateRequest]:
        """Take the replayed ``entries`` (sequence -> request, ascending) as this instance's live ones."""
        copies: dict[str, tuple[int, int]] = {}  # request id -> (first sequence, newest sequence)
        for s, req in entries.items():
            first, old = copies.get(req.request_id, (s, None))
            if old is not None:  # the older copy of a compacted entry: the next tombstone names it
                self._dead.append(old)
                self._removed.append(old)
            copies[req.request_id] = (first, s)
        self._dead.sort()
        # merged, not replaced: this instance may have journaled (and removed) requests while it read the stream
        self._seq.update({rid: s for rid, (_, s) in copies.items() if not self._is_dead(s)})
        self._start_flush()  # older copies of compacted entries
        return [entries[s] for _, s in sorted(copies.values()) if not self._is_dead(s)]

    def _is_dead(self, seq: int) -> bool:
        """Whether ``seq`` was removed (or tombstoned) as far as this instance knows."""
        i = bisect.bisect_left(self._dead, seq)
        return i < len(self._dead) and self._dead[i] == seq


def _decode(seq: int, data: bytes) -> GenerateRequest | None:
    """The journal entry ``seq`` (None, logged, if it does not decode)."""
    try:
        return GenerateRequest.decode(data)
    except ValueError as exc:
        log.warning("skipping undecodable journal entry %d: %s", seq, exc)
        return None
