"""Iteration-level continuous batching scheduler (pure: no torch, no nats).

Orca-style iteration scheduling (Yu et al. 2022) with vLLM-style recompute preemption
(Kwon et al. 2023).  Every sequence is just two counters: ``num_tokens`` (prompt + generated)
and ``num_computed_tokens`` (tokens whose K/V is in the cache).  Each step gives each scheduled
sequence ``num_tokens - num_computed_tokens`` new tokens to compute (1 for a decode, the rest of
the prompt for a prefill), cut to the step's token budget (chunked prefill).

Policy per ``schedule()``:
1. Running sequences get their tokens: ``interactive`` ones first, then ``batch`` ones, each class
   oldest first.  When blocks run out, the newest running ``batch`` sequence is preempted, or, with
   none running, the newest running sequence (blocks freed, ``num_computed_tokens = 0``, put back at
   the head of the waiting queue; it is recomputed later).  So block shortage never preempts an
   interactive sequence while a batch one runs (issue 23).
2. If nothing was preempted, waiting sequences are admitted in queue order while ``max_num_seqs``,
   ``max_num_batched_tokens`` and free blocks allow (no skipping: the queue head blocks the rest).
   A sequence whose tokens start with cached full blocks (block manager prefix cache) starts with
   those tokens computed; only the rest counts against the token budget.  A sequence with a LoRA adapter
   is admitted only when ``admit_gate`` finds its adapter a slot (lora_tiers.py); otherwise it waits.
Sequences join and leave the running set only between steps.

Prefill priority (docs/decisions/0021-latency-isolation.md): a sequence added with ``urgent=True``
(its tenant is under its fair share) queues behind the other urgent ones but ahead of every ordinary
waiting sequence, and the step budget keeps room for the pending prompt tokens of the urgent sequences
at the queue head before running prefill chunks take it, so its whole prefill joins the next step
together with every running decode (decodes never skip a step for it); ordinary waiting sequences are
not admitted into that step (they join the next one), so their prefills do not lengthen it.

KV share between tenants (kv_share.py, docs/decisions/0031-kv-isolation-and-cache-salt.md): with sequences
of two or more tenants present, before planning a step the waiting sequence of the tenant furthest below
its weighted share of the blocks goes to the head of the ordinary waiting sequences, and if its first
chunk's blocks are missing, the newest running sequences of tenants above their share are preempted (to
the waiting tail, as ``preempt``) until they fit.

Fair-share preemption (docs/decisions/0018-fair-share-preemption.md): the caller may ``add`` the
sequence that displaces another with ``front=True`` and then ``preempt`` the running victim between
steps (same recompute preemption, but requeued at the waiting *tail*: behind the newcomer and behind
anything admitted with it, so the slot it frees goes to them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, blocks_for
from .kv_share import below_share, reclaim_from


@dataclass
class SchedSeq:
    """Scheduler view of one sequence."""

    seq_id: str
    num_tokens: int  # prompt + generated tokens (tokens)
    num_computed_tokens: int = 0  # tokens whose K/V is cached (tokens)
    num_preemptions: int = 0
    token_ids: list[int] | None = None  # the engine's token list (prompt + generated), for prefix caching
    batch: bool = False  # priority class "batch" (else "interactive"): preempted first on block shortage
    urgent: bool = False  # prefill priority: queued ahead of ordinary waiting sequences
    tenant: str = ""  # accounting key: KV share under contention (kv_share.py), prefix hits per tenant
    weight: float = 1.0  # the tenant's fair-share weight (scheduler's tenant record), for the KV share
    salt: bytes = b""  # prefix-cache salt (actors/cache_salt.py): blocks are shared only under equal salts
    num_cached_prompt_tokens: int = -1  # prompt tokens found in the prefix cache at first admission (-1: not yet)
    adapter: str = ""  # LoRA adapter name ("" = base model): admission needs a slot for it (``admit_gate``)

    @property
    def num_pending(self) -> int:
        """Tokens still to compute (tokens)."""
        return self.num_tokens - self.num_computed_tokens


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's part of a step: compute tokens ``start .. start + num_new_tokens - 1``."""

    seq_id: str
    start: int  # first position computed this step (= num_computed_tokens before the step)
    num_new_tokens: int  # tokens computed this step
    samples: bool  # True if this chunk reaches the end, so a token is sampled


@dataclass
class StepPlan:
    """What one engine step runs, in batch order, plus sequences preempted while planning."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    reclaimed: list[str] = field(default_factory=list)  # preempted before planning to restore a tenant's KV share

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in the forward pass (tokens)."""
        return sum(s.num_new_tokens for s in self.seqs)

    def is_empty(self) -> bool:
        """True if no sequence runs this step."""
        return not self.seqs


