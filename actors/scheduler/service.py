"""Scheduler service for one model version: thin shell around ``actors.scheduler.policy``.

Inbound: submits (request-reply from validators; the ack says accepted or why not), worker credits,
worker lease events (etcd), first-token events, completion records, cancels. Outbound: dispatches
(request-reply to one worker) and final error chunks for requests it must end (queue full, deadline,
cancel while queued, worker lost after streaming).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, replace

import orjson

from actors.aio import wait_event
from actors.recent import RecentIds
from actors.scheduler.load import SchedulerLoad
from actors.scheduler.fair_queue import (ADMITTED, DEADLINE_UNMEETABLE, QUEUE_FULL_TENANT, FairQueue,
                                         FairQueueConfig, service_tokens)
from actors.scheduler.policy import ThroughputMeter, WorkerTable
from actors.scheduler.sharing import FairShare, FairShareConfig
from actors.scheduler.vtc import (OutputLengthModel, ServiceLedger, ServiceTimeCalibration, cannot_finish,
                                  predict_service_s, slot_wait_s)
from actors.cache_salt import cache_salt, cache_scope
from actors.scheduler.prefix_affinity import PrefixIndex, block_hashes
from actors.scheduler import resume
from bus.errors import ServeError
from bus import subjects, tracing
from bus.base import Bus, BusError, Msg
from bus.journal import Journal, MemoryJournal
from bus.messages import (Cancel, Chunk, CompletionRecord, Credits, Dispatch, DispatchAck, GenerateRequest, HopAck)

log = logging.getLogger(__name__)

DIRECT_WAIT_S = 0.05  # a submit taken without a journal entry is journaled once it has waited this long (s)


@dataclass
class SchedulerConfig:
    """Limits of one scheduler. ValueError on bad values."""

    name: str
    version: str
    scheduler_id: str = "sched"
    max_queue_len: int = 1024  # queued requests, all tenants, before 503
    max_queue_per_tenant: int = 256  # queued requests of one tenant before 429
    fcfs: bool = False  # first-come-first-served instead of weighted fair share (benchmarks)
    dispatch_timeout_s: float = 2.0  # wait for a worker's dispatch ack
    retry_after_s: float = 1.0  # Retry-After on 503 (s)
    max_attempts: int = 3  # dispatch attempts per request (worker losses before the first token)
    credit_stale_s: float = 2.0  # credits older than this are not trusted
    headroom_fraction: float = 0.125  # share of all slots one tenant may not take (kept for newcomers)
    routing: str = "affinity"  # "affinity" (prefix cache, then least loaded) | "least_loaded" | "random"
    tenant_active_s: float = 60.0  # a tenant that submitted within this window counts as active (s)
    drain_s: float = 6.0  # on stop: keep dispatching the queue to the (still running) workers this long (s)
    preemption: bool = True  # a tenant below its fair slots may displace an over-share tenant's request
    urgent: bool = True  # mark dispatches of under-share tenants / interactive-over-batch urgent (docs/decisions/0021)
    direct_dispatch: bool = True  # a submit a free slot awaits is dispatched before it is journaled (decision 0054)

    def __post_init__(self) -> None:
        subjects.sched_submit(self.name, self.version)
        if self.routing not in ("affinity", "least_loaded", "random"):
            raise ValueError(f"routing must be affinity, least_loaded or random, not {self.routing!r}")
        if self.max_queue_len < 1 or self.dispatch_timeout_s <= 0 or self.max_attempts < 1:
            raise ValueError("max_queue_len, dispatch_timeout_s and max_attempts must be positive")
        if self.drain_s < 0:
            raise ValueError("drain_s must be >= 0")


def cost_of(req: GenerateRequest, lengths: OutputLengthModel | None = None) -> float:
    """Estimated service of a request in the fairness currency (``fair_queue.service_tokens``): its prompt
    plus the completion tokens ``lengths`` expects (``max_tokens`` without a model); the fair queue charges
    it at dispatch and corrects it with the tokens actually served at completion."""
    out = lengths.expected(req.sampling.max_tokens, req.sampling.ignore_eos) if lengths else req.sampling.max_tokens
    return service_tokens(len(req.prompt_token_ids), out)


class SchedulerService:
    """Runs the fair-share policy for one model version over a Bus (its fair-share state and decisions:
    ``self.fair``, actors/scheduler/sharing.py)."""

    def __init__(self, bus: Bus, config: SchedulerConfig, journal: Journal | None = None) -> None:
        self.bus, self.cfg = bus, config
        self.journal: Journal = journal or MemoryJournal()  # queued requests, for failover recovery
        self.queue: FairQueue[GenerateRequest] = FairQueue(FairQueueConfig(
            config.max_queue_len, config.max_queue_per_tenant, config.fcfs))
        self.weights: dict[str, float] = {}  # tenant -> fair-share weight (tenant records; default 1)
        self.cache_groups: dict[str, str] = {}  # tenant -> prefix-cache sharing group (tenant records; absent: none)
        self.meter = ThroughputMeter(window_s=10.0, started=time.monotonic())  # weighted service tokens/s
        self.ledger = ServiceLedger()  # tokens served per tenant (workers' heartbeats): metrics and shares
        self.lengths = OutputLengthModel()  # expected completion tokens, from natural ends
        self._charged: dict[str, float] = {}  # request id -> cost charged to its tenant at push (tokens)
        self.calibration = ServiceTimeCalibration()  # actual / predicted service time of finished requests
        self._eta: dict[str, tuple[float, float]] = {}  # dispatched request id -> (dispatch epoch s, predicted s)
        self.prefixes = PrefixIndex()  # which worker holds which prompt prefix (affinity routing)
        self._rng = random.Random(0)
        self.table = WorkerTable(config.credit_stale_s)
        self.requests: dict[str, GenerateRequest] = {}  # dispatched, not done
        self._traces = tracing.ContextStore()  # trace context of each submit, parent of its queue span
        self._early_cancels = RecentIds()  # ids cancelled before their submit arrived
        self._taken = RecentIds(ttl_s=60.0)  # request id -> its validate_out mark, for a minute after its submit
        # queued without a journal entry, its submit not acknowledged yet (direct dispatch, decision 0054):
        # request id -> (the submit to acknowledge, the request, time.monotonic() when taken)
        self._unjournaled: dict[str, tuple[Msg, GenerateRequest, float]] = {}
        self._journaler: asyncio.Task | None = None  # the running _journal_waiting, if any
        self._stopping = False  # stop() began: nothing more is journaled for an acknowledgement
        self._standing_down = False  # stop(fail_queued=False): nothing more is dispatched (the successor replays)
        self._kick = asyncio.Event()
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self.num_dispatched = 0
        self.num_preemptions = 0  # dispatches that displaced (preempted) another tenant's running request
        self.fair = FairShare(FairShareConfig(f"{config.name}@{config.version}", config.fcfs, config.preemption,
                                              config.urgent, config.tenant_active_s, config.headroom_fraction), self)
        self.load = SchedulerLoad(self)  # load report + scale-from-zero hold (actors/scheduler/load.py)

    async def start(self) -> None:
        """Subscribe to the version's subjects and start the dispatch loop."""
        n, v = self.cfg.name, self.cfg.version
        self._subs += [
            await self.bus.subscribe(subjects.sched_submit(n, v), self._on_submit, queue=subjects.SCHEDULERS_QUEUE),
            await self.bus.subscribe(subjects.sched_migrate(n, v), self._on_migrate, queue=subjects.SCHEDULERS_QUEUE),
            await self.bus.subscribe(subjects.credits_of_version(n, v), self._on_credits),
            await self.bus.subscribe(subjects.sched_events(n, v), self._on_event),
            await self.bus.subscribe(subjects.done(n, v), self._on_done),
            await self.bus.subscribe(subjects.cancel_all(), self._on_cancel)]
        self._tasks.append(asyncio.create_task(self._dispatch_loop()))
        await self.load.start()

    async def stop(self, fail_queued: bool = True) -> None:
        """Stop taking submits and stop loops (drain). With ``fail_queued`` (SIGTERM: version retired or
        stack stopping) the queue keeps being dispatched to the workers for up to ``drain_s`` seconds
        (the supervisor stops workers after schedulers), and what is still queued then ends with a
        retryable 503. With ``fail_queued=False`` (lease lost: another replica takes over) the queue stays
        in the journal for it."""
        self._stopping, self._standing_down = True, not fail_queued
        if self._subs:
            await self._subs[0].unsubscribe()  # the submit subscription: nothing new from here on
        if not fail_queued:  # standing down: a submit never acknowledged goes back to its validator, who
            for rid in list(self._unjournaled):  # retries it to the new active scheduler
                await self._hand_back(rid)
        if fail_queued:
            await self._drain_queue(self.cfg.drain_s)
        for sub in self._subs[1:]:
            await sub.unsubscribe()
        if fail_queued:
            await self.fail_queued("the scheduler stopped (version retired or stack stopping) before the request "
                                   "was dispatched; retry", "unavailable")
        await self.journal.flush(timeout=2.0)  # removals still unwritten would replay on a standby (decision 0054)
        self.journal.close()  # no purge from here on: the stream is the next active scheduler's
        await self.load.stop()
        if self._journaler is not None:
            self._tasks.append(self._journaler)
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=5.0)
            for t in stuck:
                log.warning("scheduler task did not stop within 5 s of cancel: %s", t.get_stack())

    async def _drain_queue(self, budget_s: float) -> None:
        """Wait (at most ``budget_s``) until the dispatch loop has emptied the queue."""
        t_end = time.monotonic() + budget_s
        while (len(self.queue) and time.monotonic() < t_end and any(not t.done() for t in self._tasks)
               and any(w.leased for w in self.table.workers.values())):
            self._kick.set()
            await asyncio.sleep(0.05)

    # ---- events ------------------------------------------------------------------------------
    def on_worker_lease(self, worker_id: str, present: bool, incarnation: str = "") -> list[GenerateRequest]:
        """Lease put/delete from etcd. Returns requests to re-dispatch; fails the ones already streaming.

        A deleted lease whose worker still heartbeats (draining after SIGTERM, or a lease that expired
        during an etcd outage) only stops new dispatches; its requests finish there, and are handled as
        lost only if its heartbeats stop too (:meth:`reap_lost_workers`). A put from a new ``incarnation``
        of the worker id (restarted) loses what the old process held."""
        lost = self.table.on_lease(worker_id, present, time.monotonic(), incarnation)
        if not present:
            self.prefixes.forget_worker(worker_id)
            if worker_id in self.table.workers:
                log.info("worker %s unleased but still heartbeating (draining or etcd outage): no new "
                         "dispatches, its %d requests finish there", worker_id,
                         len(self.table.workers[worker_id].inflight))
        redo = self._handle_lost(worker_id, lost)
        if redo or present:
            self._kick.set()
        return redo

    def reap_lost_workers(self) -> list[GenerateRequest]:
        """Handle unleased workers whose heartbeats stopped as lost (see :meth:`on_worker_lease`)."""
        redo = []
        for wid, lost in self.table.reap(time.monotonic()).items():
            log.warning("worker %s stopped heartbeating without a lease: %d requests lost", wid, len(lost))
            redo += self._handle_lost(wid, lost)
        if redo:
            self._kick.set()
        return redo

    def _handle_lost(self, worker_id: str, lost: dict[str, bool]) -> list[GenerateRequest]:
        """Re-queue (front) the lost requests that never streamed a token and have attempts left; end
        the others with a retryable in-band 503 ``worker_lost``. Returns the re-queued ones."""
        redo = []
        for rid, started in lost.items():
            self.fair.ended(rid)
            self._eta.pop(rid, None)
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            if started or req.attempt + 1 >= self.cfg.max_attempts:
                asyncio.create_task(self._fail(req, 503, f"worker {worker_id} was lost while serving the request",
                                               "worker_lost"))
            else:
                redo.append(replace(req, attempt=req.attempt + 1))
        for req in reversed(redo):
            self._push(req, front=True)  # not re-journaled: re-dispatched at once (failover in between: see 0010)
        if lost:
            log.warning("worker %s lost: %d requests re-queued (no token yet), %d ended worker_lost", worker_id,
                        len(redo), len(lost) - len(redo))
        return redo

    async def _on_migrate(self, msg: Msg) -> None:
        """A worker hands over a running sequence: placed first, on another worker (resume.py)."""
        try:
            req = GenerateRequest.decode(msg.data)
            if req.resume is None:
                raise ValueError("a migrated request must carry resume")
        except ValueError as exc:
            return await self.ack(msg, False, ServeError(400, str(exc), param="resume").to_wire())
        resume.start(self, msg, req)

    async def _on_submit(self, msg: Msg) -> None:
        try:
            req = GenerateRequest.decode(msg.data)
        except ValueError as exc:
            return await self.ack(msg, False, ServeError(400, str(exc)).to_wire())
        if req.resume is not None:  # only workers hand over sequences, on their own subject
            return await self.ack(msg, False, ServeError(400, "resume is accepted only on the migrate subject",
                                                           param="resume").to_wire())
        if self._known(req):  # a validator's retry after an ack it did not hear: taken once
            if (pending := self._unjournaled.get(req.request_id)) is not None:  # its ack is still to come
                self._unjournaled[req.request_id] = (msg, *pending[1:])
                return
            return await self.ack(msg, True)
        if self._early_cancels.pop(req.request_id) is not None:  # cancelled on its way here: never queue it
            await self.ack(msg, True)
            return await self._fail(req, 499, "request cancelled before it was queued", "cancelled",
                                    retryable=False)
        if (cold := self.load.on_submit(req)) is not None:  # no worker, and no cold start fits its deadline
            return await self.ack(msg, False, cold)
        cost, rate, weight = cost_of(req, self.lengths), self.meter.tokens_per_s(time.monotonic()), \
            self.weights.get(req.tenant, 1.0)
        verdict = self.queue.can_admit(req.tenant, req.priority, cost, req.deadline, time.time(), rate, weight,
                                       self._slot_wait_s() + self.own_service_s(req))
        if verdict != ADMITTED:
            err = self._refusal(verdict)
            if verdict == DEADLINE_UNMEETABLE:  # hints that let the gateway refuse the next ones (gateway/shed.py)
                err.update(queue_clear_at=time.time() + self.queue.wait_s(req.priority, req.tenant, weight, cost, rate),
                           decode_step_s=self.table.speed(time.monotonic())[0] / 1e3)
            return await self.ack(msg, False, err)
        req = replace(req, marks={**req.marks, "sched_in": time.time()})
        direct = self.cfg.direct_dispatch and len(self.queue) < self._free_slots()  # a slot awaits it: dispatched at once
        if not direct:
            try:
                await self.journal.append(req)
            except Exception as exc:  # no durable record: refuse rather than accept what a failover would lose
                log.warning("journal append failed: %s", exc)
                return await self.ack(msg, False, self._journal_refusal())
        self._push(req)
        self._taken.add(req.request_id, req.marks.get("validate_out"))
        self._traces.put(req.request_id, tracing.current())  # the validator's span (bus hook); None when off
        self.fair.submitted(req.tenant)
        if direct:  # acknowledged when dispatched, ended, or journaled after DIRECT_WAIT_S (_journal_waiting)
            self._unjournaled[req.request_id] = (msg, req, time.monotonic())
            # bounded whatever the dispatch loop does (it may be waiting DISPATCH_TIMEOUT on a dead worker)
            asyncio.get_running_loop().call_later(DIRECT_WAIT_S, self._journal_soon, DIRECT_WAIT_S)
        else:
            await self.ack(msg, True)
        self._kick.set()

    def _journal_refusal(self) -> dict:
        """The retryable 503 ``journal_unavailable`` of a submit the journal could not record (wire dict)."""
        return ServeError(503, "the scheduler cannot persist requests right now", type="unavailable",
                          code="journal_unavailable", retryable=True, retry_after=self.cfg.retry_after_s).to_wire()

    async def _settle(self, request_id: str) -> None:
        """Acknowledge the submit of a request taken without a journal entry, now dispatched or ended."""
        if (pending := self._unjournaled.pop(request_id, None)) is not None:
            try:
                await self.ack(pending[0], True)
            except BusError as exc:  # the validator times out and retries: _known acknowledges the retry
                log.warning("could not acknowledge the submit of %s: %s", request_id, exc)

    def _journal_soon(self, older_than_s: float) -> None:
        """Start :meth:`_journal_waiting` in the background unless it runs (the dispatch loop never waits for
        the journal: a JetStream stall must not hold dispatches)."""
        if self._unjournaled and not self._stopping and (self._journaler is None or self._journaler.done()):
            self._journaler = asyncio.create_task(self._journal_waiting(older_than_s))

    async def _journal_waiting(self, older_than_s: float) -> None:
        """Journal, then acknowledge, each request taken without a journal entry that still waits — queued, or
        its dispatch not acknowledged by the worker yet — ``older_than_s`` after it was taken, until none is
        left (a pass may find ones that aged meanwhile); one the journal refuses while queued is taken back
        (:meth:`_hand_back`): the validator retries."""
        tried: set[str] = set()  # one attempt each per call (a refused one in dispatch flight stays pending)
        while not self._stopping:
            now, found = time.monotonic(), False
            for rid, (_, req, since) in list(self._unjournaled.items()):
                if self._stopping or rid in tried or now - since < older_than_s or not self._waiting(rid):
                    continue
                found = True
                tried.add(rid)
                try:
                    await self.journal.append(req)
                except Exception as exc:
                    log.warning("journal append failed: %s", exc)
                    await self._hand_back(rid)
                    continue
                if self._waiting(rid):  # else dispatched or ended meanwhile: acknowledged there (after its chunk)
                    await self._settle(rid)
            if not found:
                return

    def _waiting(self, rid: str) -> bool:
        """Queued, or dispatched with the worker's acknowledgement still to come (not ended)."""
        return self.queue.contains(rid) or (rid in self.requests and rid in self._unjournaled)

    async def _hand_back(self, rid: str) -> None:
        """Take back a queued submit that was never acknowledged: out of the queue and forgotten (so the
        validator's retry is a new submit), refused with the retryable ``journal_unavailable``."""
        if rid not in self._unjournaled or self.queue.remove(rid) is None:  # dispatched or ended: acknowledged
            return
        pending = self._unjournaled.pop(rid)
        self._taken.pop(rid)
        self._charged.pop(rid, None)
        self._traces.pop(rid)
        await self.journal.remove(rid)  # an append still in flight (stop() meanwhile) is removed once it lands
        try:
            await self.ack(pending[0], False, self._journal_refusal())
        except BusError as exc:  # the validator times out and retries
            log.warning("could not refuse the submit of %s: %s", rid, exc)

    def _known(self, req: GenerateRequest) -> bool:
        """True if this very submit was taken within the last minute: same request id and same validation
        (its ``validate_out`` mark). A validator retries a submit whose ack it did not hear; a client that
        sends a request again under the same id (an Idempotency-Key of the Responses API maps to one id) is
        validated again, so it is a new submit and is queued."""
        mark = req.marks.get("validate_out")
        return mark is not None and self._taken.get(req.request_id) == mark

    async def recover(self) -> int:
        """Re-queue what the journal holds (a failed-over predecessor's queue). Returns how many."""
        n = 0
        for req in await self.journal.replay():
            rid = req.request_id
            if self.queue.contains(rid):  # taken again from its validator's retry (this term began before replay)
                await self._settle(rid)  # durable now: a pending direct submit may be acknowledged
                continue
            if rid in self.requests or self._taken.get(rid) is not None:  # dispatched or ended here already
                await self.journal.remove(rid)  # the predecessor's entry: never replayed again
                continue
            if req.deadline and req.deadline < time.time():
                await self._fail(req, 503, "the request's deadline passed during a scheduler failover",
                                 "deadline_exceeded")
                continue
            self._push(req)
            self._taken.add(rid, req.marks.get("validate_out"))  # a validator's retry of it is taken once
            n += 1
        self._kick.set()
        return n

    def _push(self, req: GenerateRequest, front: bool = False) -> None:
        cost = self._charged.setdefault(req.request_id, cost_of(req, self.lengths))
        self.queue.push(req.request_id, req.tenant, self.weights.get(req.tenant, 1.0), req.priority,
                        cost, req.deadline, req, front=front)

    def own_service_s(self, req: GenerateRequest, calibrated: bool = True) -> float:
        """Predicted seconds ``req`` spends on a worker (prefill + decode at the workers' measured speed),
        plus the measured margin of actual over predicted unless ``calibrated`` is False (or nothing is
        predicted: no measured speed yet)."""
        step_ms, prefill_tps = self.table.speed(time.monotonic())
        out = self.lengths.expected(req.sampling.max_tokens, req.sampling.ignore_eos)
        raw = predict_service_s(len(req.prompt_token_ids), out, step_ms, prefill_tps)
        return raw + self.calibration.margin_s if calibrated and raw > 0 else raw

    def _free_slots(self) -> int:
        """Free slots over the leased workers, by their credits less the dispatches since."""
        return sum(w.free_slots for w in self.table.workers.values() if w.leased)

    def _slot_wait_s(self) -> float:
        """Predicted seconds until a slot frees when every worker's slots are taken (0 with a free one)."""
        free = self._free_slots()
        if free > 0:  # slot_wait_s is 0 then: skip the list over every running request (decision 0029)
            return 0.0
        now, margin = time.time(), self.calibration.margin_s
        return slot_wait_s(now, [t + raw + margin for t, raw in self._eta.values()], free)

    def _refusal(self, verdict: str) -> dict:
        """Error payload for an admission refusal (429 tenant queue full, 503 otherwise)."""
        if verdict == QUEUE_FULL_TENANT:
            return ServeError(429, "too many queued requests for this tenant; retry later", type="rate_limit",
                               code="tenant_queue_full", retryable=True, retry_after=self.cfg.retry_after_s).to_wire()
        if verdict == DEADLINE_UNMEETABLE:
            return ServeError(503, "the request cannot finish before its deadline at the current load",
                               type="overloaded", code="deadline_unmeetable", retryable=True,
                               retry_after=self.cfg.retry_after_s).to_wire()
        return ServeError(503, "the model's queue is full; retry later", type="overloaded", code="queue_full",
                           retryable=True, retry_after=self.cfg.retry_after_s).to_wire()

    async def ack(self, msg: Msg, ok: bool, error: dict | None = None) -> None:
        """Answer a submit (or a hand-over) on ``msg`` with a :class:`HopAck` (``error``: the wire error dict)."""
        if msg.reply:
            await msg.respond(HopAck(ok, error).encode())

    async def _on_credits(self, msg: Msg) -> None:
        try:
            c = Credits.decode(msg.data)
        except ValueError:
            return
        now = time.monotonic()
        self.table.on_credits(c.worker_id, c.free_blocks, c.free_slots, c.block_size, c.draining, now,
                              c.total_blocks, c.total_slots, c.step_ms, c.prefill_tokens_per_s, c.ts)
        if c.worker_id in self.table.workers:
            self.table.workers[c.worker_id].sleeping = c.sleeping
            self.ledger.add_heartbeat(now, c.served)
        if c.worker_id in self.table.workers:  # victims that run again may be chosen again
            self.fair.running_again(self.table.workers[c.worker_id].inflight, c.num_waiting, c.paused)
        if c.free_slots > 0:
            self._kick.set()

    async def _on_event(self, msg: Msg) -> None:
        ev = orjson.loads(msg.data)
        if ev.get("event") == "first_token":
            self.table.on_first_token(ev.get("request_id", ""))

    async def _on_done(self, msg: Msg) -> None:
        try:
            rec = CompletionRecord.decode(msg.data)
        except ValueError:
            return
        self.table.on_done(rec.request_id, rec.ts)
        if rec.ts:
            self._kick.set()  # a slot may be free now
        self.fair.ended(rec.request_id)
        self._traces.pop(rec.request_id)
        req = self.requests.pop(rec.request_id, None)
        served = service_tokens(rec.prompt_tokens, rec.completion_tokens)
        self.meter.add(time.monotonic(), served)
        if rec.status == "ok":
            self.lengths.observe(rec.completion_tokens, rec.finish_reason)
        charged = self._charged.pop(rec.request_id, None)
        eta = self._eta.pop(rec.request_id, None)
        if eta is not None and rec.ts and (rec.status == "ok" or rec.finish_reason == "abort"):
            self.calibration.observe(eta[1], rec.ts - eta[0])  # an aborted one (deadline, client gone): a lower bound
        if len(self._charged) > 10_000:  # ended without a completion record reaching us (lost publish): forget
            self._charged = {r: c for r, c in self._charged.items() if r in self.requests or self.queue.contains(r)}
            self._eta = {r: e for r, e in self._eta.items() if r in self.requests}
        if req is not None and charged is not None:
            self.queue.correct(req.tenant, req.priority, charged, served)

    async def _on_cancel(self, msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        try:
            tenant = Cancel.decode(msg.data).tenant
        except ValueError:
            tenant = ""
        held = self.requests.get(rid)
        owner = held.tenant if held is not None else self.queue.tenant_of(rid)
        if tenant and owner is not None and owner != tenant:
            log.warning("ignoring cancel of %s from tenant %s: not its tenant", rid, tenant)
            return
        req = self.queue.remove(rid)
        if req is not None:
            await self._fail(req, 499, "request cancelled while queued", "cancelled", retryable=False)
        elif rid not in self.requests:  # not here yet (a validator may be submitting it right now): remember
            self._early_cancels.add(rid)

    # ---- dispatch ----------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            self.reap_lost_workers()
            for req in self.queue.pop_expired(time.time()):
                await self._fail(req, 503, "the request's deadline passed while it was queued", "deadline_exceeded")
            if not await self._dispatch_head():
                self._journal_soon(0.0)  # nothing more can be dispatched now: what waits is journaled
                self._kick.clear()
                await wait_event(self._kick, 0.1)
            elif self._unjournaled:
                self._journal_soon(DIRECT_WAIT_S)

    async def _dispatch_head(self) -> bool:
        """Dispatch the head request if a worker can take it; False when nothing was done."""
        if self._standing_down:  # the journal is the next active scheduler's to dispatch from
            return False
        skip = self.fair.tenants_at_cap()
        head = self.queue.peek_item(skip)
        if head is None:
            return False
        if cannot_finish(head.deadline, time.time(), self.own_service_s(head)):  # it would be aborted mid-way
            await self._fail(self.queue.pop(skip).item, 503, "the request can no longer finish before its "
                             "deadline at the current load; retry", "deadline_unmeetable")
            return True
        num_prompt = len(head.prompt_token_ids)
        worker, hashes = self._route(head)
        victim = ""
        if worker is None:
            if self.table.fits_nowhere(num_prompt, time.monotonic()):
                await self._refuse_oversized(self.queue.pop(skip).item)
                return True
            worker, victim = self.fair.displace(head)
            if worker is None:
                return False
        req = self.queue.pop(skip).item
        urgent = bool(victim) or self.fair.urgent(req, worker.worker_id)
        worker.take(req.request_id, num_prompt)
        if not await self.dispatch(worker.worker_id, req, victim, urgent):
            self.table.on_refused(worker.worker_id, req.request_id)
            self._push(req, front=True)
            if victim:  # refused: the victim is not running there (paused or not admitted yet); the next
                self.fair.preempted(victim)  # pass tries another at once (each refusal excludes one: no spin)
            return True
        self.prefixes.record(hashes, worker.worker_id)
        if victim:
            self.num_preemptions += 1
            self.fair.preempted(victim)
            log.info("dispatched %s (tenant %s) preempting %s", req.request_id, req.tenant, victim)
        return True

    def service_rows(self) -> list[tuple[int, dict]]:
        """(tokens, labels) per tenant and kind for ``actorserve_tenant_service_tokens_total`` (``FairShare``)."""
        return self.fair.service_rows()

    def share_rows(self) -> tuple[list[tuple[float, dict]], list[tuple[float, dict]]]:
        """(service share rows, weight share rows) per tenant (``FairShare.share_rows``)."""
        return self.fair.share_rows()

    def run_alongside(self, coro) -> None:
        """Run ``coro`` as a task of this service: cancelled and awaited by :meth:`stop`."""
        self._tasks.append(asyncio.create_task(coro))

    def cache_salt(self, req: GenerateRequest) -> bytes:
        """The request's prefix-cache salt, derived here from its version, tenant (or the tenant's cache-sharing
        group) and adapter, never from the request body (actors/cache_salt.py)."""
        return cache_salt(req.model_ref, cache_scope(req.tenant, self.cache_groups), req.adapter)

    def _route(self, req: GenerateRequest):
        """(worker or None, prompt block hashes) by the configured routing policy."""
        now, n = time.monotonic(), len(req.prompt_token_ids)
        if self.cfg.routing == "random":
            return self.table.pick_random(n, now, self._rng), []
        if self.cfg.routing == "least_loaded":
            return self.table.pick(n, now), []
        bs = next((w.block_size for w in self.table.workers.values()), 16)
        hashes = block_hashes(req.prompt_token_ids, bs, salt=self.cache_salt(req))
        return self.table.pick(n, now, lambda w: self.prefixes.matched_blocks(hashes, w.worker_id)), hashes

    async def dispatch(self, worker_id: str, req: GenerateRequest, preempt: str = "", urgent: bool = False) -> bool:
        """Send ``req`` to ``worker_id`` (request-reply, ``dispatch_timeout_s``), displacing ``preempt`` when set,
        its prefill ``urgent``; True when the worker accepted it (then it counts as dispatched, out of the
        journal), False on a refusal or a bus error (not raised)."""
        req = replace(req, marks={**req.marks, "dispatch": time.time()}, cache_salt=self.cache_salt(req).hex(),
                      tenant_weight=self.weights.get(req.tenant, 1.0))
        self.requests[req.request_id] = req
        data = Dispatch(req, self.cfg.scheduler_id, preempt, urgent).encode()
        parent = self._traces.get(req.request_id)  # None: tracing off, or replayed from the journal (no trace)
        headers = None if parent is None else tracing.record_span(
            "queue", req.marks.get("sched_in", req.marks["dispatch"]), req.marks["dispatch"], parent,
            {"actorserve.request_id": req.request_id, "actorserve.tenant": req.tenant,
             "actorserve.priority": req.priority, "actorserve.worker_id": worker_id, "actorserve.attempt": req.attempt})
        try:
            reply = await self.bus.request(subjects.work(worker_id), data, self.cfg.dispatch_timeout_s,
                                           headers=headers)
            ok = DispatchAck.decode(reply.data).accepted
        except (BusError, ValueError) as exc:
            log.warning("dispatch of %s to %s failed: %s", req.request_id, worker_id, exc)
            ok = False
        if ok:
            self.num_dispatched += 1
            if req.request_id in self.requests:  # its completion record may have come before this ack (decision 0029)
                self._eta[req.request_id] = (req.marks["dispatch"], self.own_service_s(req, calibrated=False))
            await self._settle(req.request_id)
            await self.journal.remove(req.request_id)
        else:
            self.requests.pop(req.request_id, None)
        return ok

    async def _refuse_oversized(self, req: GenerateRequest) -> None:
        """400 for a prompt no live worker's KV cache can hold (it would block the queue head)."""
        cap = max(w.total_blocks * w.block_size for w in self.table.workers.values())
        await self._fail(req, 400, f"This model's workers can hold at most {cap - 1} prompt tokens in their KV "
                                   f"cache; your prompt has {len(req.prompt_token_ids)} tokens. Please reduce "
                                   f"the length of the prompt.", "context_length_exceeded", retryable=False)

    async def fail_queued(self, message: str, code: str) -> None:
        """End every queued request with a retryable 503 ``code`` (Retry-After)."""
        while (p := self.queue.pop()) is not None:
            await self._fail(p.item, 503, message, code)

    async def _fail(self, req: GenerateRequest, status: int, message: str, code: str,
                    retryable: bool = True) -> None:
        """End ``req`` with a final error chunk and a completion record (then acknowledge its submit if that
        was still pending: direct dispatch)."""
        await self.journal.remove(req.request_id)
        kind = "unavailable" if status >= 500 else "cancelled" if status == 499 else "invalid_request_error"
        err = ServeError(status, message, type=kind, code=code,
                          retryable=retryable, retry_after=self.cfg.retry_after_s if retryable else None).to_wire()
        chunk = Chunk(req.request_id, 0, final=True, finish_reason="abort", error=err, model=req.model_ref,
                      choice_index=req.choice_index)
        rec = CompletionRecord(req.request_id, req.tenant, req.name, req.version,
                               "cancelled" if status == 499 else "error", "abort", len(req.prompt_token_ids), 0,
                               {}, req.priority, code, "", time.time(), req.choice_index)
        try:
            await self.bus.publish(req.reply, chunk.encode())
            await self.bus.publish(subjects.done(req.name, req.version), rec.encode())
        except BusError as exc:
            log.warning("could not end %s: %s", req.request_id, exc)
        await self._settle(req.request_id)
