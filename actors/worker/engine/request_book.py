"""The engine's request book: the one record of every live request and the aborts still to report (one part of
``LLMEngine``, engine.py). Pure module (no torch): a request's random state is the runner's opaque object.

One record per request (docs/decisions/0050-one-record-per-request.md): a :class:`RequestState` *is* the
iteration scheduler's ``SchedSeq`` (token counters, preemptions, its scheduling keys) extended by what the engine
keeps (the request as added, random state, detokenizer, stop matcher, grammar, output ids), so the book and the
scheduler hold the same object, as nano-vllm's ``Sequence`` is held by its block manager and scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .iteration_scheduler import SchedSeq
from .types import EngineRequest, StepOutput


@dataclass(kw_only=True)
class RequestState(SchedSeq):
    """The engine's one record of a request: the scheduler's view (``SchedSeq``: ``seq_id``, ``num_tokens``,
    ``num_computed_tokens``, preemptions, ``token_ids`` = prompt + generated, and the scheduling keys derived
    from the request once, by :meth:`of`) plus the engine's state of it. Build it with :meth:`of`."""

    req: EngineRequest  # the request as added (immutable; its sampling parameters are the wire message's)
    rng: Any  # the runner's random state of the request (ModelRunner.new_rng)
    detok: IncrementalDetokenizer  # generated ids -> text deltas
    stop: StopStringMatcher  # stop strings over the text
    output_ids: list[int] = field(default_factory=list)  # [generated] tokens generated so far
    grammar: Any = None  # structured.GrammarState when params.grammar is set, else None
    prompt_served: int = 0  # prompt positions computed at least once (recomputation is not service; tokens)

    @classmethod
    def of(cls, req: EngineRequest, rng: Any, detok: IncrementalDetokenizer, stop: StopStringMatcher,
           salt: bytes, grammar: Any = None) -> "RequestState":
        """The record of ``req``: ``token_ids`` = prompt + ``req.resumed_output_ids`` (a migrated sequence starts
        with those generated, its prompt counted as served elsewhere); the scheduling keys from ``req``
        (``batch`` from its priority class, ``urgent``, ``tenant``, ``weight``, ``adapter``) and ``salt`` (the
        prefix-cache salt, engine.adapter_salt of the request's salt and adapter)."""
        done = list(req.resumed_output_ids)
        tokens = [*req.prompt_token_ids, *done]
        return cls(req.request_id, len(tokens), token_ids=tokens, batch=req.priority == "batch", urgent=req.urgent,
                   tenant=req.tenant, weight=req.tenant_weight, salt=salt, adapter=req.adapter or "",
                   req=req, rng=rng, detok=detok, stop=stop, output_ids=done, grammar=grammar,
                   prompt_served=len(req.prompt_token_ids) if done else 0)

    @property
    def num_prompt(self) -> int:
        """Prompt length (tokens)."""
        return len(self.req.prompt_token_ids)


class RequestBook:
    """Live requests by id, and the ``StepOutput``s of aborts the next step reports."""

    def __init__(self) -> None:
        self._requests: dict[str, RequestState] = {}
        self._aborted: list[StepOutput] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._requests.values()))

    def get(self, request_id: str) -> RequestState:
        """The live request ``request_id``; KeyError when unknown."""
        return self._requests[request_id]

    def add(self, state: RequestState) -> None:
        """Book ``state``; ValueError when its id is taken."""
        rid = state.req.request_id
        if rid in self._requests:
            raise ValueError(f"duplicate request_id {rid!r}")
        self._requests[rid] = state

    def pop(self, request_id: str) -> RequestState | None:
        """Take ``request_id`` out of the book (finished, detached); None when unknown."""
        return self._requests.pop(request_id, None)

    def report_abort(self, r: RequestState) -> None:
        """Queue the "abort" output of ``r`` (already taken out) for the next step."""
        self._aborted.append(StepOutput(r.req.request_id, (), "", True, "abort", r.num_prompt, len(r.output_ids)))

    def take_aborted(self) -> list[StepOutput]:
        """The abort outputs queued since the last call (and forget them)."""
        out, self._aborted = self._aborted, []
        return out

    def is_idle(self) -> bool:
        """True when no request is live and no abort waits to be reported."""
        return not self._requests and not self._aborted

    def adapters_in_use(self) -> set[str]:
        """Adapter names of the live requests."""
        return {r.req.adapter for r in self._requests.values() if r.req.adapter}
