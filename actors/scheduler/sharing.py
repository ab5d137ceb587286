"""Who may displace whom, who is urgent, and the per-tenant service figures: the fair-share side of the
scheduler service (``SchedulerService`` mixes this in; the arithmetic is in ``policy``, ``vtc``).

Priority class first, then fair share (docs/decisions/0018-fair-share-preemption.md,
docs/decisions/0021-latency-isolation.md). Reads the service's state: ``cfg``, ``table`` (workers),
``requests`` (dispatched, not done), ``_preempted``, ``weights``, ``_seen`` (last submit per tenant),
``ledger`` (tokens served) and ``_labels`` (bounded tenant labels).
"""

from __future__ import annotations

import time

from actors.scheduler.policy import fair_slots, preemption_victim, priority_victim, same_class, tenant_cap, weight_share
from bus.messages import GenerateRequest

URGENT_SHARE_FRACTION = 0.9  # below this fraction of its weight's share of the service, a tenant is urgent


class FairShareMixin:
    """Fair-share decisions of one scheduler (no I/O: every method reads the service's state)."""

    def _displace(self, head: GenerateRequest):
        """(worker, victim request id) that makes room for ``head`` by preemption, else (None, "").

        Priority class first: an ``interactive`` head displaces the newest running ``batch`` request of
        any tenant. Then fair share within the head's class: a tenant below its fair slots displaces a
        request of the tenant furthest above its own (``policy.preemption_victim``); a ``batch`` head
        never displaces ``interactive`` work (docs/decisions/0021-latency-isolation.md)."""
        if not self.cfg.preemption or self.cfg.fcfs:
            return None, ""
        where, running = self._preemptible(head)
        victim = priority_victim(head.priority, running)
        active = self._active_tenants()
        if victim is None and head.tenant in active and len(active) >= 2:
            victim = preemption_victim(head.tenant, self._held(), self._fair(active),
                                       same_class(head.priority, running))
        return (where[victim], victim) if victim else (None, "")

    def _preemptible(self, head: GenerateRequest):
        """({request id: worker}, [(request id, tenant, priority)]) of the running requests a preemption
        for ``head`` could take: on workers that could hold its prompt, not already preempted. Ordered
        (streamed a token, dispatch time): the victim is the last of its kind, so the newest request
        already decoding; one still prefilling or waiting in the engine only when none of that kind is
        decoding (the worker refuses a victim that is not running)."""
        now, where, order = time.monotonic(), {}, []
        for w in self.table.workers.values():
            if w.can_take_preempting(len(head.prompt_token_ids), now, self.table.stale_after_s):
                for rid in w.inflight:
                    if rid in self.requests and rid not in self._preempted:
                        where[rid] = w
                        order.append((w.inflight[rid], self.requests[rid].marks.get("dispatch", 0.0), rid))
        order.sort()
        return where, [(rid, self.requests[rid].tenant, self.requests[rid].priority) for _, _, rid in order]

    def _fair(self, active: list[str]) -> dict[str, int]:
        """Fair slots of each active tenant (weighted share of every leased worker's slots)."""
        total = self.table.total_slots()
        weights = {t: self.weights.get(t, 1.0) for t in active}
        return {t: fair_slots(total, weight_share(t, weights)) for t in active}

    def _urgent(self, req: GenerateRequest, worker_id: str) -> bool:
        """Whether the worker should give ``req``'s prefill the next step: it is ``interactive`` and ``batch``
        work runs there, or, while another tenant is active, its tenant holds fewer than its fair slots or
        got less than ``URGENT_SHARE_FRACTION`` of its weight's share of the tokens served in the last
        minute (the VTC currency; the margin keeps two tenants at an even split from taking turns)."""
        if self.cfg.fcfs or not self.cfg.urgent:
            return False
        w = self.table.workers.get(worker_id)
        if req.priority == "interactive" and w is not None and any(
                self.requests[r].priority == "batch" for r in w.inflight if r in self.requests):
            return True
        active = self._active_tenants()
        if len(active) < 2 or req.tenant not in active:
            return False
        if self._held().get(req.tenant, 0) < self._fair(active).get(req.tenant, 0):
            return True
        weights = {t: self.weights.get(t, 1.0) for t in active}
        share = self.ledger.shares(time.monotonic()).get(req.tenant, 0.0)
        return share < URGENT_SHARE_FRACTION * weight_share(req.tenant, weights)

    def service_rows(self) -> list[tuple[int, dict]]:
        """(tokens, labels) per tenant and kind for ``actorserve_tenant_service_tokens_total``."""
        model, lim, out = f"{self.cfg.name}@{self.cfg.version}", self._labels, []
        for kind, counts in (("prompt", self.ledger.prompt_tokens), ("completion", self.ledger.completion_tokens)):
            out += [(n, {"model": model, "tenant": lim(t), "kind": kind}) for t, n in list(counts.items())]
        return out

    def share_rows(self) -> tuple[list[tuple[float, dict]], list[tuple[float, dict]]]:
        """(service share rows, weight share rows) per tenant: what each got against what it is due."""
        model, now = f"{self.cfg.name}@{self.cfg.version}", time.monotonic()
        weights = {t: self.weights.get(t, 1.0) for t in self._active_tenants()}
        served = [(v, {"model": model, "tenant": self._labels(t)}) for t, v in self.ledger.shares(now).items()]
        due = [(weight_share(t, weights), {"model": model, "tenant": self._labels(t)}) for t in weights]
        return served, due

    def _active_tenants(self) -> list[str]:
        """Tenants that submitted within ``tenant_active_s``."""
        now = time.monotonic()
        return [t for t, ts in self._seen.items() if now - ts <= self.cfg.tenant_active_s]

    def _held(self) -> dict[str, int]:
        """Dispatched, unfinished requests per tenant (preempted ones included: they still hold a place)."""
        held: dict[str, int] = {}
        for r in self.requests.values():
            held[r.tenant] = held.get(r.tenant, 0) + 1
        return held

    def _tenants_at_cap(self) -> frozenset[str]:
        """Tenants holding their maximum share of slots (skipped while others wait; fcfs: none)."""
        active = self._active_tenants()
        if self.cfg.fcfs or len(active) < 2:  # one tenant alone may use every slot
            return frozenset()
        total = self.table.total_slots()
        weights = {t: self.weights.get(t, 1.0) for t in active}
        held = self._held()
        return frozenset(t for t, n in held.items()
                         if n >= tenant_cap(total, self.cfg.headroom_fraction, weight_share(t, weights)))
