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
from actors.scheduler.fair_queue import (ADMITTED, DEADLINE_UNMEETABLE, QUEUE_FULL_TENANT, FairQueue,
                                         FairQueueConfig)
from actors.scheduler.policy import (ThroughputMeter, WorkerTable, fair_slots, preemption_victim, tenant_cap,
                                     weight_share)
from actors.scheduler.prefix_affinity import PrefixIndex, block_hashes
from bus import subjects, tracing
from bus.base import Bus, BusError, Msg
from bus.journal import Journal, MemoryJournal
from bus.messages import (Cancel, Chunk, CompletionRecord, Credits, Dispatch, DispatchAck, GenerateRequest,
                          error_dict)

log = logging.getLogger(__name__)


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

    def __post_init__(self) -> None:
        subjects.sched_submit(self.name, self.version)
        if self.routing not in ("affinity", "least_loaded", "random"):
            raise ValueError(f"routing must be affinity, least_loaded or random, not {self.routing!r}")
        if self.max_queue_len < 1 or self.dispatch_timeout_s <= 0 or self.max_attempts < 1:
            raise ValueError("max_queue_len, dispatch_timeout_s and max_attempts must be positive")
        if self.drain_s < 0:
            raise ValueError("drain_s must be >= 0")


def cost_of(req: GenerateRequest) -> int:
    """Estimated token cost of a request: prompt + max_tokens (corrected by actual usage later)."""
    return len(req.prompt_token_ids) + req.sampling.max_tokens


