"""Request book-keeping shared by the engines that the worker service drives (``LLMEngine`` and the
zero-compute engine, actors/worker/zero_compute.py): lookups, recompute preemption and aborts over
``self._requests`` (request id -> an object with ``num_prompt`` and ``output_ids``), ``self.scheduler``
(``IterationScheduler``) and ``self._aborted`` (StepOutputs the next step reports); the counters and
capacity over ``self._stats`` (EngineStats), ``self.block_manager``, ``self.rates`` (StepRates),
``self._served_lock`` and ``self.config`` (``max_num_seqs``, ``block_size``)."""

from __future__ import annotations

from .types import EngineStats, StepOutput


class RequestBook:
    """Mixin: the request-level calls of the engine interface that only touch the book-keeping."""

    def preempt_request(self, request_id: str) -> bool:
        """Recompute-preempt a running request between steps (vLLM's recompute preemption, Kwon et al.
        2023): its KV blocks are freed (full blocks stay in the prefix cache) and it waits at the tail of
        the queue; when readmitted it recomputes prompt + generated tokens and goes on generating as if
        uninterrupted. False when the request is not running (unknown, finished or already waiting)."""
        return self.scheduler.preempt(request_id)

    def is_running(self, request_id: str) -> bool:
        """True when ``request_id`` is in the running batch (admitted, not waiting or preempted)."""
        return self.scheduler.is_running(request_id)

    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` waits or runs in the engine (an abort not yet reported counts as gone)."""
        return request_id in self._requests

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks; next ``step()`` reports it finished ("abort")."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return
        self.scheduler.remove(request_id)
        self._aborted.append(StepOutput(request_id, (), "", True, "abort", r.num_prompt, len(r.output_ids)))

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, or has an abort still to report."""
        return bool(self._requests) or bool(self._aborted)

    def _extra_stats(self) -> dict:
        """Engine-specific counters merged into ``stats().extra`` (none here)."""
        return {}

    def stats(self) -> EngineStats:
        """Snapshot of counters (a copy)."""
        s = self._stats
        s.num_running, s.num_waiting = self.scheduler.num_running, self.scheduler.num_waiting
        s.num_free_blocks = self.block_manager.num_free_blocks
        s.extra.update(self._extra_stats())
        s.step_ms = self.rates.step_ms(max(1, s.num_running))
        s.prefill_tokens_per_s = self.rates.prefill_tokens_per_s
        with self._served_lock:
            served = {t: list(c) for t, c in s.served.items()}
        return EngineStats(**{**s.__dict__, "extra": dict(s.extra), "served": served,
                              "paused": self.scheduler.paused_ids()})

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes (cold start for the next request); returns blocks dropped."""
        return self.block_manager.reset_prefix_cache()

    @property
    def max_num_seqs(self) -> int:
        """Sequence slots (sequences in one step), from the config."""
        return self.config.max_num_seqs

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block, from the config."""
        return self.config.block_size

    def credits(self) -> tuple[int, int]:
        """(free KV blocks, free sequence slots = max_num_seqs - running - waiting, >= 0)."""
        used = self.scheduler.num_running + self.scheduler.num_waiting
        return self.block_manager.num_free_blocks, max(0, self.config.max_num_seqs - used)
