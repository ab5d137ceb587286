"""Moving running sequences off a worker: spot preemption notices and drains (issue [13] item 4).

A preemption notice (etcd ``preemption_notice_key(worker_id)`` = ``{"deadline": epoch s, "reason"}``, or
SIGUSR1: a notice with ``MigrationConfig.signal_notice_s`` of warning) makes the worker stop taking
work (credits ``draining``: its scheduler stops dispatching to it) and hand each sequence it holds to
another worker of its version. A drain (SIGTERM) does the same when another live worker of the version
exists (``peers``), instead of waiting for the sequences to finish.

Hand-over, per sequence, at a step boundary (the step loop calls :meth:`Migrator.between_steps`, the
only place the engine may be touched): ``engine.detach_request`` takes it out (no output reported) with
its generated tokens and sampler RNG state; the worker submits ``GenerateRequest(resume=ResumeState)``
to its version's scheduler submit subject, request-reply (actors/scheduler/resume.py answers once
another worker acknowledged the dispatch). That worker recomputes the KV cache from prompt + generated
tokens in one prefill (urgent: the next step), replays the detokenizer, stop-string, grammar and
tool-call parser state through the generated tokens without re-sending their text, and goes on at the
next chunk seq on the same reply subject, with the same RNG position (``Live.resume``). The client
sees one gap-free stream; only the worker id changes, and one prefill's latency.

Refused (no other worker took it within the scheduler's bound) or unanswered: the sequence goes back
into this engine the same way (the prefix cache usually still holds its full blocks) and finishes in
place; under a notice the move is tried again every ``retry_s``. At the notice's deadline whatever is
still here ends with a retryable 503 ``worker_preempted``: never silently lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Protocol

from actors.worker.live import Live
from actors.worker.migration_state import MAX_MIGRATIONS
from actors.worker.outputs import Outbox
from bus.errors import ServeError
from bus import subjects
from bus.base import Bus, BusError
from bus.messages import GenerateRequest, HopAck

log = logging.getLogger(__name__)


@dataclass
class MigrationConfig:
    """Bounds of hand-overs. ValueError on bad values."""

    handoff_timeout_s: float = 6.0  # wait for the scheduler's answer (its PLACE_S bound + one dispatch) (s)
    retry_s: float = 3.0  # under a notice: next try for sequences that stayed here (s)
    signal_notice_s: float = 120.0  # SIGUSR1: the warning it stands for (a cloud's 2-minute notice) (s)

    def __post_init__(self) -> None:
        if self.handoff_timeout_s <= 0 or self.retry_s <= 0 or self.signal_notice_s <= 0:
            raise ValueError("migration timeouts must be > 0")


def parse_notice(value) -> tuple[float, str]:
    """(deadline epoch s, reason) of a notice record ``{"deadline", "reason"}``; ValueError when malformed."""
    if not isinstance(value, dict):
        raise ValueError("a preemption notice must be an object")
    deadline = value.get("deadline")
    if not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or deadline <= 0:
        raise ValueError("a preemption notice needs a positive 'deadline' (epoch s)")
    return float(deadline), str(value.get("reason") or "preemption notice")


class MigrationHost(Protocol):
    """What the :class:`Migrator` uses of its worker (``WorkerService`` implements it)."""

    bus: Bus
    engine: Any  # its ``detach_request(request id) -> (output ids, RNG state) | None`` (optional)
    worker_id: str
    live: dict[str, Live]  # requests held (a hand-over takes one out; ``requeue`` puts it back)
    outbox: Outbox  # where a sequence ended at the notice deadline goes
    draining: bool  # True: credits say "take no more work"

    async def publish_credits(self) -> None:
        """Publish the worker's credits now."""

    def wake(self) -> None:
        """Run the step loop's next iteration now."""

    def requeue(self, lv: Live, req: GenerateRequest) -> None:
        """Put ``lv`` (its request now ``req``) back into the engine at the next step, urgent."""


