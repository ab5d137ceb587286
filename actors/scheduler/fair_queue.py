"""Per-tenant weighted fair queueing with priority classes, deadlines and bounded queues.

Pure module (no torch, no nats, no clock reads: callers pass ``now``).

Algorithm: start-time fair queueing (Goyal, Vin & Cheng, SIGCOMM 1996) over tenants, one instance
per priority class, classes served in strict priority order (``interactive`` before ``batch``).
Each tenant ``t`` has a virtual finish tag ``F_t``; a request of cost ``c`` tokens (prompt +
max_tokens estimate) arriving when the class's virtual time is ``V`` gets start tag
``S = max(V, F_t)`` and finish tag ``F_t = S + c / w_t``. The request with the smallest start tag is
served next and ``V`` advances to it. A tenant that stayed idle does not bank credit (``max`` with
``V``); a heavy tenant's tags run ahead, so a light tenant's requests are served first. When the
actual cost is known (completion record), the difference ``actual - estimate`` is charged to the
tenant's tag (vLLM-style estimate correction; negative = refund).

Within one tenant, requests are ordered earliest deadline first (EDF). ``admit`` refuses with
``QUEUE_FULL_TENANT`` (HTTP 429), ``QUEUE_FULL`` (503) or ``DEADLINE_UNMEETABLE`` (503) when the
estimated wait (queued tokens of equal or higher priority / measured throughput) would pass the
request's deadline. The wait counts only requests already queued (a backlog means the measured rate
is the system's capacity; an idle system's rate says nothing about it).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

R = TypeVar("R")

PRIORITY_ORDER = ("interactive", "batch")  # served in this order (strict priority)

# The fairness currency: weighted tokens served (Virtual Token Counter, Sheng et al., "Fairness in Serving
# Large Language Models", OSDI '24, whose evaluation weighs an output token twice an input token: w_p = 1,
# w_q = 2). A decode token costs a whole step of the running batch; prompt tokens are batched in one pass.
PROMPT_TOKEN_WEIGHT = 1.0
COMPLETION_TOKEN_WEIGHT = 2.0


def service_tokens(prompt_tokens: float, completion_tokens: float) -> float:
    """Weighted service (tokens) of ``prompt_tokens`` prefilled and ``completion_tokens`` generated."""
    return PROMPT_TOKEN_WEIGHT * prompt_tokens + COMPLETION_TOKEN_WEIGHT * completion_tokens

ADMITTED = "admitted"
QUEUE_FULL_TENANT = "queue_full_tenant"  # tenant's own queue full -> 429
QUEUE_FULL = "queue_full"  # whole queue full -> 503
DEADLINE_UNMEETABLE = "deadline_unmeetable"  # cannot finish before its deadline -> 503


@dataclass(frozen=True)
class FairQueueConfig:
    """Bounds of the queue. ValueError on bad values."""

    max_total: int = 1024  # queued requests, all tenants (503 above)
    max_per_tenant: int = 256  # queued requests per tenant (429 above)
    fcfs: bool = False  # True: plain first-come-first-served (for comparison benchmarks)

    def __post_init__(self) -> None:
        if self.max_total < 1 or self.max_per_tenant < 1:
            raise ValueError("queue bounds must be >= 1")


@dataclass(order=True)
class _Entry(Generic[R]):
    sort_key: tuple  # (deadline or inf, arrival seq) within the tenant
    request_id: str = field(compare=False)
    cost: float = field(compare=False)  # estimated tokens
    deadline: float = field(compare=False)  # epoch s, 0 = none
    item: R = field(compare=False)


@dataclass
class _Tenant(Generic[R]):
    weight: float
    finish_tag: float = 0.0  # F_t (virtual tokens)
    queue: list = field(default_factory=list)  # heap of _Entry (EDF)


class _ClassQueue(Generic[R]):
    """Start-time fair queueing over tenants inside one priority class."""

    def __init__(self) -> None:
        self.tenants: dict[str, _Tenant[R]] = {}
        self.vtime = 0.0  # V: start tag of the last request served
        self.num_queued = 0
        self.queued_cost = 0.0  # tokens waiting in this class

    def push(self, tenant: str, weight: float, entry: _Entry[R]) -> None:
        t = self.tenants.setdefault(tenant, _Tenant(weight))
        t.weight = weight
        if not t.queue:  # idle tenant: no banked credit
            t.finish_tag = max(t.finish_tag, self.vtime)
        heapq.heappush(t.queue, entry)
        self.num_queued += 1
        self.queued_cost += entry.cost

    def head_tenant(self, skip: frozenset[str] = frozenset()) -> str | None:
        """Tenant (not in ``skip``) whose head request has the smallest start tag."""
        best = None
        for name, t in self.tenants.items():
            if name in skip:
                continue
            if t.queue and (best is None or t.finish_tag < self.tenants[best].finish_tag):
                best = name
        return best

    def pop(self, tenant: str) -> _Entry[R]:
        t = self.tenants[tenant]
        entry = heapq.heappop(t.queue)
        self.vtime = max(self.vtime, t.finish_tag)
        t.finish_tag += entry.cost / t.weight
        self.num_queued -= 1
        self.queued_cost -= entry.cost
        return entry

    def remove(self, request_id: str) -> _Entry[R] | None:
        for t in self.tenants.values():
            for i, e in enumerate(t.queue):
                if e.request_id == request_id:
                    t.queue.pop(i)
                    heapq.heapify(t.queue)
                    self.num_queued -= 1
                    self.queued_cost -= e.cost
                    return e
        return None

    def charge(self, tenant: str, tokens: float) -> None:
        """Add ``tokens`` (may be negative) of cost to a tenant's finish tag (estimate correction)."""
        t = self.tenants.get(tenant)
        if t is not None:
            t.finish_tag = max(self.vtime, t.finish_tag + tokens / t.weight) if tokens < 0 else \
                t.finish_tag + tokens / t.weight