class SchedulerService:
    """Runs the FCFS policy for one model version over a Bus."""

    def __init__(self, bus: Bus, config: SchedulerConfig, journal: Journal | None = None) -> None:
        self.bus, self.cfg = bus, config
        self.journal: Journal = journal or MemoryJournal()  # queued requests, for failover recovery
        self.queue: FairQueue[GenerateRequest] = FairQueue(FairQueueConfig(
            config.max_queue_len, config.max_queue_per_tenant, config.fcfs))
        self.weights: dict[str, float] = {}  # tenant -> fair-share weight (tenant records; default 1)
        self.meter = ThroughputMeter(window_s=10.0, started=time.monotonic())
        self._seen: dict[str, float] = {}  # tenant -> last submit (monotonic s)
        self.prefixes = PrefixIndex()  # which worker holds which prompt prefix (affinity routing)
        self._rng = random.Random(0)
        self.table = WorkerTable(config.credit_stale_s)
        self.requests: dict[str, GenerateRequest] = {}  # dispatched, not done
        self._traces = tracing.ContextStore()  # trace context of each submit, parent of its queue span
        self._early_cancels = RecentIds()  # ids cancelled before their submit arrived
        self._kick = asyncio.Event()
        self._subs: list = []
        self._tasks: list[asyncio.Task] = []
        self.num_dispatched = 0
        self.num_preemptions = 0  # dispatches that displaced (preempted) another tenant's running request
        self._preempted: set[str] = set()  # requests preempted on their worker and not done yet

    async def start(self) -> None:
        """Subscribe to the version's subjects and start the dispatch loop."""
        n, v = self.cfg.name, self.cfg.version
        self._subs += [
            await self.bus.subscribe(subjects.sched_submit(n, v), self._on_submit, queue=subjects.SCHEDULERS_QUEUE),
            await self.bus.subscribe(subjects.credits_of_version(n, v), self._on_credits),
            await self.bus.subscribe(subjects.sched_events(n, v), self._on_event),
            await self.bus.subscribe(subjects.done(n, v), self._on_done),
            await self.bus.subscribe(subjects.cancel_all(), self._on_cancel)]
        self._tasks.append(asyncio.create_task(self._dispatch_loop()))

    async def stop(self, fail_queued: bool = True) -> None:
        """Stop taking submits and stop loops (drain). With ``fail_queued`` (SIGTERM: version retired or
        stack stopping) the queue keeps being dispatched to the workers for up to ``drain_s`` seconds
        (the supervisor stops workers after schedulers), and what is still queued then ends with a
        retryable 503. With ``fail_queued=False`` (lease lost: another replica takes over) the queue stays
        in the journal for it."""
        if self._subs:
            await self._subs[0].unsubscribe()  # the submit subscription: nothing new from here on
        if fail_queued:
            await self._drain_queue(self.cfg.drain_s)
        for sub in self._subs[1:]:
            await sub.unsubscribe()
        while fail_queued and (p := self.queue.pop()) is not None:
            await self._fail(p.item, 503, "the scheduler stopped (version retired or stack stopping) before "
                             "the request was dispatched; retry", "unavailable")
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
            self._preempted.discard(rid)
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

    async def _on_submit(self, msg: Msg) -> None:
        try:
            req = GenerateRequest.decode(msg.data)
        except ValueError as exc:
            return await self._ack(msg, False, error_dict(400, str(exc)))
        if self._early_cancels.pop(req.request_id) is not None:  # cancelled on its way here: never queue it
            await self._ack(msg, True)
            return await self._fail(req, 499, "request cancelled before it was queued", "cancelled",
                                    retryable=False)
        verdict = self.queue.can_admit(req.tenant, req.priority, cost_of(req), req.deadline, time.time(),
                                       self.meter.tokens_per_s(time.monotonic()), self.weights.get(req.tenant, 1.0))
        if verdict != ADMITTED:
            return await self._ack(msg, False, self._refusal(verdict))
        req = replace(req, marks={**req.marks, "sched_in": time.time()})
        try:
            await self.journal.append(req)
        except Exception as exc:  # no durable record: refuse rather than accept what a failover would lose
            log.warning("journal append failed: %s", exc)
            return await self._ack(msg, False, error_dict(503, "the scheduler cannot persist requests right now",
                                                          type_="unavailable", code="journal_unavailable",
                                                          retryable=True, retry_after=self.cfg.retry_after_s))
        self._push(req)
        self._traces.put(req.request_id, tracing.current())  # the validator's span (bus hook); None when off
        self._seen[req.tenant] = time.monotonic()
        await self._ack(msg, True)
        self._kick.set()

    async def recover(self) -> int:
        """Re-queue what the journal holds (a failed-over predecessor's queue). Returns how many."""
        n = 0
        for req in await self.journal.replay():
            if req.request_id in self.requests or self.queue.contains(req.request_id):
                continue
            if req.deadline and req.deadline < time.time():
                await self._fail(req, 503, "the request's deadline passed during a scheduler failover",
                                 "deadline_exceeded")
                continue
            self._push(req)
            n += 1
        self._kick.set()
        return n

    def _push(self, req: GenerateRequest, front: bool = False) -> None:
        self.queue.push(req.request_id, req.tenant, self.weights.get(req.tenant, 1.0), req.priority,
                        cost_of(req), req.deadline, req, front=front)

    def _refusal(self, verdict: str) -> dict:
        """Error payload for an admission refusal (429 tenant queue full, 503 otherwise)."""
        if verdict == QUEUE_FULL_TENANT:
            return error_dict(429, "too many queued requests for this tenant; retry later", type_="rate_limit",
                              code="tenant_queue_full", retryable=True, retry_after=self.cfg.retry_after_s)
        if verdict == DEADLINE_UNMEETABLE:
            return error_dict(503, "the request cannot finish before its deadline at the current load",
                              type_="overloaded", code="deadline_unmeetable", retryable=True,
                              retry_after=self.cfg.retry_after_s)
        return error_dict(503, "the model's queue is full; retry later", type_="overloaded", code="queue_full",
                          retryable=True, retry_after=self.cfg.retry_after_s)

    async def _ack(self, msg: Msg, ok: bool, error: dict | None = None) -> None:
        if msg.reply:
            await msg.respond(orjson.dumps({"accepted": ok, "error": error}))

    async def _on_credits(self, msg: Msg) -> None:
        try:
            c = Credits.decode(msg.data)
        except ValueError:
            return
        self.table.on_credits(c.worker_id, c.free_blocks, c.free_slots, c.block_size, c.draining, time.monotonic(),
                              c.total_blocks, c.total_slots)
        if c.num_waiting == 0 and c.worker_id in self.table.workers:  # nothing paused there any more
            self._preempted.difference_update(self.table.workers[c.worker_id].inflight)
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
        self.table.on_done(rec.request_id)
        self._preempted.discard(rec.request_id)
        self._traces.pop(rec.request_id)
        req = self.requests.pop(rec.request_id, None)
        self.meter.add(time.monotonic(), rec.prompt_tokens + rec.completion_tokens)
        if req is not None:
            self.queue.correct(req.tenant, req.priority, cost_of(req), rec.prompt_tokens + rec.completion_tokens)

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
                self._kick.clear()
                await wait_event(self._kick, 0.1)

    async def _dispatch_head(self) -> bool:
        """Dispatch the head request if a worker can take it; False when nothing was done."""
        skip = self._tenants_at_cap()
        head = self.queue.peek_item(skip)
        if head is None:
            return False
        num_prompt = len(head.prompt_token_ids)
        worker, hashes = self._route(head)
        victim = ""
        if worker is None:
            if self.table.fits_nowhere(num_prompt, time.monotonic()):
                await self._refuse_oversized(self.queue.pop(skip).item)
                return True
            worker, victim = self._displace(head)
            if worker is None:
                return False
        req = self.queue.pop(skip).item
        worker.take(req.request_id, num_prompt)
        if not await self._send(worker.worker_id, req, victim):
            self.table.on_refused(worker.worker_id, req.request_id)
            self._push(req, front=True)
            if victim:  # refused: the victim is not running there (paused or not admitted yet); the next
                self._preempted.add(victim)  # pass tries another at once (each refusal excludes one: no spin)
            return True
        self.prefixes.record(hashes, worker.worker_id)
        if victim:
            self.num_preemptions += 1
            self._preempted.add(victim)
            log.info("dispatched %s (tenant %s) preempting %s", req.request_id, req.tenant, victim)
        return True

    def _displace(self, head: GenerateRequest):
        """(worker, victim request id) when ``head``'s tenant is below its fair slots and an over-share
        tenant runs a request on a worker that could hold ``head``; (None, "") otherwise."""
        active = self._active_tenants()
        if not self.cfg.preemption or self.cfg.fcfs or head.tenant not in active or len(active) < 2:
            return None, ""
        total, now = self.table.total_slots(), time.monotonic()
        weights = {t: self.weights.get(t, 1.0) for t in active}
        fair = {t: fair_slots(total, weight_share(t, weights)) for t in active}
        where, running = {}, []
        for w in self.table.workers.values():
            if w.can_take_preempting(len(head.prompt_token_ids), now, self.table.stale_after_s):
                for rid in w.inflight:
                    if rid in self.requests and rid not in self._preempted:
                        where[rid] = w
                        # (streamed a token, dispatch time): the victim is the last of its tenant, so the
                        # newest request already decoding; one still prefilling or waiting in the engine
                        # only when none of that tenant's is decoding (the worker refuses a victim that
                        # is not running)
                        running.append((w.inflight[rid], self.requests[rid].marks.get("dispatch", 0.0), rid))
        running.sort()
        victim = preemption_victim(head.tenant, self._held(), fair,
                                   [(rid, self.requests[rid].tenant) for _, _, rid in running])
        return (where[victim], victim) if victim else (None, "")

    def _active_tenants(self) -> list[str]:
        """Tenants that submitted within ``tenant_active_s``."""
        now = time.monotonic()
        return [t for t, ts in self._seen.items() if now - ts <= self.cfg.tenant_active_s]

    def _held(self) -> dict[str, int]:
        """Dispatched, unfinished requests per tenant (preempted ones included: they still hold a place)."""
        held: dict[str, int] = {}
        for r in self.requests.values():
            held[r.tenant] = held.get(r.tenant, 0) + 1
        return held

    def _route(self, req: GenerateRequest):
        """(worker or None, prompt block hashes) by the configured routing policy."""
        now, n = time.monotonic(), len(req.prompt_token_ids)
        if self.cfg.routing == "random":
            return self.table.pick_random(n, now, self._rng), []
        if self.cfg.routing == "least_loaded":
            return self.table.pick(n, now), []
        bs = next((w.block_size for w in self.table.workers.values()), 16)
        hashes = block_hashes(req.prompt_token_ids, bs)
        return self.table.pick(n, now, lambda w: self.prefixes.matched_blocks(hashes, w.worker_id)), hashes

    def _tenants_at_cap(self) -> frozenset[str]:
        """Tenants holding their maximum share of slots (skipped while others wait; fcfs: none)."""
        active = self._active_tenants()
        if self.cfg.fcfs or len(active) < 2:  # one tenant alone may use every slot
            return frozenset()
        total = self.table.total_slots()
        weights = {t: self.weights.get(t, 1.0) for t in active}
        held = self._held()
        return frozenset(t for t, n in held.items()
                         if n >= tenant_cap(total, self.cfg.headroom_fraction, weight_share(t, weights)))

    async def _send(self, worker_id: str, req: GenerateRequest, preempt: str = "") -> bool:
        req = replace(req, marks={**req.marks, "dispatch": time.time()})
        self.requests[req.request_id] = req
        data = Dispatch(req, self.cfg.scheduler_id, preempt).encode()
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

    async def _fail(self, req: GenerateRequest, status: int, message: str, code: str,
                    retryable: bool = True) -> None:
        """End ``req`` with a final error chunk and a completion record."""
        await self.journal.remove(req.request_id)
        kind = "unavailable" if status >= 500 else "cancelled" if status == 499 else "invalid_request_error"
        err = error_dict(status, message, type_=kind, code=code,
                         retryable=retryable, retry_after=self.cfg.retry_after_s if retryable else None)
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
