"""Gateway in-flight table: one entry per request with deadline, inactivity timeout and gap detection.

All chunks for this gateway arrive on one wildcard subscription (``_INBOX.*.gw.<gateway_id>.*``)
and are routed here by request id into a bounded per-request queue. ``next_chunk`` is the only
wait, and it is bounded by the request's absolute deadline and by the inactivity timeout.

Client disconnects: :meth:`InflightTable.watch` registers a ``gone()`` check per request, and one task per
table calls every check each WATCH_S s; a client found gone ends its wait with ConnectionResetError. (Each
waiting request waking every 0.1 s by itself cost ~17 us per wake-up, measured: 500 requests queued under
an overload took 0.08 cores of the gateway, taken from a CPU worker on the same host.)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from bus.errors import ServeError
from bus.messages import Chunk, choice_request_id

WATCH_S = 0.1  # period of the client-disconnect checks of watched requests (s)
GONE = object()  # queued by the watch for a request whose client went away


class StreamError(ServeError):
    """A request's stream ended without a normal final chunk (deadline, silence, gap, bus loss, overflow): a
    :class:`bus.errors.ServeError` raised by the gateway's own hop. ``error``: its wire dict."""

    @classmethod
    def of(cls, err: ServeError) -> "StreamError":
        """``err`` as a StreamError (itself when it is one)."""
        return err if isinstance(err, StreamError) else cls.from_wire(err.to_wire())

    @property
    def error(self) -> dict:
        """The wire dict (``ServeError.to_wire()``)."""
        return self.to_wire()


@dataclass
class Inflight:
    """One request in flight at this gateway."""

    request_id: str
    deadline: float  # absolute, epoch s
    inactivity_s: float  # max gap between chunks (s)
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=4096))
    next_seq: int = 0  # next expected chunk seq
    worker_id: str = ""  # worker streaming it (set by the first token chunk)
    last_activity: float = field(default_factory=time.time)  # last chunk (or open) time, epoch s
    children: int = 1  # choices fanned out as bus.messages.choice_request_id(request_id, index) (1 = no fan-out)
    child_seq: dict = field(default_factory=dict)  # a fanned-out choice's Chunk.choice_index -> next expected seq
    child_worker: dict = field(default_factory=dict)  # a fanned-out choice's Chunk.choice_index -> its worker
    tenant: str = ""  # tenant of the request (a public NATS cancel must come from it)
    priority: str = "interactive"  # its priority class (what a refusal hint is learnt for, gateway/shed.py)
    # (choice index, worker id) of workers that handed the stream over to another (a migrated sequence,
    # actors/worker/migration.py): their chunks are no longer part of it
    handed_over: set = field(default_factory=set)


class InflightTable:
    """Requests in flight at one gateway, keyed by request id."""

    def __init__(self) -> None:
        self._by_id: dict[str, Inflight] = {}
        self._choices: dict[str, str] = {}  # choice request id of a fanned-out request -> its request id
        self._gone_checks: dict[str, Callable[[], bool]] = {}  # request id -> "has its client gone?"
        self._watch_task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, request_id: str, deadline: float, inactivity_s: float, children: int = 1) -> Inflight:
        """Register a request before it is sent (so no chunk can arrive unrouted). ValueError if present.

        ``children`` > 1: chunks of each choice (``choice_request_id(request_id, index)``, index < children)
        are routed to this entry too.
        """
        if request_id in self._by_id:
            raise ValueError(f"request id {request_id} is already in flight")
        entry = Inflight(request_id, deadline, inactivity_s, children=children)
        self._by_id[request_id] = entry
        if children > 1:
            self._choices.update((choice_request_id(request_id, i), request_id) for i in range(children))
        return entry

    def close(self, request_id: str) -> None:
        """Forget a request (idempotent), its choices' ids and its disconnect check."""
        entry = self._by_id.pop(request_id, None)
        if entry is not None and entry.children > 1:
            for i in range(entry.children):
                self._choices.pop(choice_request_id(request_id, i), None)
        self._gone_checks.pop(request_id, None)

    def watch(self, request_id: str, gone: Callable[[], bool]) -> None:
        """Check ``gone()`` every WATCH_S s while the request is open (until :meth:`close`); once it says
        True the request's ``next_chunk`` raises ConnectionResetError. Needs a running event loop."""
        if request_id not in self._by_id:
            return
        self._gone_checks[request_id] = gone
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch(), name="inflight-disconnect-watch")

    async def _watch(self) -> None:
        """Run the disconnect checks every WATCH_S s; ends when nothing is watched (``watch`` restarts it)."""
        while self._gone_checks:
            await asyncio.sleep(WATCH_S)
            for rid, gone in list(self._gone_checks.items()):
                try:
                    left = gone()
                except Exception:  # a broken check must not stop the others': treat as gone
                    left = True
                if left:
                    self._gone_checks.pop(rid, None)
                    self._push_end(rid, GONE)

    def get(self, request_id: str) -> Inflight | None:
        """The entry of a request, or of the request a fanned-out choice's id belongs to (registered by
        :meth:`open`; ids are never parsed)."""
        entry = self._by_id.get(request_id)
        if entry is None and request_id in self._choices:
            return self._by_id.get(self._choices[request_id])
        return entry

    def deliver(self, chunk: Chunk) -> bool:
        """Route an arrived chunk; False if the request is unknown (finished or never ours)."""
        entry = self.get(chunk.request_id)
        if entry is None:
            return False
        try:
            entry.queue.put_nowait(chunk)
        except asyncio.QueueFull:  # consumer stuck: end it rather than grow without bound
            self.fail(chunk.request_id, ServeError(503, "response stream overflowed", type="unavailable",
                                                   code="stream_overflow", retryable=True))
        return True

    def fail(self, request_id: str, error: ServeError) -> None:
        """Push a terminal error to one request's consumer."""
        self._push_end(request_id, error)

    def _push_end(self, request_id: str, item: ServeError | object) -> None:
        """Queue a terminal item (a ServeError or GONE) for one request's consumer."""
        entry = self._by_id.get(request_id)
        if entry is None:
            return
        while entry.queue.full():  # make room: the failure matters more than undelivered text
            entry.queue.get_nowait()
        entry.queue.put_nowait(item)

    def fail_all(self, error: ServeError) -> None:
        """Fail every request in flight (NATS disconnect)."""
        for rid in list(self._by_id):
            self.fail(rid, error)


