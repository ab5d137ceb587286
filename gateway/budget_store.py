"""Per-tenant spend budgets shared by every gateway replica: the KV shell around gateway/budgets.py.

A request of a tenant with a budget, for a model version with a price, reserves its largest possible cost
(:func:`gateway.budgets.request_max_cost_micro`) by compare-and-swap on the tenant's spend record
(``spend.<tenant>`` in JetStream KV bucket ``as_quota``, like gateway/quotas.py) before it is submitted;
the usage meter (gateway/usage.py) settles each completion record against it; the gateway ends it when the
request ends (it then lapses within SETTLE_GRACE_S unless settled), or drops it when the request was never
submitted. A reservation whose gateway died lapses EXPIRY_MARGIN_S after the request's deadline. Tenants
without a budget and unpriced versions never touch the record (no KV round trip); the meter prices their
records for the cost report only. A store that cannot be reached refuses (503 ``budget_unavailable``):
budgets fail closed, quotas fail open.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from bus import streams
from control.policy.limits import choice_count
from bus.messages import CompletionRecord
from control.state.tenants import Budget
from gateway import budgets as rules
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

Manifests = Callable[[str, str], Awaitable["Mapping[str, Any] | None"]]  # async (name, version) -> manifest


@dataclass
class Hold:
    """A reservation taken at admission: ``amount`` micro-USD for ``request_id`` of ``tenant`` on ``model``."""

    tenant: str
    request_id: str
    amount: int
    model: str


def record_tokens(rec: CompletionRecord) -> tuple[int, int]:
    """(prompt, completion) tokens a completion record is charged for: the prompt once per request (on its
    choice 0, as the usage meter counts), the generated tokens; nothing for a request refused before it
    reached a worker (a scheduler's refusal record: no worker, nothing generated)."""
    completion = int(rec.completion_tokens or 0)
    if not rec.worker_id and completion == 0:
        return 0, 0
    return (int(rec.prompt_tokens or 0) if rec.choice_index == 0 else 0), completion


class BudgetGate:
    """Reservations and settlements on the spend records (one per gateway, or per jobs actor).

    ``js``: what opens buckets (``bus.jetstream.JetStream`` or ``bus.kv.MemoryBuckets``); ``budget_of``:
    tenant id -> its Budget or None (the gateway's tenant cache); ``manifests``: (name, version) -> manifest
    dict or None, awaited (the gateway's model snapshot, gateway.tenancy.ManifestCache), for the prices of
    records the meter settles. Every KV call is bounded by ``timeout`` seconds."""

    def __init__(self, js, *, budget_of: Callable[[str], Budget | None], manifests: Manifests,
                 timeout: float = 2.0) -> None:
        self.js, self.budget_of, self.manifests, self.timeout = js, budget_of, manifests, timeout
        self.kv = None

    async def open(self) -> None:
        """Bind the bucket (``bus.streams.QUOTAS``, shared with the quotas)."""
        self.kv = await self.js.bucket(streams.QUOTAS, self.timeout)

    @staticmethod
    def pricing(manifest: Mapping[str, Any] | None, ref: str) -> rules.Pricing | None:
        """A manifest's prices (None: free, unknown, or a malformed pricing, which is logged)."""
        try:
            return rules.Pricing.of(manifest)
        except ValueError as exc:
            log.warning("pricing of %s ignored: %s", ref, exc)
            return None

    # -- admission ---------------------------------------------------------------------------------

    async def reserve(self, tenant_id: str, budget: Budget | None, endpoint: str, body: dict, request_id: str,
                      deadline_ms: int, name: str, version: str, manifest: Mapping[str, Any] | None,
                      headers: dict, now: float | None = None) -> Hold | None:
        """Reserve the request's largest cost against the tenant's budget; None when nothing is reserved (no
        budget, no price). Raises ApiError 429 ``budget_exhausted`` when it does not fit, 503
        ``budget_unavailable`` when the record cannot be reached. Adds ``x-actorserve-budget-remaining-usd``."""
        model = f"{name}@{version}"
        price = self.pricing(manifest, model) if budget is not None else None
        if price is None or manifest is None:
            return None
        now = time.time() if now is None else now
        amount = rules.request_max_cost_micro(endpoint, body, manifest, price)
        pid, limit = rules.period_id(budget.period, now), budget.micro_usd
        expires = now + deadline_ms / 1e3 + rules.EXPIRY_MARGIN_S
        n = choice_count(endpoint, body)
        try:
            res = await self.kv.update(rules.spend_key(tenant_id), lambda v: rules.reserve(
                v, request_id=request_id, amount=amount, budget=limit, pid=pid, now=now, expires_at=expires,
                choices=n, price=price, model=model))
        except Exception as exc:
            log.warning("spend record of %s unavailable (%r); refusing", tenant_id, exc)
            raise rules.unavailable(tenant_id) from None
        if not res.changed:
            raise rules.exhausted(tenant_id, budget.period, limit, res.value, amount, model, now)
        left = max(0, limit - res.value["s"] - rules.reserved(res.value))
        headers["x-actorserve-budget-remaining-usd"] = f"{rules.usd(left):.6f}"
        return Hold(tenant_id, request_id, amount, model)

    async def end(self, hold: Hold | None, submitted: bool = True) -> None:
        """The request of ``hold`` ended: let its reservation lapse within SETTLE_GRACE_S (submitted) or drop
        it at once (never submitted). Errors are logged: the reservation then lapses at its expiry."""
        if hold is None:
            return
        now = time.time()
        change = (lambda v: rules.end(v, hold.request_id, now)) if submitted else (
            lambda v: rules.drop(v, hold.request_id))
        try:
            await self.kv.update(rules.spend_key(hold.tenant), change)
        except Exception as exc:
            log.warning("ending the reservation of %s failed (%r); it lapses on its own", hold.request_id, exc)

    # -- settlement (the usage meter) ----------------------------------------------------------------

    async def settle(self, rec: CompletionRecord) -> int:
        """Settle one completion record; returns its cost in pico-USD (for the usage record). Only tenants
        with a budget touch the spend record. Raises the KV's errors (the meter then redelivers)."""
        prompt, completion = record_tokens(rec)
        price = self.pricing(await self.manifests(rec.name, rec.version), f"{rec.name}@{rec.version}")
        budget = self.budget_of(rec.tenant)
        if budget is None:
            return price.cost_pico(prompt, completion) if price is not None else 0
        now = time.time()
        box = [0]

        def change(v):
            new, box[0] = rules.settle(v, record_id=rec.request_id, choice=rec.choice_index, prompt_tokens=prompt,
                                       completion_tokens=completion, price=price, budget=budget.micro_usd,
                                       pid=rules.period_id(budget.period, now), now=now,
                                       model=f"{rec.name}@{rec.version}")
            return new
        await self.kv.update(rules.spend_key(rec.tenant), change)
        return box[0]

    # -- report ----------------------------------------------------------------------------------------

    async def view(self, tenant_id: str, budget: Budget | None, now: float | None = None) -> dict | None:
        """The budget part of the cost report (gateway.budgets.view), None without a budget."""
        if budget is None:
            return None
        e = await self.kv.get(rules.spend_key(tenant_id))
        return rules.view(e.value if e is not None else None, budget.micro_usd, budget.period,
                          time.time() if now is None else now)


async def reserve_request(gate: BudgetGate | None, snapshot, req) -> Hold | None:
    """Reserve for a pipeline request (gateway.pipeline.Request) before its submit: the version is resolved
    from ``snapshot`` (the gateway's gateway.models.ModelSnapshot) as ``Frontend.submit`` will resolve it (same
    tenant and request key). None when nothing is reserved: no gate, no budget, an unpriced version, or a
    model the resolver refuses (the submit then answers its 400 / 404)."""
    if gate is None:
        return None
    budget = req.tenant.budget if req.tenant is not None else gate.budget_of(req.tenant_id)
    model = req.body.get("model")
    if budget is None or not isinstance(model, str):
        return None
    try:
        name, version = snapshot.resolve(model, tenant=req.tenant_id, request_key=req.request_id)
    except ApiError:
        return None
    return await gate.reserve(req.tenant_id, budget, req.endpoint, req.body, req.request_id, req.deadline_ms,
                              name, version, snapshot.versions.get(name, {}).get(version), req.headers)
