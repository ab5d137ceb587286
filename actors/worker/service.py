"""Worker service: feeds dispatched requests to the engine, streams its outputs, heartbeats credits.

Thin shell around an engine with the LLMEngine interface (``add_request``, ``abort_request``,
``step``, ``stats``, ``credits``, ``has_unfinished``). The engine is mutated only from the step loop
task: dispatches and cancels are queued and applied between steps, and ``step()`` itself runs on one
dedicated thread so heartbeats and NATS I/O continue while the forward pass computes; a step's outputs
are collected in the worker's outbox (actors/worker/outputs.py) and flushed once per step, while the next
step computes. Hand-overs of running sequences (actors/worker/migration.py) see the service through
``MigrationHost``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from actors.aio import wait_event
from actors.recent import RecentIds
from actors.text import reasoning
from actors.text.tool_calls import make_parser
from actors.worker.engine.step_rates import served_delta
from actors.worker.engine.types import StepOutput
from actors.worker.live import Live, engine_request
from actors.worker.migration import Migrator
from actors.worker.outputs import Outbox, probe_receiver, step_logprobs, timing, usage, worker_stats
from bus.errors import ServeError
from bus import subjects, tracing
from bus.base import Bus, BusError, Msg
from bus.messages import Cancel, Chunk, Credits, Dispatch, DispatchAck, GenerateRequest, WorkerStats

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """Identity and cadence of one worker. ValueError on bad values."""

    worker_id: str
    name: str  # model name
    version: str  # model version
    credits_interval_s: float = 0.25  # ~4 Hz heartbeat (docs/architecture.md)
    stats_interval_s: float = 1.0
    idle_wait_s: float = 0.05  # sleep of the step loop when nothing is scheduled
    probe_interval_s: float = 2.0  # how often live streams check that their receiver still listens (s)
    max_preempted: int = 8  # most requests held beyond the engine's slots (preempted ones waiting to resume)
    counters: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        subjects.work(self.worker_id)  # validates the id as a subject token
        if self.credits_interval_s <= 0 or self.stats_interval_s <= 0:
            raise ValueError("heartbeat intervals must be > 0")


class WorkerService:
    """Runs the engine for one model version on one bus. Use ``async with`` or ``start()/stop()``."""

    def __init__(self, bus: Bus, engine, config: WorkerConfig, faults=None,
                 engine_thread: ThreadPoolExecutor | None = None) -> None:
        self.bus, self.engine, self.cfg = bus, engine, config
        self.faults = faults  # test-only FaultInjector (actors/worker/faults.py), None in production
        self._fault_tasks: set[asyncio.Task] = set()
        # the one record of each request held here (live.py); the engine keeps its own (engine/request_book.py)
        self.live: dict[str, Live] = {}
        self._adds: list[Live] = []  # records to add to the engine before the next step, in arrival order
        self._served_sent: dict[str, list[int]] = {}  # engine's served counters at the previous heartbeat
        self._host_ms = 0.0  # EWMA of the step loop's own time per step, outside engine.step (ms)
        self._early_cancels = RecentIds()  # cancel reasons of requests not (yet) here: a dispatch may follow
        self._wake, self._tasks, self._subs = asyncio.Event(), [], []
        self.draining = False
        self.sleeping = False  # asleep (actors/worker/sleep.py): no work, credits say so, KV cache freed
        self.awake_blocks = 0  # while asleep: the KV blocks it holds awake (credits report them, not the one block)
        self.num_steps = 0  # engine steps run by this service
        self.max_cancel_steps = 0  # most steps between a cancel's arrival and the request's end
        # every chunk, record and event goes out through the outbox, flushed once per step (outputs.py)
        self.outbox = Outbox(bus, config.worker_id, self.live, lambda lv: self.migration.on_resumed_chunk(lv))
        self.migration = Migrator(self)  # preemption notices and drains: running sequences move (migration.py)
        # every step on one thread (torch's OpenMP team belongs to the calling thread); a host shares its one (host.py)
        self._own_thread = engine_thread is None
        self._engine_thread = engine_thread or ThreadPoolExecutor(1, "engine-step")
        self.on_first_token = None  # called once, at this worker's first generated token (load timing)

    # ---- what the migrator and the host see (MigrationHost) ----------------------------------
    @property
    def worker_id(self) -> str:
        """This worker's id."""
        return self.cfg.worker_id

    @property
    def num_finished(self) -> int:
        """Requests ended here (any reason)."""
        return self.outbox.num_finished

    @property
    def num_aborted(self) -> int:
        """Requests ended here by a cancel, a deadline, a drain or a preemption."""
        return self.outbox.num_aborted

    @property
    def num_queued(self) -> int:
        """Requests accepted and not yet added to the engine."""
        return len(self._adds)

    def wake(self) -> None:
        """Run the step loop's next iteration now (it may be waiting for work)."""
        self._wake.set()

    def requeue(self, lv: Live, req: GenerateRequest) -> None:
        """Take back ``lv`` after a failed hand-over, its request now ``req`` (carrying its resume state): it
        is added again at the next step, urgent; a cancel heard while it was away applies."""
        rid = req.request_id
        lv.req, lv.urgent, lv.front = req, True, False
        self.live[rid] = lv
        self._adds.append(lv)
        reason = self._early_cancels.pop(rid)
        if reason is not None:
            lv.request_abort(reason)
        self._wake.set()

    # ---- lifecycle -------------------------------------------------------------------------
    async def run_on_engine_thread(self, fn, *args):
        """``fn(*args)`` on the thread that runs the engine's steps (a warm-up warms that thread's OpenMP team)."""
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    async def start(self) -> None:
        """Subscribe to dispatch and cancel subjects and start the step and heartbeat loops."""
        self._subs += [await self.bus.subscribe(subjects.work(self.cfg.worker_id), self._on_dispatch),
                       await self.bus.subscribe(subjects.cancel_all(), self._on_cancel)]
        for coro in (self._step_loop(), self._credits_loop(), self._stats_loop(), self._probe_loop()):
            self._tasks.append(asyncio.create_task(coro))
        await self.publish_credits()

    async def drain(self, timeout: float = 30.0) -> None:
        """Refuse new work, move running requests to another live worker of the version when one exists
        (migration.py), let the others finish (bounded by ``timeout`` s), abort the rest."""
        self.draining = True
        await self.publish_credits()
        t_end = time.monotonic() + timeout
        await self.migration.evacuate(t_end)
        while self.live and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        for lv in list(self.live.values()):
            lv.request_abort("drain")
        self._wake.set()
        while self.live and time.monotonic() < t_end + 2:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Cancel loops and subscriptions (no drain; call ``drain`` first for a graceful stop); what the
        outbox still holds is flushed (shielded, at most 2 s)."""
        for sub in self._subs:
            await sub.unsubscribe()
        for t in (*self._tasks, *self._fault_tasks):
            t.cancel()
        _, pending = await asyncio.wait(self._tasks, timeout=5.0)
        for t in pending:
            log.warning("task did not stop within 5 s: %s", t.get_stack())
        if len(self.outbox):
            try:
                async with asyncio.timeout(2.0):
                    await asyncio.shield(self.outbox.flush())
            except TimeoutError:
                log.warning("outputs not published within 2 s of stopping")
        if self._own_thread:
            self._engine_thread.shutdown(wait=False)

    async def __aenter__(self) -> "WorkerService":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.shield(self.drain(timeout=10.0))
        await self.stop()

    # ---- inbound -----------------------------------------------------------------------------
    def can_accept(self, req: GenerateRequest) -> bool:
        """True when a slot and enough KV blocks for the prompt are free (credits check)."""
        free_blocks, free_slots = self.engine.credits()
        pending = len(self._adds)
        return not self.draining and not self.sleeping and free_slots - pending > 0 and free_blocks > 0

    def can_preempt(self, victim: str, priority: str = "interactive") -> bool:
        """True when a dispatch of class ``priority`` may displace ``victim`` (fair-share preemption): it
        runs here, is not being cancelled or preempted already, is not ``interactive`` while the newcomer
        is ``batch`` (priority class first, issue 23), and fewer than ``max_num_seqs + max_preempted``
        requests are held (the bound on requests beyond the engine's slots)."""
        lv = self.live.get(victim)
        held = len(self.live) + len(self._adds)
        return (not self.draining and lv is not None and not lv.aborted and not lv.abort_pending and not lv.preempt
                and not (priority == "batch" and lv.req.priority != "batch")
                and self.engine.is_running(victim) and held < self.engine.max_num_seqs + self.cfg.max_preempted)

    async def _on_dispatch(self, msg: Msg) -> None:
        try:
            dispatch = Dispatch.decode(msg.data)
        except ValueError as exc:
            log.warning("bad dispatch: %s", exc)
            if msg.reply:
                await msg.respond(DispatchAck(False, f"bad dispatch: {exc}").encode())
            return
        req = dispatch.request
        displace = (bool(dispatch.preempt) and not self.can_accept(req)
                    and self.can_preempt(dispatch.preempt, req.priority))
        ok = (self.can_accept(req) or displace) and req.request_id not in self.live
        if msg.reply:
            await msg.respond(DispatchAck(ok, "" if ok else "no credit").encode())
        if ok:
            lv = self.live[req.request_id] = Live(req, time.time(), trace=tracing.current(),
                                                  urgent=dispatch.urgent)
            reason = self._early_cancels.pop(req.request_id)
            if reason is not None:  # cancelled while on its way here: end it "cancelled", never run it
                lv.request_abort(reason, self.num_steps)
                self._wake.set()
                return
            if self.faults is not None:  # test-only fault injection: delays or fails it off the engine loop
                t = asyncio.create_task(self.faults.admit(
                    lambda: self.live.get(req.request_id) is lv and not lv.aborted,
                    lambda: (self._adds.append(lv), self._wake.set()), lambda err: self._fail_one(lv, err)))
                self._fault_tasks.add(t)
                t.add_done_callback(self._fault_tasks.discard)
                return
            if displace:
                self.live[dispatch.preempt].preempt = True
                lv.front = True
            self._adds.append(lv)
            self._wake.set()

    async def _fail_one(self, lv: Live, err: dict) -> None:
        """End ``lv`` with ``err`` from outside the step loop (an injected fault) and publish it now."""
        self.outbox.finish(lv, err)
        await self.outbox.flush()

    async def _probe_loop(self) -> None:
        """Abort streams nobody receives any more (their gateway died): see ``probe_receiver``."""
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            now = time.time()  # an abort asked and not applied yet is left alone
            old = [lv for lv in self.live.values() if not lv.aborted and not lv.abort_pending
                   and now - lv.t_in >= self.cfg.probe_interval_s]
            verdicts = await asyncio.gather(*(probe_receiver(self.bus, lv.req.reply, lv.req.request_id)
                                              for lv in old))
            for lv, alive in zip(old, verdicts):
                if not alive and self.live.get(lv.request_id) is lv:
                    log.warning("request %s has no receiver any more; aborting", lv.request_id)
                    lv.request_abort("orphaned")
                    self._wake.set()

    async def _on_cancel(self, msg: Msg) -> None:
        rid = msg.subject.rsplit(".", 1)[-1]
        try:
            cancel = Cancel.decode(msg.data)
            reason, tenant = cancel.reason, cancel.tenant
        except ValueError:
            reason, tenant = "client", ""
        lv = self.live.get(rid)
        if tenant and lv is not None and lv.req.tenant != tenant:
            log.warning("ignoring cancel of %s from tenant %s: not its tenant", rid, tenant)
            return
        if lv is None:  # not here (yet): the scheduler may be dispatching it to us right now
            self._early_cancels.add(rid, reason)
        else:
            lv.request_abort(reason, self.num_steps)
            self._wake.set()

    # ---- step loop ---------------------------------------------------------------------------
    def _apply_pending(self) -> list[tuple[Live, str]]:
        """Apply queued adds/aborts to the engine; returns requests that failed to be added."""
        failed = []
        adds, self._adds = self._adds, []
        for lv in adds:
            if self.live.get(lv.request_id) is not lv:  # ended while queued (e.g. at a notice deadline)
                continue
            req, front = lv.req, lv.front
            lv.front = False
            try:
                lv.tools = make_parser(req.tool_parser, req.parallel_tool_calls, req.tool_calls_forced)
                lv.thinking = reasoning.make_parser(req.reasoning_parser, req.reasoning_state)
                lv.resume(req, self.engine.add_request(engine_request(req, lv.urgent), front=front))
            except ValueError as exc:
                failed.append((lv, str(exc)))
        for rid, lv in list(self.live.items()):  # after the adds: each victim waits behind everything accepted with it
            if lv.preempt:
                lv.preempt = False
                if self.engine.preempt_request(rid):
                    log.info("preempted %s (fair share)", rid)
        self._apply_aborts()
        return failed

    def _apply_aborts(self) -> None:
        """Abort queued cancels in the engine (marking them ``aborted``). Also called right after a step,
        so a request cancelled while that step ran ends "cancelled" even when the step finished it."""
        for rid, lv in list(self.live.items()):
            if lv.abort_pending and lv.take_abort():
                self.engine.abort_request(rid)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for lv in self.live.values():
            if lv.req.deadline and now > lv.req.deadline and not lv.aborted:
                lv.request_abort("deadline")

    async def _step_loop(self) -> None:
        """Apply queued work, run one engine step on the engine thread, repeat. The outputs of step N are
        collected and the outbox flushed once while step N+1 computes (the loop's publishing overlaps the
        forward pass instead of adding to every token's interval; docs/decisions/0030-served-vs-offline.md).
        Ends of requests decided between steps (failed adds, aborts) go out in the same flush."""
        unpublished: list[StepOutput] = []  # outputs of the previous step, not yet collected
        while True:
            t_iter = time.perf_counter()
            self._expire_deadlines()
            for lv, why in self._apply_pending():
                adapter = why.startswith("adapter ")
                self.outbox.finish(lv, ServeError(400, why, param="model" if adapter else "messages",
                                                   code="adapter_unavailable" if adapter else None).to_wire())
            self._flush_aborted()
            if (unpublished or len(self.outbox)) and (self.migration.wanted or self.migration.deadline):
                unpublished = await self._publish_now(unpublished)  # a hand-over sends lv.seq: chunks first
            await self.migration.between_steps()  # hand sequences over / end them at the notice deadline
            if not self.engine.has_unfinished():
                if unpublished or len(self.outbox):  # the last outputs; then look again for work queued meanwhile
                    unpublished = await self._publish_now(unpublished)
                    continue
                self._wake.clear()
                await wait_event(self._wake, self.cfg.idle_wait_s * 20)
                continue
            t_step = time.perf_counter()
            step = asyncio.get_running_loop().run_in_executor(self._engine_thread, self.engine.step)
            unpublished = await self._publish_now(unpublished)  # overlaps the step computing
            try:
                outputs = await step
            except Exception as exc:  # an engine bug must end the batch with an error, never stall the worker
                log.exception("engine step failed; ending the %d requests in the batch", len(self.live))
                await self._fail_all(f"internal engine error: {type(exc).__name__}: {exc}")
                continue
            t_step = time.perf_counter() - t_step
            self.num_steps += 1
            self._apply_aborts()  # cancels heard during the step win over its outputs (the client is gone)
            self._count_aborted(outputs)
            unpublished = outputs
            # the loop's own share of a token's interval (adds, aborts), on top of the engine's step
            self._host_ms += 0.2 * ((time.perf_counter() - t_iter - t_step) * 1e3 - self._host_ms)

    def _count_aborted(self, outputs: list[StepOutput]) -> None:
        """Tokens computed for aborted requests by the step that finished them (their end is collected by
        ``_flush_aborted`` before these outputs are)."""
        for out in outputs:
            lv = self.live.get(out.request_id)
            if lv is not None and lv.aborted and out.finished:
                lv.num_generated = max(lv.num_generated, out.num_generated_tokens)

    async def _publish_now(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Collect ``outputs`` (a step's, possibly empty) and flush the outbox once; returns the empty list
        left to publish."""
        self._collect_outputs(outputs)
        if len(self.outbox):
            await self.outbox.flush()
        return []

    async def _fail_all(self, message: str) -> None:
        """Abort every live request in the engine and end each with a retryable 500."""
        for rid, lv in list(self.live.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # keep ending the others
                log.exception("abort of %s failed", rid)
            lv.aborted = lv.aborted or "engine_error"
            self.outbox.finish(lv, ServeError(500, message, type="server_error", code="engine_error",
                                               retryable=True, retry_after=1.0).to_wire())
        await self.outbox.flush()
        try:  # drain the abort notices the engine queued, so they do not reach the next batch
            await asyncio.get_running_loop().run_in_executor(self._engine_thread, self.engine.step)
        except Exception:
            log.exception("engine step after failure failed")

    def _flush_aborted(self) -> None:
        """Finish requests aborted but not yet reported (engine may not report aborts itself)."""
        for rid, lv in list(self.live.items()):
            if lv.aborted and not self.engine_has(rid):
                self._finish_abort(lv)

    def engine_has(self, request_id: str) -> bool:  # whether the engine still holds ``request_id``
        return self.engine.has_request(request_id)

    def _collect_outputs(self, outputs: list[StepOutput]) -> None:
        """Put one step's outputs into the outbox (chunks, and records of the requests they end)."""
        now = time.time()
        for out in outputs:
            lv = self.live.get(out.request_id)
            if lv is None:
                continue
            if lv.aborted:
                if out.finished:
                    lv.num_generated = max(lv.num_generated, out.num_generated_tokens)  # tokens were computed
                    self._finish_abort(lv)
                continue
            self._collect_step(lv, out, now)

    def _collect_step(self, lv: Live, out: StepOutput, now: float) -> None:
        lv.num_generated = out.num_generated_tokens
        first = not lv.t_first and out.new_token_ids
        if first:
            lv.t_first = now
            if self.on_first_token is not None:
                hook, self.on_first_token = self.on_first_token, None
                hook()
            if not out.finished:  # ended in this step: its completion record, in the same flush, says more
                self.outbox.event(subjects.sched_events(lv.req.name, lv.req.version),
                                  b'{"request_id":"%s","event":"first_token"}' % lv.req.request_id.encode())
        # thinking, then tool calls, out of the text (docs/decisions/0044-reasoning-output.md, docs/tools.md)
        thought, text, calls = lv.split(out.text, len(out.new_token_ids), out.finished)
        if lv.echo_pending and lv.req.echo_text and (text or out.new_token_ids or out.finished):
            text = lv.req.echo_text + text
        if text or out.new_token_ids:
            lv.echo_pending = False
        logprobs = step_logprobs(self.engine, lv.req.sampling, out)
        if not out.finished:
            if out.text or out.new_token_ids:
                self.outbox.send(lv, Chunk(lv.req.request_id, lv.seq, text, tuple(out.new_token_ids),
                                           model=lv.req.model_ref, worker_id=self.cfg.worker_id, logprobs=logprobs,
                                           choice_index=lv.req.choice_index, tool_calls=calls, reasoning=thought))
            return
        u = usage(lv, out.num_prompt_tokens or len(lv.req.prompt_token_ids), out.num_cached_tokens)
        t = timing(lv, now)
        reason = "tool_calls" if out.finish_reason == "stop" and lv.tools and lv.tools.num_calls else out.finish_reason
        self.outbox.send(lv, Chunk(lv.req.request_id, lv.seq, text, tuple(out.new_token_ids), True,
                                   reason, u, t, None, lv.req.model_ref, self.cfg.worker_id,
                                   logprobs, lv.req.choice_index, calls, thought))
        self.outbox.record(lv, "ok", reason, u, t)

    async def _safe_publish(self, subject: str, data: bytes) -> None:
        try:
            await self.bus.publish(subject, data)
        except BusError as exc:
            log.warning("publish to %s failed: %s", subject, exc)

    def _finish_abort(self, lv: Live) -> None:
        """End ``lv``, aborted for ``lv.aborted`` (a cancel, its deadline, a drain), with its error."""
        if lv.cancel_step >= 0:
            self.max_cancel_steps = max(self.max_cancel_steps, self.num_steps - lv.cancel_step)
        if lv.aborted == "deadline":
            err = ServeError(503, "the request's deadline passed before it finished", type="timeout",
                              code="deadline_exceeded", retryable=True, retry_after=1.0).to_wire()
        elif lv.aborted == "drain":  # the worker is stopping and its drain timeout ran out: not the client's doing
            err = ServeError(503, "the worker stopped (drain timeout) before the request finished; retry",
                              type="unavailable", code="worker_draining", retryable=True, retry_after=1.0).to_wire()
        else:
            err = ServeError(499, f"request cancelled ({lv.aborted})", type="cancelled", code="cancelled").to_wire()
        self.outbox.finish(lv, err, status="cancelled", aborted=True)

    # ---- heartbeats --------------------------------------------------------------------------
    def credits_msg(self) -> Credits:
        """Current credits: free KV blocks and sequence slots (minus queued, not yet added), the measured
        step time (a whole iteration of the step loop, EWMA) and prefill speed, and the tokens served per
        tenant since the previous call."""
        st = self.engine.stats()
        step_ms = st.step_ms + self._host_ms if st.step_ms else 0.0  # engine decode step at this batch + loop
        free_blocks, free_slots = self.engine.credits()
        total_blocks = self.awake_blocks if self.sleeping and self.awake_blocks else st.num_total_blocks
        return Credits(self.cfg.worker_id, self.cfg.name, self.cfg.version, free_blocks, total_blocks,
                       max(0, free_slots - len(self._adds)), self.engine.max_num_seqs,
                       self.engine.block_size, st.num_running, st.num_waiting, self.draining or self.sleeping,
                       time.time(), round(step_ms, 3), round(st.prefill_tokens_per_s, 1), self._served_since(st.served),
                       st.paused, self.sleeping)

    def _served_since(self, served: dict[str, list[int]]) -> dict[str, list[int]]:
        """{tenant: [prompt, completion] tokens} served since the previous heartbeat (``served_delta``)."""
        delta, self._served_sent = served_delta(served, self._served_sent)
        return delta

    async def publish_credits(self) -> None:
        """Publish this worker's credits (``credits_msg``) now; a bus failure is logged."""
        subj = subjects.credits(self.cfg.name, self.cfg.version, self.cfg.worker_id)
        await self._safe_publish(subj, self.credits_msg().encode())

    async def _credits_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.credits_interval_s)
            await self.publish_credits()

    def stats_msg(self) -> WorkerStats:
        """Engine statistics plus this worker's finished/aborted counters (outputs.worker_stats)."""
        return worker_stats(self.engine.stats(), self.cfg, self.num_finished, self.num_aborted, self.max_cancel_steps)

    async def _stats_loop(self) -> None:
        while True:  # first message at once: a fast start-up must not leave the gauges empty for a whole interval
            await self._safe_publish(subjects.stats(self.cfg.worker_id), self.stats_msg().encode())
            await asyncio.sleep(self.cfg.stats_interval_s)
