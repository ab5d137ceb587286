"""Scheduler policy for one model version: credit-based worker choice, in-flight table, throughput meter.

Pure module (no torch, no nats, no clock reads): the actor feeds it events (submit, credits, lease
gone, dispatch result, first token, done) with explicit times and carries out its decisions.
The queue itself (fair share, priority classes, deadlines) is ``actors.scheduler.fair_queue``.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

_TAKES = itertools.count(1)  # orders dispatches across workers: the least recently dispatched wins a tie


@dataclass
class WorkerView:
    """What the scheduler believes about one worker (from its lease and credit heartbeats)."""

    worker_id: str
    free_blocks: int = 0  # free KV blocks at last heartbeat, minus blocks dispatched since
    free_slots: int = 0  # free sequence slots at last heartbeat, minus dispatches since
    total_blocks: int = 0  # KV cache blocks in all (from heartbeats); bounds the longest prompt it can hold
    total_slots: int = 0  # sequence slots in all (max_num_seqs, from heartbeats)
    block_size: int = 16  # tokens per block
    draining: bool = False
    sleeping: bool = False  # asleep (its credits say so; actors/worker/sleep.py): woken when only sleepers are left
    leased: bool = False  # etcd lease key present
    incarnation: str = ""  # which process holds the id (from its registration; a restart under the same id differs)
    last_credit_ts: float = 0.0  # when the last heartbeat arrived (s, scheduler clock)
    step_ms: float = 0.0  # measured engine step time at its current batch (ms; 0 = not measured)
    credit_sent_ts: float = 0.0  # the last heartbeat's send time (worker clock, epoch s)
    prefill_tokens_per_s: float = 0.0  # measured prefill rate (tokens/s; 0 = not measured)
    inflight: dict[str, bool] = field(default_factory=dict)  # request id -> has streamed a token
    last_take: int = 0  # order of this worker's latest dispatch among all dispatches (0 = none yet)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold ``num_tokens`` tokens."""
        return max(1, math.ceil(num_tokens / max(1, self.block_size)))

    def can_take(self, num_prompt_tokens: int, now: float, stale_after: float) -> bool:
        """Live, fresh credits, a free slot and blocks for the prompt plus one token."""
        fresh = now - self.last_credit_ts <= stale_after
        return (self.leased and fresh and not self.draining and self.free_slots > 0
                and self.free_blocks >= self.blocks_for(num_prompt_tokens + 1))

    def can_take_preempting(self, num_prompt_tokens: int, now: float, stale_after: float) -> bool:
        """Live, fresh credits, not draining, and a KV cache that could ever hold the prompt: a dispatch
        that preempts one of its running requests (which frees that request's slot and blocks)."""
        fresh = now - self.last_credit_ts <= stale_after
        return (self.leased and fresh and not self.draining
                and self.total_blocks >= self.blocks_for(num_prompt_tokens + 1))

    def take(self, request_id: str, num_prompt_tokens: int) -> None:
        """Charge one dispatch against this worker's credits and record it in flight."""
        self.free_slots -= 1
        self.free_blocks -= self.blocks_for(num_prompt_tokens + 1)
        self.inflight[request_id] = False
        self.last_take = next(_TAKES)


class ThroughputMeter:
    """Tokens served per second over a sliding window, from completion records (for deadline admission)."""

    def __init__(self, window_s: float = 10.0, min_records: int = 3, started: float | None = None) -> None:
        self.window_s, self.min_records = window_s, min_records
        self.started = started  # first observation time (s); the rate divides by min(window, time since)
        self._events: deque[tuple[float, int]] = deque()
        self._sum = 0  # tokens of the events in the window (kept with them: no sum per call, decision 0029)

    def add(self, now: float, tokens: int) -> None:
        """Record ``tokens`` (prompt + completion) finished at ``now`` (s, monotonic)."""
        if self.started is None:
            self.started = now
        self._events.append((now, tokens))
        self._sum += tokens
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._sum -= self._events.popleft()[1]

    def tokens_per_s(self, now: float) -> float | None:
        """Measured rate, or None with fewer than ``min_records`` records in the window (unknown)."""
        self._trim(now)
        if len(self._events) < self.min_records:
            return None
        span = min(self.window_s, max(1.0, now - (self.started if self.started is not None else now)))
        return self._sum / span


