"""Usage counters of an engine (one part of ``LLMEngine``, engine.py): ``EngineStats`` kept per step, the
per-tenant service (``served``) and the snapshot ``stats()`` returns. Pure module (no torch).

``stats()`` is read from another thread than the one that steps: ``served`` is guarded by a lock."""

from __future__ import annotations

import threading
from typing import Protocol

from .iteration_scheduler import StepPlan
from .request_book import RequestState
from .step_rates import StepRates
from .types import EngineStats


class SchedulerCounters(Protocol):
    """What the usage counters read of the scheduler (iteration_scheduler.IterationScheduler)."""

    num_preemptions: int  # recompute preemptions so far
    num_kv_reclaims: int  # preemptions that gave a waiting tenant its KV share
    prefix_hits_by_tenant: dict  # {tenant: prompt tokens found in the prefix cache}
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting

    def paused_ids(self) -> list[str]: ...


class BlockCounters(Protocol):
    """What the usage counters read of the block manager (block_manager.BlockManager)."""

    prefix_hit_tokens: int  # prompt tokens found in the prefix cache
    prefix_query_tokens: int  # prompt tokens looked up in it
    num_free_blocks: int  # free KV blocks


class UsageMeter:
    """Step counters, per-tenant service and measured step rates of one engine."""

    def __init__(self, num_total_blocks: int) -> None:
        """Zeroed counters for a KV cache of ``num_total_blocks`` blocks."""
        self.stats = EngineStats(num_total_blocks=num_total_blocks)
        self.rates = StepRates()  # measured step time per batch size and prefill speed (step_rates.py)
        self._served_lock = threading.Lock()

    def reset(self, num_total_blocks: int) -> None:
        """Forget every counter and measurement (after a warm-up pass)."""
        self.stats = EngineStats(num_total_blocks=num_total_blocks)
        self.rates = StepRates(self.rates.alpha)

    def set_total_blocks(self, num_total_blocks: int) -> None:
        """The KV cache's block count changed (a resize)."""
        self.stats.num_total_blocks = num_total_blocks

    def record_step(self, plan: StepPlan, rows: list[RequestState], num_sampled: int,
                    sched: SchedulerCounters, blocks: BlockCounters) -> None:
        """Count one step: ``rows[i]`` is the request of ``plan.seqs[i]``; ``num_sampled`` tokens generated.
        Prompt tokens count every prompt position computed (recomputation included); ``served`` counts
        first-time prompt positions only."""
        s = self.stats
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_prompt_tokens += sum(max(0, min(i.start + i.num_new_tokens, r.num_prompt) - i.start)
                                   for i, r in zip(plan.seqs, rows))
        s.max_batch_size_seen = max(s.max_batch_size_seen, len(plan.seqs))
        self._count_served(plan, rows)
        s.extra["num_preemptions"] = sched.num_preemptions
        s.extra["prefix_cache_hit_tokens"] = blocks.prefix_hit_tokens
        s.extra["prefix_cache_query_tokens"] = blocks.prefix_query_tokens
        s.extra["prefix_hits_by_tenant"] = dict(sched.prefix_hits_by_tenant)
        s.extra["num_kv_reclaims"] = sched.num_kv_reclaims

    def _count_served(self, plan: StepPlan, rows: list[RequestState]) -> None:
        """Add the step's service to ``stats.served[tenant]``: prompt positions computed for the first time
        (a preempted request's recomputation is not counted again) and one generated token per sampled row."""
        with self._served_lock:
            for item, r in zip(plan.seqs, rows):
                end = min(item.start + item.num_new_tokens, r.num_prompt)
                counts = self.stats.served.setdefault(r.req.tenant, [0, 0])
                counts[0] += max(0, end - max(item.start, r.prompt_served))
                counts[1] += int(item.samples)
                r.prompt_served = max(r.prompt_served, end)

    def snapshot(self, sched: SchedulerCounters, blocks: BlockCounters, extra: dict) -> EngineStats:
        """A copy of the counters with the live gauges filled in and ``extra`` merged into ``extra``."""
        s = self.stats
        s.num_running, s.num_waiting = sched.num_running, sched.num_waiting
        s.num_free_blocks = blocks.num_free_blocks
        s.extra.update(extra)
        s.step_ms = self.rates.step_ms(max(1, s.num_running))
        s.prefill_tokens_per_s = self.rates.prefill_tokens_per_s
        with self._served_lock:
            served = {t: list(c) for t, c in s.served.items()}
        return EngineStats(**{**s.__dict__, "extra": dict(s.extra), "served": served, "paused": sched.paused_ids()})