@dataclass(frozen=True)
class Popped(Generic[R]):
    """The next request to dispatch."""

    request_id: str
    tenant: str
    priority: str
    cost: float  # estimated tokens
    item: R


class FairQueue(Generic[R]):
    """Priority classes x tenants, WFQ by token cost, EDF within a tenant, bounded."""

    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self.cfg = config or FairQueueConfig()
        self.classes = {p: _ClassQueue() for p in PRIORITY_ORDER}
        self._seq = itertools.count()
        self._where: dict[str, tuple[str, str]] = {}  # request id -> (priority, tenant)

    def __len__(self) -> int:
        return len(self._where)

    def contains(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued."""
        return request_id in self._where

    def tenant_of(self, request_id: str) -> str | None:
        """Tenant of a queued request, None when it is not queued."""
        where = self._where.get(request_id)
        return where[1] if where else None

    def num_queued(self, tenant: str) -> int:
        """Requests of ``tenant`` waiting, all classes."""
        return sum(len(c.tenants[tenant].queue) for c in self.classes.values() if tenant in c.tenants)

    def tokens_ahead(self, priority: str, tenant: str | None = None, weight: float = 1.0,
                     cost: float = 0.0) -> float:
        """Estimated tokens served before a new request of ``tenant`` (cost ``cost``) at ``priority``.

        Higher classes count whole. In its own class the fair order counts the tenant's own backlog
        ``q`` plus, from each other tenant ``o``, at most ``(q + cost) * w_o / w`` tokens (what fair
        share serves of ``o`` meanwhile). ``tenant`` None (FCFS view): the whole class counts.
        """
        rank = PRIORITY_ORDER.index(priority)
        ahead = sum(self.classes[p].queued_cost for p in PRIORITY_ORDER[:rank])
        cls = self.classes[priority]
        if tenant is None or self.cfg.fcfs:
            return ahead + cls.queued_cost
        own = sum(e.cost for e in cls.tenants[tenant].queue) if tenant in cls.tenants else 0.0
        for name, t in cls.tenants.items():
            if name != tenant:
                ahead += min(sum(e.cost for e in t.queue), (own + cost) * t.weight / weight)
        return ahead + own

    def can_admit(self, tenant: str, priority: str, cost: float, deadline: float, now: float,
                  tokens_per_s: float | None, weight: float = 1.0, own_s: float = 0.0) -> str:
        """ADMITTED or the refusal reason. ``tokens_per_s``: measured service rate (None = unknown);
        ``own_s``: the request's own predicted time from its turn on: the wait for a free slot plus its
        prefill and decode (s; ``vtc.predict_service_s``). Refused as DEADLINE_UNMEETABLE when ``now`` + the
        wait for the queue ahead + ``own_s`` passes ``deadline`` (epoch s)."""
        if self.num_queued(tenant) >= self.cfg.max_per_tenant:
            return QUEUE_FULL_TENANT
        if len(self) >= self.cfg.max_total:
            return QUEUE_FULL
        if not deadline:
            return ADMITTED
        wait_s = self.wait_s(priority, tenant, weight, cost, tokens_per_s)
        if (wait_s or own_s) and now + wait_s + own_s > deadline:
            return DEADLINE_UNMEETABLE
        return ADMITTED

    def wait_s(self, priority: str, tenant: str, weight: float, cost: float, tokens_per_s: float | None) -> float:
        """Estimated seconds a new request (cost ``cost`` tokens) of ``tenant`` waits for the queued tokens
        served before it (:meth:`tokens_ahead`) at ``tokens_per_s``; 0 without a backlog or a measured rate
        (only a backlog makes the measured rate a capacity estimate: an idle system's rate says nothing)."""
        ahead = self.tokens_ahead(priority, tenant, weight, cost)
        return ahead / tokens_per_s if tokens_per_s and ahead > 0 else 0.0

    def push(self, request_id: str, tenant: str, weight: float, priority: str, cost: float, deadline: float,
             item: R, front: bool = False) -> None:
        """Queue a request (no bound check: call ``can_admit`` first). ``front``: re-queue a popped request
        ahead of its tenant's others, refunding the cost its pop charged (it is charged again when popped
        again; without the refund a tenant pays for every refused dispatch)."""
        if priority not in self.classes:
            raise ValueError(f"unknown priority class {priority!r}")
        if weight <= 0:
            raise ValueError("tenant weight must be > 0")
        seq = -next(self._seq) if front else next(self._seq)
        key = (float("-inf"),) if front else ((deadline or float("inf")),)
        if self.cfg.fcfs:
            tenant, weight, priority = "*", 1.0, PRIORITY_ORDER[0]
            key = (float("-inf") if front else 0.0,)
        self.classes[priority].push(tenant, weight, _Entry(key + (seq,), request_id, cost, deadline, item))
        if front:  # a popped request comes back (dispatch refused, worker lost): undo the charge of its pop
            self.classes[priority].charge(tenant, -cost)
        self._where[request_id] = (priority, tenant)

    def peek(self, skip: frozenset[str] = frozenset()) -> tuple[str, str, str] | None:
        """(priority, tenant, request id) of the next request of a tenant not in ``skip``; None if none."""
        for p in PRIORITY_ORDER:
            t = self.classes[p].head_tenant(skip)
            if t is not None:
                return p, t, self.classes[p].tenants[t].queue[0].request_id
        return None

    def peek_item(self, skip: frozenset[str] = frozenset()) -> R | None:
        """The item ``pop(skip)`` would return next, or None."""
        head = self.peek(skip)
        return None if head is None else self.classes[head[0]].tenants[head[1]].queue[0].item

    def pop(self, skip: frozenset[str] = frozenset()) -> Popped[R] | None:
        """Remove and return the next request of a tenant not in ``skip``, or None."""
        head = self.peek(skip)
        if head is None:
            return None
        p, t, _ = head
        e = self.classes[p].pop(t)
        del self._where[e.request_id]
        return Popped(e.request_id, t, p, e.cost, e.item)

    def remove(self, request_id: str) -> R | None:
        """Remove a queued request (cancel). Returns its item or None."""
        where = self._where.pop(request_id, None)
        if where is None:
            return None
        e = self.classes[where[0]].remove(request_id)
        return e.item if e else None

    def pop_expired(self, now: float) -> list[R]:
        """Remove and return every queued item whose deadline (epoch s) has passed."""
        out = []
        for c in self.classes.values():
            for t in c.tenants.values():
                for e in [e for e in t.queue if e.deadline and e.deadline < now]:
                    c.remove(e.request_id)
                    self._where.pop(e.request_id, None)
                    out.append(e.item)
        return out

    def correct(self, tenant: str, priority: str, estimated: float, actual: float) -> None:
        """Charge the tenant the difference between actual and estimated cost (tokens)."""
        if self.cfg.fcfs or priority not in self.classes:
            return
        self.classes[priority].charge(tenant, actual - estimated)
