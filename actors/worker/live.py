"""One request held by a worker: the worker's one record of it (:class:`Live`) and the engine's request for it
(:func:`engine_request`), through which every dispatched request passes on its way into the engine.

One record per request (docs/decisions/0050-one-record-per-request.md): everything the worker service keeps about
a request it holds is a field of its ``Live`` (the wire request, stream position, timing, the pending add's
placement, a cancel heard and not yet applied, a preemption asked for, the trace context, the tool-call parser,
a hand-over's time), keyed by request id in ``WorkerService.live``; the engine keeps its own one record
(engine/request_book.py ``RequestState``, which is also the iteration scheduler's sequence). Finishing
(``Outbox.send`` of the final chunk), cancelling (:meth:`Live.request_abort`) and migrating
(:meth:`Live.resume_state`, :meth:`Live.resume`) each read and write that one record.

A migrated sequence (``GenerateRequest.resume``, actors/worker/migration_state.py) enters both the
same way: the engine's request carries its generated tokens and RNG state, and :meth:`Live.resume`
continues its chunk numbering and timing where the previous worker left them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from actors.text.reasoning import ThinkTagsParser
from actors.text.tool_calls import HermesParser, parse_step
from actors.worker.engine.types import EngineRequest
from actors.worker.migration_state import ResumeState, resume_of
from bus.messages import GenerateRequest


@dataclass
class Live:
    """The worker's one record of a request it holds (module docstring). Written on the service's event loop
    only (the step thread touches the engine's record, never this one)."""

    req: GenerateRequest  # the wire request (a failed hand-over replaces it by the one carrying its resume state)
    t_in: float  # when the worker accepted it (epoch s)
    # stream position (the Outbox advances ``seq``; the step loop's collection sets the rest)
    seq: int = 0  # next chunk sequence number
    num_generated: int = 0  # tokens generated so far
    t_first: float = 0.0  # first token time (epoch s); 0 until then
    echo_pending: bool = True  # completions echo text not yet sent
    # the pending add (WorkerService._adds holds the records queued for the engine)
    front: bool = False  # added at the head of the engine's queue (it displaces a preempted request)
    urgent: bool = False  # prefill priority (Dispatch.urgent, or a sequence taken back after a failed hand-over)
    # cancelling and preempting, asked on the event loop, applied between steps
    abort_pending: str = ""  # reason of an abort asked for and not yet applied ("" : none)
    aborted: str = ""  # abort reason once applied (the engine dropped it; its end is reported next)
    cancel_step: int = -1  # worker step count when a cancel arrived (-1: none)
    preempt: bool = False  # fair-share preemption asked for (applied after the adds of the same window)
    trace: object = None  # trace context of the dispatch (the scheduler's queue span); None when tracing is off
    tools: HermesParser | None = None  # tool-call parser of the output (GenerateRequest.tool_parser)
    thinking: ThinkTagsParser | None = None  # reasoning parser, before the tool-call one (reasoning_parser)
    handoff: float = 0.0  # a migrated sequence: when its previous worker gave it up (epoch s) until its next chunk

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.req.request_id

    def request_abort(self, reason: str, step: int | None = None) -> None:
        """Ask for this request's abort between steps for ``reason`` (the first reason asked wins); ``step``: the
        worker's step count when a cancel arrived (kept from the first cancel, for ``max_cancel_steps``)."""
        if step is not None and self.cancel_step < 0:
            self.cancel_step = step
        self.abort_pending = self.abort_pending or reason

    def take_abort(self) -> str:
        """The abort reason to apply now ("" when none, or when it is aborted already); marks it aborted."""
        reason, self.abort_pending = self.abort_pending, ""
        if not reason or self.aborted:
            return ""
        self.aborted = reason
        return reason

    @property
    def migrations(self) -> int:
        """Times this sequence moved between workers so far (0 for a request dispatched here fresh)."""
        prev = resume_of(self.req.resume)
        return prev.migrations if prev is not None else 0

    def resume_state(self, worker_id: str, output_ids: tuple[int, ...], rng_state: bytes | None,
                     now: float) -> ResumeState:
        """What another worker needs to continue this sequence, given up by ``worker_id`` at ``now`` (epoch s)
        with the engine's ``output_ids`` and sampler ``rng_state`` (``LLMEngine.detach_request``): this
        record's stream position and times, its moves so far + 1."""
        return ResumeState(worker_id, tuple(output_ids), self.seq, rng_state, self.t_in, self.t_first,
                           self.echo_pending, self.migrations + 1, now)

    def resume(self, req: GenerateRequest, texts: list[str] | None) -> None:
        """Continue a migrated sequence's book-keeping from ``req.resume`` (no-op for a fresh request): next
        chunk seq, tokens so far, first-token and arrival times, echo; the tool-call parser replayed through
        ``texts`` (what the engine replay released per resumed token; their output was sent by the previous
        worker). ValueError on a malformed ``resume``."""
        st = resume_of(req.resume)
        if st is None:
            return
        self.seq, self.num_generated, self.echo_pending = st.seq, len(st.output_ids), st.echo_pending
        self.t_in, self.t_first = st.t_in or self.t_in, st.t_first
        self.handoff = st.t_handoff or time.time()
        for text in texts or ():
            self.split(text, 1, False)

    def split(self, text: str, num_tokens: int, finished: bool) -> tuple[str, str, tuple[dict, ...]]:
        """One engine step's ``(reasoning, content, tool_call deltas)``: ``text`` (of ``num_tokens`` tokens)
        through the reasoning parser (the thinking; its tokens counted), then the answer through the tool-call
        parser (actors/text/reasoning.py, tool_calls.py); both flushed when ``finished``."""
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.step(text, num_tokens, finished)
        content, calls = parse_step(self.tools, text, finished)
        return thought, content, calls


def engine_request(req: GenerateRequest, urgent: bool) -> EngineRequest:
    """The engine's request for ``req``, with a migrated sequence's tokens and RNG state (ValueError on a
    malformed ``resume``)."""
    st = resume_of(req.resume)
    return EngineRequest(req.request_id, tuple(req.prompt_token_ids), req.sampling, arrival_time=time.monotonic(),
                         priority=req.priority, tenant=req.tenant, urgent=urgent, tenant_weight=req.tenant_weight,
                         cache_salt=bytes.fromhex(req.cache_salt), adapter=req.adapter or None,
                         adapter_path=req.adapter_path,
                         resumed_output_ids=st.output_ids if st else (), rng_state=st.rng_state if st else None)