class IterationScheduler:
    """Waiting queue (FCFS) + running list; builds a ``StepPlan`` per step."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[SchedSeq] = deque()
        self.running: list[SchedSeq] = []
        self._seqs: dict[str, SchedSeq] = {}
        self.num_preemptions = 0
        self.num_kv_reclaims = 0  # sequences preempted to give a waiting tenant its KV share
        self.prefix_hits_by_tenant: dict[str, int] = {}  # prompt tokens found in the prefix cache, per tenant
        # ``admit_gate(adapter, adapters of the running sequences) -> bool``: called before a waiting sequence
        # with an adapter is admitted; False keeps it (and, FCFS, the queue behind it) waiting (no LoRA slot).
        self.admit_gate = None
        # the model's sliding window (tokens; None = full attention): commit releases blocks before it
        self.window: int | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self._seqs)

    def add(self, seq_id: str, num_prompt_tokens: int, token_ids: list[int] | None = None,
            front: bool = False, urgent: bool = False, priority: str = "interactive", tenant: str = "",
            weight: float = 1.0, salt: bytes = b"", adapter: str = "") -> None:
        """Queue a new sequence at the tail of the waiting queue (``front``: at its head; ``urgent``:
        behind the urgent sequences at the head, ahead of the others).

        ``token_ids``: the sequence's live token list (prompt, then generated tokens appended by the
        caller); given, the block manager's prefix cache is consulted on admission and filled as
        blocks complete.  ``priority``: "interactive" or "batch" (bus.messages.PRIORITIES).  ``tenant`` and
        ``weight``: its tenant and fair-share weight (KV share under contention, kv_share.py); ``salt``: its
        prefix-cache salt (actors/cache_salt.py); ``adapter``: its LoRA adapter ("" = none; see ``admit_gate``).
        """
        self.enqueue(SchedSeq(seq_id, num_prompt_tokens, token_ids=token_ids, batch=priority == "batch",
                              urgent=urgent, tenant=tenant, weight=weight, salt=salt, adapter=adapter), front)

    def enqueue(self, seq: SchedSeq, front: bool = False) -> None:
        """Queue ``seq`` itself (the engine's request record is one, engine/request_book.py): at the waiting
        tail, at its head with ``front``, or behind the urgent sequences at the head when ``seq.urgent``.
        ValueError when its id is taken."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"duplicate sequence id {seq.seq_id!r}")
        self._seqs[seq.seq_id] = seq
        if front:
            self.waiting.appendleft(seq)
        elif seq.urgent:
            self.waiting.insert(self._num_urgent_head(), seq)
        else:
            self.waiting.append(seq)

    def _num_urgent_head(self) -> int:
        """Number of urgent sequences at the head of the waiting queue."""
        n = 0
        while n < len(self.waiting) and self.waiting[n].urgent:
            n += 1
        return n

    def paused_ids(self) -> list[str]:
        """Ids of waiting sequences that were preempted (they resume when readmitted). ``list()`` of the deque
        runs in C under the GIL, so another thread may call this while a step runs."""
        return [s.seq_id for s in list(self.waiting) if s.num_preemptions]

    def is_running(self, seq_id: str) -> bool:
        """True when ``seq_id`` is in the running set (not waiting, not unknown)."""
        seq = self._seqs.get(seq_id)
        return seq is not None and seq in self.running

    def preempt(self, seq_id: str) -> bool:
        """Preempt a running sequence now (between steps): blocks freed, requeued at the waiting tail and
        recomputed when readmitted. False when ``seq_id`` is not running (unknown, waiting or finished)."""
        if not self.is_running(seq_id):
            return False
        seq = self._seqs[seq_id]
        self.running.remove(seq)
        self._preempt(seq, None)
        self.waiting.remove(seq)  # _preempt requeued it at the head (block-shortage rule): move to the tail
        self.waiting.append(seq)
        return True

    def remove(self, seq_id: str) -> bool:
        """Drop a finished/aborted sequence and free its blocks; False if unknown."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq_id)
        return True

    def append_token(self, seq_id: str) -> None:
        """Record one generated token for ``seq_id`` (its K/V is computed next step)."""
        self._seqs[seq_id].num_tokens += 1

    def schedule(self) -> StepPlan:
        """Plan one step (mutates block tables); see module docstring for the policy."""
        plan = StepPlan()
        self._share_kv(plan)
        reserve = self._urgent_reserve()
        budget = self._schedule_running(plan, self.max_num_batched_tokens - reserve) + reserve
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        return plan

    def _urgent_reserve(self) -> int:
        """Tokens of the step budget kept for the urgent sequences at the waiting head (tokens): their
        pending prompt tokens, at most what leaves one token per running sequence."""
        free_seqs = self.max_num_seqs - len(self.running)
        pending = sum(self.waiting[i].num_pending for i in range(min(self._num_urgent_head(), max(free_seqs, 0))))
        return max(0, min(pending, self.max_num_batched_tokens - len(self.running)))

    def commit(self, plan: StepPlan) -> None:
        """Mark the planned tokens computed (call after the forward pass)."""
        for item in plan.seqs:
            seq = self._seqs[item.seq_id]
            seq.num_computed_tokens += item.num_new_tokens
            if seq.token_ids is not None:
                self.bm.cache_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if self.window:  # sliding-window model: blocks before every later query's window go back
                self.bm.release_before_window(seq.seq_id, seq.num_computed_tokens, self.window)

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Give running sequences their tokens (list order: interactive, then batch), preempting from
        the list's end on block shortage (the newest batch sequence, else the newest)."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            extra = seq.num_computed_tokens + n - self.bm.num_slots(seq.seq_id)
            while not self.bm.can_append(seq.seq_id, extra):
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is seq:
                    return budget
            self.bm.append_slots(seq.seq_id, extra)
            plan.seqs.append(self._item(seq, n))
            budget, i = budget - n, i + 1
        return budget

    def cached_prompt_tokens(self, seq_id: str) -> int:
        """Prompt tokens of ``seq_id`` found in the prefix cache when it was first admitted (tokens; 0 when
        unknown or not admitted yet): OpenAI's ``usage.prompt_tokens_details.cached_tokens``."""
        seq = self._seqs.get(seq_id)
        return max(0, seq.num_cached_prompt_tokens) if seq is not None else 0

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        """Admit waiting sequences FCFS under the seq, token and block budgets; a step that admits an
        urgent sequence admits no ordinary one (its prefill would lengthen the urgent one's step)."""
        urgent_step = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if urgent_step and not seq.urgent:
                return
            if seq.adapter and self.admit_gate is not None and not self.admit_gate(
                    seq.adapter, {s.adapter for s in self.running if s.adapter}):
                return
            urgent_step = urgent_step or seq.urgent
            tokens = None if seq.token_ids is None else seq.token_ids[: seq.num_tokens]
            cached = self.bm.cached_prefix_tokens(tokens, seq.salt) if tokens is not None else 0
            n = min(seq.num_tokens - cached, budget)
            if self.bm.allocate(seq.seq_id, cached + n, tokens, seq.salt) is None:
                return
            seq.num_computed_tokens = cached  # prefix-cache hit: those tokens' K/V are already there
            if seq.num_cached_prompt_tokens < 0:  # a recompute after preemption is not the request's hit
                seq.num_cached_prompt_tokens = cached
            if cached:
                self.prefix_hits_by_tenant[seq.tenant] = self.prefix_hits_by_tenant.get(seq.tenant, 0) + cached
            self.waiting.popleft()
            self._admit(seq)
            plan.seqs.append(self._item(seq, n))
            budget -= n

    def _admit(self, seq: SchedSeq) -> None:
        """Put ``seq`` in the running list, kept as [interactive..., batch...] each in admission order, so
        ``running.pop()`` is the newest batch sequence while one runs (the block-shortage victim)."""
        if seq.batch:
            self.running.append(seq)
            return
        i = next((k for k, r in enumerate(self.running) if r.batch), len(self.running))
        self.running.insert(i, seq)

    def _preempt(self, seq: SchedSeq, plan: StepPlan | None) -> None:
        """Recompute preemption: free blocks, reset progress, requeue at the waiting head."""
        self.bm.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        if plan is not None:
            plan.preempted.append(seq.seq_id)

    # ------------------------------------------------------------------ KV share between tenants (kv_share.py)

    def _share_kv(self, plan: StepPlan) -> None:
        """Under contention between tenants, the waiting sequence of the tenant furthest below its KV share
        goes to the head (behind urgent ones), and the newest running sequences of tenants above their share
        are preempted (to the waiting tail) until its first chunk's blocks are free."""
        if not self.waiting or not self.running:
            return
        weights = {s.tenant: s.weight for s in (*self.running, *self.waiting)}
        if len(weights) < 2:
            return
        held = self._blocks_held()
        seq = self._fairest_waiting(held, weights)
        need = blocks_for(min(seq.num_tokens, self.max_num_batched_tokens), self.bm.block_size)
        while need > self.bm.num_free_blocks:
            donor = reclaim_from(held, weights, self.bm.num_blocks, seq.tenant, need)
            victim = next((s for s in reversed(self.running) if s.tenant == donor), None)
            if victim is None:
                return
            held[donor] -= self.bm.num_held(victim.seq_id)
            self.preempt(victim.seq_id)
            self.num_kv_reclaims += 1
            plan.reclaimed.append(victim.seq_id)

    def _blocks_held(self) -> dict[str, int]:
        """KV blocks held per tenant by running sequences."""
        held: dict[str, int] = {}
        for s in self.running:
            held[s.tenant] = held.get(s.tenant, 0) + self.bm.num_held(s.seq_id)
        return held

    def _fairest_waiting(self, held: dict[str, int], weights: dict[str, float]) -> SchedSeq:
        """The head (urgent, or its tenant as far below its share as any), else the first waiting sequence of
        the tenant furthest below its share, moved to the head of the ordinary sequences."""
        head, first = self.waiting[0], self._num_urgent_head()
        if head.urgent:
            return head
        below = below_share(held, weights, self.bm.num_blocks)
        best = max(self.waiting, key=lambda s: below.get(s.tenant, 0.0))
        if below.get(best.tenant, 0.0) <= below.get(head.tenant, 0.0):
            return head
        self.waiting.remove(best)
        self.waiting.insert(first, best)
        return best

    @staticmethod
    def _item(seq: SchedSeq, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq.seq_id, seq.num_computed_tokens, n, seq.num_computed_tokens + n == seq.num_tokens)
