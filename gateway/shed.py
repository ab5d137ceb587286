"""Refusal hints: the gateway refuses at once, with no bus round trip, a request that a scheduler has just
shown it would refuse (pure: no clock reads, ``now`` is passed in, epoch seconds).

Why: under a 10x overload nine requests in ten are refused. Each refusal that goes the whole way (gateway ->
validator: template and tokenize -> scheduler -> validator -> gateway) costs ~5 ms of CPU spread over four
processes (measured on 2 shared cores, docs/decisions), taken from the CPU worker on the same host. A hint
learnt from one refusal answers the next ones of the same kind locally for a short time.

What is learnt (from the final error chunk of a refused request, ``learn``):

* ``queue_full`` (503): the model version's whole queue is full -> every request for it, for HINT_TTL_S;
* ``tenant_queue_full`` (429): the tenant's queue is full -> that tenant's requests for it, for HINT_TTL_S;
* ``deadline_unmeetable`` (503) carrying ``queue_clear_at`` (epoch s when the queue ahead of a new request
  of that tenant and priority class clears at the measured rate) and ``decode_step_s`` (s per decode step
  of the running batch): a request of that tenant and class whose deadline comes before
  ``queue_clear_at + own decode`` cannot finish in time either. The own decode counted is ``max_tokens``
  steps only when ``ignore_eos`` makes the length certain (else 0) and the prompt's prefill is left out,
  so the rule refuses nothing the scheduler would admit; requests arriving later have the queue that the
  hint saw (at least, minus what was served since, which ``queue_clear_at`` being absolute accounts for).

HINT_TTL_S is short against the time to serve a full queue, so that no hint can leave a worker idle while
requests are refused: the queue a hint saw full still holds work when the hint lapses.
"""

from __future__ import annotations

from dataclasses import dataclass

HINT_TTL_S = 0.25  # how long a learnt refusal answers for the scheduler (s)
QUEUE_FULL, TENANT_QUEUE_FULL, DEADLINE_UNMEETABLE = "queue_full", "tenant_queue_full", "deadline_unmeetable"


@dataclass(frozen=True)
class Hint:
    """One learnt refusal: the error to answer with, until ``expires`` (epoch s)."""

    error: dict  # the Chunk.error dict of the refusal (status, message, type, code, retry_after, ...)
    expires: float
    queue_clear_at: float = 0.0  # deadline hints: epoch s (0: not a deadline hint)
    decode_step_s: float = 0.0


@dataclass(frozen=True)
class Shape:
    """What a hint is matched against: the request as the gateway sees it before any bus hop."""

    model: str  # "name@version"
    tenant: str
    priority: str
    deadline: float  # absolute, epoch s
    max_tokens: int = 0  # the body's max_tokens (0: not given)
    ignore_eos: bool = False


class ShedHints:
    """Learnt refusals of one gateway, keyed by model version (queue full), + tenant (tenant queue full),
    + priority class (deadline). Bounded: expired hints are dropped when a new one is learnt."""

    def __init__(self, ttl_s: float = HINT_TTL_S, max_hints: int = 4096) -> None:
        if ttl_s < 0 or max_hints < 1:
            raise ValueError("ttl_s must be >= 0 and max_hints >= 1")
        self.ttl_s, self.max_hints = ttl_s, max_hints
        self._hints: dict[tuple, Hint] = {}
        self.num_shed = 0  # requests refused from a hint

    def learn(self, model: str, tenant: str, priority: str, error: dict, now: float) -> None:
        """Remember a scheduler's refusal (``error``: the final chunk's error dict); other errors are ignored."""
        if self.ttl_s == 0 or not isinstance(error, dict):
            return
        code, exp = error.get("code"), now + self.ttl_s
        if code == QUEUE_FULL:
            key, hint = (model,), Hint(error, exp)
        elif code == TENANT_QUEUE_FULL:
            key, hint = (model, tenant), Hint(error, exp)
        elif code == DEADLINE_UNMEETABLE and _num(error.get("queue_clear_at")) > 0:
            key = (model, tenant, priority)
            hint = Hint(error, exp, _num(error["queue_clear_at"]), max(0.0, _num(error.get("decode_step_s"))))
        else:
            return
        if len(self._hints) >= self.max_hints:
            self._hints = {k: h for k, h in self._hints.items() if h.expires > now}
            if len(self._hints) >= self.max_hints:
                return
        self._hints[key] = hint

    def check(self, shape: Shape, now: float) -> dict | None:
        """The error to refuse ``shape`` with at once, or None (send it on)."""
        for key in ((shape.model,), (shape.model, shape.tenant), (shape.model, shape.tenant, shape.priority)):
            hint = self._hints.get(key)
            if hint is None or hint.expires <= now:
                continue
            if hint.queue_clear_at and not _late(hint, shape):
                continue
            self.num_shed += 1
            return hint.error
        return None


def _late(hint: Hint, shape: Shape) -> bool:
    """Whether ``shape`` surely misses its deadline behind the queue ``hint`` saw."""
    own = shape.max_tokens * hint.decode_step_s if shape.ignore_eos else 0.0
    return shape.deadline < hint.queue_clear_at + own


def _num(v) -> float:
    """A float from a JSON value (0.0 when it is not a number)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0