class Migrator:
    """Hand-overs of one worker (``host``, through :class:`MigrationHost`): notices, drains, fallbacks,
    the deadline."""

    def __init__(self, host: MigrationHost, config: MigrationConfig | None = None) -> None:
        self.host, self.cfg = host, config or MigrationConfig()
        self.deadline = 0.0  # epoch s of the preemption notice (0: none)
        self.reason = ""
        self.wanted = False  # move every sequence at the next step boundary (from ``next_try``)
        self.next_try = 0.0  # epoch s
        self.pending: dict[str, asyncio.Task] = {}  # request id -> its hand-over in progress
        self.peers: Callable[[], Awaitable[int]] | None = None  # other live workers of the version (actor.py)
        self.gaps_ms: deque[float] = deque(maxlen=256)  # hand-over gaps of sequences resumed here (ms)
        self.num_out = self.num_kept = self.num_ended = 0  # sequences handed over / kept after a refusal / ended
        self._credits_task: asyncio.Task | None = None

    def notice(self, deadline: float, reason: str) -> None:
        """A preemption notice: take no more work and move every sequence (see module docstring)."""
        first = not self.deadline
        self.deadline = min(self.deadline, deadline) if self.deadline else deadline
        self.reason, self.host.draining = reason, True
        self.request_all()
        if first:
            log.warning("preemption notice (%s): deadline in %.0f s; moving %d sequences", reason,
                        deadline - time.time(), len(self.host.live))
            self._credits_task = asyncio.get_running_loop().create_task(self.host.publish_credits())  # kept referenced

    def request_all(self) -> None:
        """Move every sequence held here at the next step boundary."""
        self.wanted, self.next_try = True, 0.0
        self.host.wake()

    async def evacuate(self, t_end: float) -> int:
        """Drain: when another live worker of the version exists, move the sequences held here and wait
        (until ``t_end``, monotonic s) for the hand-overs. Returns how many moved."""
        if not self.host.live or self.peers is None or not await self._has_peer():  # unknown peers: let them finish
            return 0
        before = self.num_out
        self.request_all()
        while (self.wanted or self.pending) and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        return self.num_out - before

    async def _has_peer(self) -> bool:
        """Whether another live worker of the version exists (unknown or unanswered: True, let the scheduler say)."""
        if self.peers is None:
            return True
        try:
            async with asyncio.timeout(1.0):
                return await self.peers() > 0
        except Exception as exc:  # etcd away: try, the scheduler refuses when nobody can take it
            log.warning("peer look-up failed (%s); trying the hand-over anyway", exc)
            return True

    async def between_steps(self) -> None:
        """Step-loop hook: end what is still here at the notice deadline; start due hand-overs."""
        now = time.time()
        if self.deadline and now >= self.deadline:
            return self._end_remaining()
        if not self.wanted or now < self.next_try:
            return
        if not await self._has_peer():
            self.wanted = False
            self._retry_later(now)
            return
        self.wanted = False  # only now: ``evacuate`` waits while wanted or pending, so never in between
        for rid, lv in list(self.host.live.items()):
            if not lv.aborted and not lv.abort_pending and rid not in self.pending:  # a cancelled one ends here
                self._start_handoff(rid, lv, now)

    def _retry_later(self, now: float) -> None:
        if self.deadline:  # only a notice retries; a drain that could not move a sequence lets it finish
            self.wanted, self.next_try = True, now + self.cfg.retry_s

    def _start_handoff(self, rid: str, lv: Live, now: float) -> None:
        if lv.migrations >= MAX_MIGRATIONS:
            return
        detach = getattr(self.host.engine, "detach_request", None)
        got = detach(rid) if detach is not None else None
        if got is None:  # not in the engine (a test fault holds it): finishes here
            return
        output_ids, rng = got
        req = replace(lv.req, resume=lv.resume_state(self.host.worker_id, output_ids, rng, now).to_json())
        del self.host.live[rid]
        self.pending[rid] = asyncio.create_task(self._handoff(lv, req))

    async def _handoff(self, lv, req: GenerateRequest) -> None:
        """Submit the migrated sequence; keep it here when the scheduler does not place it elsewhere."""
        rid = req.request_id
        try:
            try:
                m = await self.host.bus.request(subjects.sched_migrate(req.name, req.version), req.encode(),
                                               self.cfg.handoff_timeout_s)
                ans = HopAck.decode(m.data)
                ok, why = ans.accepted, ans.code or "refused"
            except (BusError, ValueError, AttributeError) as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                self.num_out += 1
                log.info("handed %s over (%d tokens generated)", rid, len(req.resume["output_ids"]))
                return
            log.warning("hand-over of %s not taken (%s): it goes on here", rid, why)
            self._keep(lv, req)
        finally:
            self.pending.pop(rid, None)

    def _keep(self, lv, req: GenerateRequest) -> None:
        """Put a sequence whose hand-over failed back into this engine (resumed the same way)."""
        self.num_kept += 1
        self.host.requeue(lv, req)
        self._retry_later(time.time())
        self.host.wake()

    def _end_remaining(self) -> None:
        """Notice deadline: end every sequence still here with a retryable 503 (the machine is going away)."""
        detach = getattr(self.host.engine, "detach_request", None)
        for rid, lv in list(self.host.live.items()):
            if detach is not None:
                detach(rid)
            lv.aborted = lv.aborted or "preempted"
            self.num_ended += 1
            self.host.outbox.finish(lv, ServeError(
                 503, f"the worker was preempted ({self.reason}) before the request finished; retry",
                 type="unavailable", code="worker_preempted", retryable=True, retry_after=1.0).to_wire(), aborted=True)

    def on_resumed_chunk(self, lv) -> None:
        """First chunk of a sequence resumed here: record its hand-over gap (ms, previous worker's clock)."""
        gap = (time.time() - lv.handoff) * 1e3
        lv.handoff = 0.0
        self.gaps_ms.append(gap)
        log.info("resumed %s at chunk %d: hand-over gap %.0f ms", lv.req.request_id, lv.seq - 1, gap)


async def watch_notice(reg, worker_id: str, migrator: Migrator) -> None:
    """Watch ``preemption_notice_key(worker_id)`` (existing value first) and hand each put to
    ``migrator.notice``; a malformed record is logged and ignored. Runs until cancelled."""
    from control.state.names import preemption_notice_key

    key, started = preemption_notice_key(worker_id), time.time()
    async for event, k, value in reg.watch_prefix(key, include_existing=True):
        if event != "put" or k != key:  # the prefix also matches longer worker ids
            continue
        try:
            deadline, reason = parse_notice(value)
        except ValueError as exc:
            log.warning("ignoring preemption notice %s: %s", value, exc)
            continue
        if deadline < started:  # left over from an earlier process under this worker id
            log.info("ignoring a preemption notice whose deadline passed before this worker started")
            continue
        migrator.notice(deadline, reason)
