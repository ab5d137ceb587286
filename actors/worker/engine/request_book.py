"""The engine's request book: the state of every live request and the aborts still to report (one part of
``LLMEngine``, engine.py). Pure module (no torch): a request's random state is the runner's opaque object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from .detokenizer import IncrementalDetokenizer, StopStringMatcher
from .types import EngineRequest, StepOutput


@dataclass
class RequestState:
    """Engine-side state of one request."""

    req: EngineRequest  # the request as added
    token_ids: list[int]  # [prompt + generated] every token (the scheduler's prefix cache reads this list)
    rng: Any  # the runner's random state of the request (ModelRunner.new_rng)
    detok: IncrementalDetokenizer  # generated ids -> text deltas
    stop: StopStringMatcher  # stop strings over the text
    output_ids: list[int] = field(default_factory=list)  # [generated] tokens generated so far
    grammar: Any = None  # structured.GrammarState when params.grammar is set, else None
    prompt_served: int = 0  # prompt positions computed at least once (recomputation is not service; tokens)

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

    def abort(self, request_id: str) -> bool:
        """Take ``request_id`` out and queue its "abort" output; False when unknown."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return False
        self._aborted.append(StepOutput(request_id, (), "", True, "abort", r.num_prompt, len(r.output_ids)))
        return True

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
