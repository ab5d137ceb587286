"""Fair share of one scheduler: who may displace whom, who is urgent, which tenants are at their cap, and
the per-tenant service figures (the arithmetic is in ``policy``, ``vtc``).

Priority class first, then fair share (docs/decisions/0018-fair-share-preemption.md,
docs/decisions/0021-latency-isolation.md). :class:`FairShare` owns its state (which requests were preempted
and not done, when each tenant last submitted, the bounded tenant labels) and reads what its scheduler
owns through :class:`ShareHost`: the worker table, the dispatched requests, the tenants' weights and the
ledger of tokens served. No I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Protocol

from actors.metrics import LabelLimiter
from actors.scheduler.policy import (WorkerTable, fair_slots, preemption_victim, priority_victim, same_class,
                                     tenant_cap, weight_share)
from actors.scheduler.vtc import ServiceLedger
from bus.messages import GenerateRequest

URGENT_SHARE_FRACTION = 0.9  # below this fraction of its weight's share of the service, a tenant is urgent


@dataclass(frozen=True)
class FairShareConfig:
    """The fair-share settings of one scheduler (from its ``SchedulerConfig``). ValueError on bad values."""

    model: str  # "name@version", the ``model`` label of the service figures
    fcfs: bool = False  # first-come-first-served: no caps, no preemption, nothing urgent
    preemption: bool = True  # a tenant below its fair slots may displace an over-share tenant's request
    urgent: bool = True  # mark dispatches of under-share tenants / interactive-over-batch urgent
    tenant_active_s: float = 60.0  # a tenant that submitted within this window counts as active (s)
    headroom_fraction: float = 0.125  # share of all slots one tenant may not take (kept for newcomers)

    def __post_init__(self) -> None:
        if self.tenant_active_s < 0:
            raise ValueError("tenant_active_s must be >= 0")
        if not 0.0 <= self.headroom_fraction < 1.0:
            raise ValueError("headroom_fraction must be in [0, 1)")


class ShareHost(Protocol):
    """What :class:`FairShare` reads of its scheduler (the scheduler owns and writes these)."""

    table: WorkerTable  # leased workers, their slots and in-flight requests
    requests: dict[str, GenerateRequest]  # dispatched, not done
    weights: dict[str, float]  # tenant -> fair-share weight (absent: 1)
    ledger: ServiceLedger  # tokens served per tenant


class FairShare:
    """Fair-share state and decisions of one scheduler (see module docstring)."""

    def __init__(self, config: FairShareConfig, host: ShareHost) -> None:
        self.cfg, self.host = config, host
        self._preempted: set[str] = set()  # requests preempted on their worker and not done yet
        self._seen: dict[str, float] = {}  # tenant -> last submit (monotonic s)
        self._labels = LabelLimiter()  # bounded tenant label values of the service figures

    # ---- what the scheduler tells it ------------------------------------------------------------
    def submitted(self, tenant: str, now: float | None = None) -> None:
        """``tenant`` submitted a request at ``now`` (monotonic s; default: now): it is active."""
        self._seen[tenant] = time.monotonic() if now is None else now

    def preempted(self, request_id: str) -> None:
        """``request_id`` was preempted on its worker (or refused as a victim): not chosen again until it runs."""
        self._preempted.add(request_id)

    def ended(self, request_id: str) -> None:
        """``request_id`` is done or lost."""
        self._preempted.discard(request_id)

    def running_again(self, held: Iterable[str], num_waiting: int, paused: list[str] | None) -> None:
        """A worker's heartbeat: of the requests it ``held``, those not ``paused`` run again (may be chosen
        again). A worker that does not list its paused requests (``paused`` not a list) says so only when
        nothing waits there (``num_waiting == 0``)."""
        if num_waiting == 0 or isinstance(paused, list):
            self._preempted.difference_update(set(held) - set(paused or ()))

    # ---- decisions -------------------------------------------------------------------------------
    def displace(self, head: GenerateRequest):
        """(worker, victim request id) that makes room for ``head`` by preemption, else (None, "").

        Priority class first: an ``interactive`` head displaces the newest running ``batch`` request of
        any tenant. Then fair share within the head's class: a tenant below its fair slots displaces a
        request of the tenant furthest above its own (``policy.preemption_victim``); a ``batch`` head
        never displaces ``interactive`` work (docs/decisions/0021-latency-isolation.md)."""
        if not self.cfg.preemption or self.cfg.fcfs:
            return None, ""
        where, running = self._preemptible(head)
        victim = priority_victim(head.priority, running)
        active = self.active_tenants()
        if victim is None and head.tenant in active and len(active) >= 2:
            victim = preemption_victim(head.tenant, self.held(), self._fair(active),
                                       same_class(head.priority, running))
        return (where[victim], victim) if victim else (None, "")

    def _preemptible(self, head: GenerateRequest):
        """({request id: worker}, [(request id, tenant, priority)]) of the running requests a preemption
        for ``head`` could take: on workers that could hold its prompt, not already preempted. Ordered
        (streamed a token, dispatch time): the victim is the last of its kind, so the newest request
        already decoding; one still prefilling or waiting in the engine only when none of that kind is
        decoding (the worker refuses a victim that is not running)."""
        table, requests = self.host.table, self.host.requests
        now, where, order = time.monotonic(), {}, []
        for w in table.workers.values():
            if w.can_take_preempting(len(head.prompt_token_ids), now, table.stale_after_s):
                for rid in w.inflight:
                    if rid in requests and rid not in self._preempted:
                        where[rid] = w
                        order.append((w.inflight[rid], requests[rid].marks.get("dispatch", 0.0), rid))
        order.sort()
        return where, [(rid, requests[rid].tenant, requests[rid].priority) for _, _, rid in order]

    def _weights(self, tenants: Iterable[str]) -> dict[str, float]:
        return {t: self.host.weights.get(t, 1.0) for t in tenants}

    def _fair(self, active: list[str]) -> dict[str, int]:
        """Fair slots of each active tenant (weighted share of every leased worker's slots)."""
        total = self.host.table.total_slots()
        weights = self._weights(active)
        return {t: fair_slots(total, weight_share(t, weights)) for t in active}

    def urgent(self, req: GenerateRequest, worker_id: str) -> bool:
        """Whether the worker should give ``req``'s prefill the next step: it is ``interactive`` and ``batch``
        work runs there, or, while another tenant is active, its tenant holds fewer than its fair slots or
        got less than ``URGENT_SHARE_FRACTION`` of its weight's share of the tokens served in the last
        minute (the VTC currency; the margin keeps two tenants at an even split from taking turns)."""
        if self.cfg.fcfs or not self.cfg.urgent:
            return False
        requests = self.host.requests
        w = self.host.table.workers.get(worker_id)
        if req.priority == "interactive" and w is not None and any(
                requests[r].priority == "batch" for r in w.inflight if r in requests):
            return True
        active = self.active_tenants()
        if len(active) < 2 or req.tenant not in active:
            return False
        if self.held().get(req.tenant, 0) < self._fair(active).get(req.tenant, 0):
            return True
        share = self.host.ledger.shares(time.monotonic()).get(req.tenant, 0.0)
        return share < URGENT_SHARE_FRACTION * weight_share(req.tenant, self._weights(active))

    def tenants_at_cap(self) -> frozenset[str]:
        """Tenants holding their maximum share of slots (skipped while others wait; fcfs: none)."""
        active = self.active_tenants()
        if self.cfg.fcfs or len(active) < 2:  # one tenant alone may use every slot
            return frozenset()
        total = self.host.table.total_slots()
        weights = self._weights(active)
        return frozenset(t for t, n in self.held().items()
                         if n >= tenant_cap(total, self.cfg.headroom_fraction, weight_share(t, weights)))

    # ---- figures ---------------------------------------------------------------------------------
    def active_tenants(self) -> list[str]:
        """Tenants that submitted within ``tenant_active_s``."""
        now = time.monotonic()
        return [t for t, ts in self._seen.items() if now - ts <= self.cfg.tenant_active_s]

    def held(self) -> dict[str, int]:
        """Dispatched, unfinished requests per tenant (preempted ones included: they still hold a place)."""
        held: dict[str, int] = {}
        for r in self.host.requests.values():
            held[r.tenant] = held.get(r.tenant, 0) + 1
        return held

    def service_rows(self) -> list[tuple[int, dict]]:
        """(tokens, labels) per tenant and kind for ``actorserve_tenant_service_tokens_total``."""
        model, lim, ledger, out = self.cfg.model, self._labels, self.host.ledger, []
        for kind, counts in (("prompt", ledger.prompt_tokens), ("completion", ledger.completion_tokens)):
            out += [(n, {"model": model, "tenant": lim(t), "kind": kind}) for t, n in list(counts.items())]
        return out

    def share_rows(self) -> tuple[list[tuple[float, dict]], list[tuple[float, dict]]]:
        """(service share rows, weight share rows) per tenant: what each got against what it is due."""
        model, now = self.cfg.model, time.monotonic()
        weights = self._weights(self.active_tenants())
        served = [(v, {"model": model, "tenant": self._labels(t)}) for t, v in self.host.ledger.shares(now).items()]
        due = [(weight_share(t, weights), {"model": model, "tenant": self._labels(t)}) for t in weights]
        return served, due