class WorkerTable:
    """Workers of one version: leases, credits, in-flight requests; picks where to dispatch."""

    def __init__(self, stale_after_s: float = 2.0) -> None:
        self.workers: dict[str, WorkerView] = {}
        self.stale_after_s = stale_after_s  # credits older than this are not trusted (s)
        self.balance_fraction = 0.25  # affinity may pick a worker at most this share of its slots busier
        # worker id -> (monotonic s, on_credits args) of the latest heartbeat heard before its lease (a new
        # worker heartbeats before it registers): applied when the lease comes, if still fresh
        self.early_credits: dict[str, tuple[float, tuple]] = {}
        self.max_early_credits = 64  # bound on that map (oldest dropped)

    def get(self, worker_id: str) -> WorkerView:
        """The view of ``worker_id``, created empty on first mention."""
        return self.workers.setdefault(worker_id, WorkerView(worker_id))

    def on_lease(self, worker_id: str, present: bool, now: float | None = None,
                 incarnation: str = "") -> dict[str, bool]:
        """Lease put/delete. On delete returns the worker's in-flight table (id -> started) and forgets it.

        With ``now`` given, a worker whose credits are still fresh at the delete is alive: it revoked its
        lease to drain (SIGTERM), or its lease expired during an etcd outage. It gets no new dispatches
        (``leased`` False) but keeps its in-flight requests, which finish where they run; only when its
        credits go stale too does :meth:`reap` report them lost. Returns {} then.

        A put naming another ``incarnation`` than the one known (the worker was restarted under the same
        id, possibly before its old lease expired) returns the old process's in-flight table: lost."""
        if present:
            v = self.get(worker_id)
            lost = {}
            if incarnation and v.incarnation and v.incarnation != incarnation:
                lost = dict(v.inflight)
                v = self.workers[worker_id] = WorkerView(worker_id)
            v.leased = True
            v.incarnation = incarnation or v.incarnation
            self._apply_early_credits(worker_id, now)
            return lost
        view = self.workers.get(worker_id)
        if view is not None and now is not None and now - view.last_credit_ts <= self.stale_after_s:
            view.leased = False
            return {}
        view = self.workers.pop(worker_id, None)
        return dict(view.inflight) if view else {}

    def reap(self, now: float) -> dict[str, dict[str, bool]]:
        """Forget unleased workers whose credits went stale; ``{worker_id: in-flight table}`` of those
        that still held requests (lost: the caller re-dispatches or fails them)."""
        out = {}
        for wid, v in list(self.workers.items()):
            if not v.leased and now - v.last_credit_ts > self.stale_after_s:
                del self.workers[wid]
                if v.inflight:
                    out[wid] = dict(v.inflight)
        return out

    def on_credits(self, worker_id: str, free_blocks: int, free_slots: int, block_size: int,
                   draining: bool, now: float, total_blocks: int = 0, total_slots: int = 0,
                   step_ms: float = 0.0, prefill_tokens_per_s: float = 0.0, sent_ts: float = 0.0) -> None:
        """Heartbeat: replace the credit view (the worker's own count already includes our dispatches)
        and the measured speeds (ms per step, prefill tokens/s; 0 keeps the last measurement)."""
        if worker_id not in self.workers:  # no lease (yet, or any more): kept for the lease, not used
            self._keep_early(worker_id, now, (free_blocks, free_slots, block_size, draining, now, total_blocks,
                                              total_slots, step_ms, prefill_tokens_per_s, sent_ts))
            return
        v = self.workers[worker_id]
        v.free_blocks, v.free_slots, v.block_size, v.draining, v.last_credit_ts = (
            free_blocks, free_slots, block_size, draining, now)
        if total_blocks:
            v.total_blocks = total_blocks
        if total_slots:
            v.total_slots = total_slots
        v.step_ms = step_ms or v.step_ms
        v.credit_sent_ts = sent_ts or v.credit_sent_ts
        v.prefill_tokens_per_s = prefill_tokens_per_s or v.prefill_tokens_per_s

    def _keep_early(self, worker_id: str, now: float, args: tuple) -> None:
        self.early_credits.pop(worker_id, None)
        self.early_credits[worker_id] = (now, args)
        while len(self.early_credits) > self.max_early_credits:
            self.early_credits.pop(next(iter(self.early_credits)))

    def _apply_early_credits(self, worker_id: str, now: float | None) -> None:
        """A heartbeat heard before the lease, still fresh at ``now``, becomes the worker's credit view: a new
        worker takes dispatches at its registration instead of at its next heartbeat."""
        early = self.early_credits.pop(worker_id, None)
        if early is not None and now is not None and now - early[0] <= self.stale_after_s:
            self.on_credits(worker_id, *early[1])

    def speed(self, now: float) -> tuple[float, float]:
        """(step ms, prefill tokens/s): medians over leased workers with fresh credits and a measurement;
        (0, 0) when none measured (no prediction)."""
        fresh = [w for w in self.workers.values() if w.leased and now - w.last_credit_ts <= self.stale_after_s]
        return (_median([w.step_ms for w in fresh if w.step_ms > 0]),
                _median([w.prefill_tokens_per_s for w in fresh if w.prefill_tokens_per_s > 0]))

    def fits_nowhere(self, num_prompt_tokens: int, now: float) -> bool:
        """True when live workers with fresh credits exist and none could ever hold the prompt (+1 token).

        Such a request must be refused (it would otherwise block the queue head until its deadline);
        with no fresh worker at all the answer is False (wait for capacity instead)."""
        fresh = [w for w in self.workers.values()
                 if w.leased and w.total_blocks and now - w.last_credit_ts <= self.stale_after_s]
        return bool(fresh) and all(w.total_blocks < w.blocks_for(num_prompt_tokens + 1) for w in fresh)

    def pick(self, num_prompt_tokens: int, now: float, affinity=None) -> WorkerView | None:
        """Worker that can take the request, or None = no room.

        ``affinity(worker) -> int`` (e.g. cached prefix blocks) ranks first when given, but only among
        workers whose free slots are within ``balance_fraction`` of their slots (at least 1) of the most
        free one: a prefix every request shares (a chat template's system prompt) must not pile all load
        on one worker (the balance threshold of SGLang's cache-aware router works the same way). Ties
        and the default go to the least loaded (most free slots, then blocks), then to the least recently
        dispatched: equally loaded workers take turns, and a new worker takes the next request instead of
        waiting until the others are busy."""
        able = [w for w in self.workers.values() if w.can_take(num_prompt_tokens, now, self.stale_after_s)]
        if not able:
            return None
        if affinity is not None:
            most_free = max(w.free_slots for w in able)
            able = [w for w in able
                    if w.free_slots >= most_free - max(1, int(w.total_slots * self.balance_fraction))]
        score = affinity or (lambda w: 0)
        return max(able, key=lambda w: (score(w), w.free_slots, w.free_blocks, -w.last_take))

    def pick_random(self, num_prompt_tokens: int, now: float, rng) -> WorkerView | None:
        """A uniformly random worker among those that can take the request (benchmark baseline)."""
        able = [w for w in self.workers.values() if w.can_take(num_prompt_tokens, now, self.stale_after_s)]
        return rng.choice(able) if able else None

    def on_first_token(self, request_id: str) -> None:
        """Mark a request as having streamed a token (no re-dispatch after a worker loss)."""
        for w in self.workers.values():
            if request_id in w.inflight:
                w.inflight[request_id] = True

    def on_done(self, request_id: str, finished_ts: float = 0.0) -> None:
        """Forget a finished request. With ``finished_ts`` (worker clock, epoch s) after the worker's last
        heartbeat, that heartbeat still counted the request: its slot is given back now instead of at the
        next heartbeat (up to 250 ms later, an idle slot under load; the next heartbeat replaces the view)."""
        for w in self.workers.values():
            if w.inflight.pop(request_id, None) is not None and finished_ts > w.credit_sent_ts > 0:
                w.free_slots = min(w.total_slots or w.free_slots + 1, w.free_slots + 1)

    def on_refused(self, worker_id: str, request_id: str) -> None:
        """A dispatch was refused or unanswered: undo it and distrust the worker until its next heartbeat."""
        w = self.workers.get(worker_id)
        if w:
            w.inflight.pop(request_id, None)
            w.free_slots = 0

    def total_slots(self) -> int:
        """Sequence slots of every leased worker."""
        return sum(w.total_slots for w in self.workers.values() if w.leased)

    def num_inflight(self) -> int:
        """Requests dispatched and not yet done, all workers."""
        return sum(len(w.inflight) for w in self.workers.values())