async def next_chunk(entry: Inflight, poll_s: float | None = None) -> Chunk | None:
    """Wait for the next chunk of ``entry`` in order; None if ``poll_s`` seconds pass first.

    Raises StreamError on: deadline passed (503 deadline_exceeded), no chunk within the inactivity
    timeout since the last one once streaming has started (503 upstream_timeout), a sequence gap or a
    chunk of a worker that handed the stream over (502 stream_gap), or a pushed failure (e.g. NATS
    disconnect). Another worker may take the stream over at the next seq (a migrated sequence: the
    previous worker stopped at a step boundary; the gap is one prefill, well inside the inactivity limit). A final chunk
    carrying ``error`` is returned as is; ConnectionResetError once the disconnect watch found the client
    gone (:meth:`InflightTable.watch`). ``poll_s``: return None after that long without a chunk. Before
    the first chunk only the deadline bounds the wait: a request may sit in the scheduler's queue for
    most of its deadline (the scheduler ends it at the deadline), and a silence limit there failed
    admitted requests long before it.
    """
    now = time.time()
    started = entry.next_seq > 0 or bool(entry.child_seq)
    limit = min(entry.deadline, entry.last_activity + entry.inactivity_s) if started else entry.deadline
    if now >= limit:
        raise _timeout_error(entry, now)
    wait = limit - now if poll_s is None else min(poll_s, limit - now)
    try:
        async with asyncio.timeout(wait):  # not wait_for: see actors.aio.wait_event
            item = await entry.queue.get()
    except TimeoutError:
        if time.time() >= limit:
            raise _timeout_error(entry, time.time()) from None
        return None
    if item is GONE:
        raise ConnectionResetError("client disconnected")
    entry.last_activity = time.time()
    if isinstance(item, ServeError):
        raise StreamError.of(item)
    return _check_order(entry, item)


def _timeout_error(entry: Inflight, now: float) -> StreamError:
    if now >= entry.deadline:
        return StreamError(503, "the request's deadline passed", type="timeout", code="deadline_exceeded",
                           retryable=True, retry_after=1.0)
    return StreamError(503, f"no response from the model for {entry.inactivity_s:.0f} s", type="timeout",
                       code="upstream_timeout", retryable=True)


def _check_order(entry: Inflight, chunk: Chunk) -> Chunk:
    """Enforce consecutive seq numbers; a worker may take a stream over at the next seq (migration), after
    which the previous one's chunks are errors. Error chunks end the stream whatever their seq."""
    if chunk.error is not None:
        return chunk
    child = chunk.request_id != entry.request_id  # a fanned-out choice: its own sequence and worker
    i = chunk.choice_index  # the choice's state is found by the choice field
    expected = entry.child_seq.get(i, 0) if child else entry.next_seq
    worker = entry.child_worker.get(i, "") if child else entry.worker_id
    if chunk.seq != expected or (i, chunk.worker_id) in entry.handed_over:
        raise StreamError(502, f"response stream broken (expected chunk {expected}, got {chunk.seq})",
                          type="unavailable", code="stream_gap", retryable=True,
                          retry_after=1.0)  # a retry before the first token is safe: say so in the header
    if worker and chunk.worker_id != worker:  # taken over: the previous worker stopped at this seq
        entry.handed_over.add((i, worker))
    if child:
        entry.child_seq[i], entry.child_worker[i] = expected + 1, chunk.worker_id or worker
    else:
        entry.next_seq, entry.worker_id = expected + 1, chunk.worker_id or worker
    return chunk
