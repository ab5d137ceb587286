"""One request held by a worker: its book-keeping (:class:`Live`) and the engine's request for it
(:func:`engine_request`), through which every dispatched request passes on its way into the engine.

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
from actors.worker.migration_state import resume_of
from bus.messages import GenerateRequest


@dataclass
class Live:
    """Book-keeping of one request held by this worker."""

    req: GenerateRequest
    t_in: float  # when the worker accepted it (epoch s)
    seq: int = 0  # next chunk sequence number
    num_generated: int = 0  # tokens generated so far
    t_first: float = 0.0  # first token time (epoch s); 0 until then
    aborted: str = ""  # abort reason once cancelled
    echo_pending: bool = True  # completions echo text not yet sent
    cancel_step: int = -1  # worker step count when a cancel arrived (-1: none)
    trace: object = None  # trace context of the dispatch (the scheduler's queue span); None when tracing is off
    tools: HermesParser | None = None  # tool-call parser of the output (GenerateRequest.tool_parser)
    thinking: ThinkTagsParser | None = None  # reasoning parser, before the tool-call one (reasoning_parser)
    handoff: float = 0.0  # a migrated sequence: when its previous worker gave it up (epoch s) until its next chunk

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