def _median(values: list[float]) -> float:
    """Median of ``values`` (upper middle), 0.0 when empty."""
    return sorted(values)[len(values) // 2] if values else 0.0


def tenant_cap(total_slots: int, headroom_fraction: float, weight_share: float = 0.0) -> int:
    """Most in-flight requests one tenant may hold: all slots but a reserved headroom (>= 1 slot), or its
    weighted share of the slots (``weight_share`` = its weight / the active tenants' total), whichever
    is larger.

    The headroom keeps a free slot for a newly arriving tenant so fairness holds in the running batch
    without preemption (docs/decisions/0009-fair-scheduling.md). With few slots the headroom alone would
    split them evenly (2 slots: one each, whatever the weights); the weighted share lets the weighted
    fair queue decide how they are shared. With 0 or 1 slots in all, the cap is 1.
    """
    if total_slots <= 1:
        return 1
    reserve = max(1, math.ceil(total_slots * headroom_fraction))
    return max(1, total_slots - reserve, math.ceil(total_slots * weight_share - 1e-9))


def weight_share(tenant: str, weights: dict[str, float]) -> float:
    """``tenant``'s weight over the sum of ``weights`` (the active tenants'); 0 when absent."""
    total = sum(weights.values())
    return weights.get(tenant, 0.0) / total if total > 0 else 0.0


def fair_slots(total_slots: int, share: float) -> int:
    """A tenant's fair number of slots: ``ceil(total_slots x share)`` (share = weight / active total)."""
    return math.ceil(total_slots * share - 1e-9)


def preemption_victim(head_tenant: str, held: dict[str, int], fair: dict[str, int],
                      running: list[tuple[str, str]]) -> str | None:
    """Request to preempt so ``head_tenant``'s queued request can run now, or None (wait instead).

    Only a tenant below its fair slots (``held[t] < fair[t]``) may displace, and only a request of the
    tenant furthest above its own fair slots; of that tenant's requests the newest (last in ``running``,
    which lists (request id, tenant) of preemptible running requests oldest first) — it has the least
    work to recompute. Each preemption thus moves the split of slots toward the weighted fair split;
    it never takes a slot from a tenant at or below its share. Recompute preemption as in vLLM (Kwon et
    al. 2023); the choice of victim tenant follows max-min fairness (docs/decisions/0018).
    """
    if held.get(head_tenant, 0) >= fair.get(head_tenant, 0):
        return None
    over = {t: n - fair.get(t, 0) for t, n in held.items() if t != head_tenant and n > fair.get(t, 0)}
    if not over:
        return None
    worst = max(sorted(over), key=lambda t: over[t])
    return next((rid for rid, t in reversed(running) if t == worst), None)


def priority_victim(head_priority: str, running: list[tuple[str, str, str]]) -> str | None:
    """Request to preempt by priority class first: for an ``interactive`` head, the newest running ``batch``
    request (whatever its tenant: an interactive request is never kept waiting by batch work); None for a
    ``batch`` head or when no batch request runs. ``running``: (request id, tenant, priority) of
    preemptible running requests, oldest first. The fair-share rule (:func:`preemption_victim`) decides
    only within a class (docs/decisions/0021-latency-isolation.md)."""
    if head_priority != "interactive":
        return None
    return next((rid for rid, _, p in reversed(running) if p == "batch"), None)


def same_class(head_priority: str, running: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """(request id, tenant) of the running requests a fair-share preemption may take for a head of
    ``head_priority``: those of its own class (a ``batch`` head never displaces ``interactive`` work)."""
    return [(rid, t) for rid, t, p in running if p == head_priority]
