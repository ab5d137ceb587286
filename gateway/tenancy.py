"""The gateway's tenancy layer, as one object the HTTP front calls: authentication (gateway/auth.py),
model access, quotas (gateway/quotas.py), spend budgets (gateway/budget_store.py), usage and cost
(gateway/usage.py) and idempotency (gateway/idempotency.py).

``HttpFront(frontend, tenancy=None)`` keeps the single-tenant behaviour (tenant ``dev``, no key) for
tests that build a gateway without etcd; ``gateway/actor.py`` always passes a Tenancy.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from control.state.tenants import Budget, Tenant
from gateway.auth import TenantCache
from gateway.budget_store import BudgetGate
from gateway.quotas import Admission, QuotaStore
from gateway.usage import UsageMeter

log = logging.getLogger(__name__)


class Tenancy:
    """Tenant cache + shared quota store + usage meter (+ idempotency store) of one gateway.

    ``registry``: connected control.state.registry.Registry; ``js``: a bus.jetstream.JetStream
    (``NatsBus.js()``; None: no quotas, budgets, usage or idempotency — authentication and model access only).
    ``models``: the gateway's gateway.models.ModelResolver (prices of the versions; None: manifests are read
    from etcd by a small cache, :class:`ManifestCache`).
    """

    def __init__(self, registry, js=None, *, gateway_id: str = "gw", models=None) -> None:
        self.cache = TenantCache(registry)
        self.quotas = QuotaStore(js) if js is not None else None
        self.manifests = ManifestCache(registry, models)
        self.budgets = (BudgetGate(js, budget_of=self.budget_of, manifests=self.manifests.get)
                        if js is not None else None)
        self.usage = UsageMeter(js, self.quotas, self.budgets) if js is not None else None
        self.idempotency = self.jobs = self.files = self.batches = None
        if js is not None:
            from gateway.idempotency import IdempotencyStore
            from gateway.batches_api import BatchesApi
            from gateway.files_api import FilesApi
            from gateway.jobs_api import JobsApi
            self.idempotency = IdempotencyStore(js, gateway_id)
            self.jobs = JobsApi(self, js)
            self.files = FilesApi(self, js)
            self.batches = BatchesApi(self, js, self.files)

    async def start(self) -> None:
        """Load tenants, open the JetStream stores and start metering."""
        await self.cache.start()
        if self.quotas is not None:
            await self.quotas.open()
            await self.budgets.open()
            await self.usage.open()
            await self.idempotency.open()
            await self.jobs.open()
            await self.files.open()

    async def stop(self) -> None:
        """Stop the watch, the meter and the slot refresher (background idempotent runs are awaited
        briefly by the idempotency store)."""
        if self.idempotency is not None:
            await self.idempotency.close()
        if self.usage is not None:
            await self.usage.close()
        if self.quotas is not None:
            await self.quotas.close()
        await self.cache.stop()

    def add_routes(self, app: web.Application) -> None:
        """Routes of the tenancy layer: ``GET /v1/usage``, the jobs, files and batches APIs (when JetStream is
        there)."""
        app.router.add_get("/v1/usage", self.usage_handler)
        if self.jobs is not None:
            self.jobs.add_routes(app)
            self.files.add_routes(app)
            self.batches.add_routes(app)

    def authenticate(self, request: web.Request) -> Tenant:
        """Tenant of the request's ``Authorization: Bearer`` key; ApiError 401 otherwise."""
        return self.cache.authenticate(request.headers.get("Authorization"))

    async def admit(self, tenant: Tenant, body: dict, request_id: str, headers: dict) -> Admission | None:
        """Model access (ApiError 404, same as unknown), the tenant's priority class (a ``batch`` tenant's
        requests are batch), then quotas (ApiError 429 + Retry-After).

        Adds the x-ratelimit-* headers to ``headers``. Returns the Admission to release at the end."""
        self.cache.check_model(tenant, body.get("model"))
        if tenant.priority == "batch":
            body["priority"] = "batch"  # a batch-class tenant cannot ask for interactive
        if self.quotas is None:
            return None
        adm = await self.quotas.admit(tenant, request_id)
        headers.update(adm.headers)
        return adm

    async def release(self, adm: Admission | None) -> None:
        """End of an admitted request: free its concurrency slot (no-op for None)."""
        if adm is not None and self.quotas is not None:
            await self.quotas.release(adm)

    def budget_of(self, tenant_id: str) -> Budget | None:
        """The tenant's spend budget as this gateway knows it (None: none, or an unknown tenant)."""
        t = self.cache.tenants.get(tenant_id)
        return t.budget if t is not None else None

    def visible_models(self, request: web.Request, models: list[dict]) -> list[dict]:
        """``/v1/models`` entries the caller's tenant may use (401 without a valid key)."""
        tenant = self.authenticate(request)
        return [m for m in models if tenant.allows_model(str(m.get("id", "")).split("@")[0].split(":")[0])]

    async def usage_handler(self, request: web.Request) -> web.Response:
        """``GET /v1/usage``: the caller's own usage and cost per model version, and its budget (spent,
        reserved, remaining in the current period; null without a budget). 401 without a valid key."""
        tenant = self.authenticate(request)
        rows = await self.usage.usage(tenant.id) if self.usage is not None else []
        budget = await self.budgets.view(tenant.id, tenant.budget) if self.budgets is not None else None
        return web.json_response({"object": "usage", "tenant": tenant.id, "data": rows,
                                  "cost": {"total_usd": sum(r["cost_usd"] for r in rows), "budget": budget}})


class ManifestCache:
    """Manifests by (name, version) for pricing completion records: from ``models`` (a ModelResolver: its
    snapshot, no I/O) when given, else from etcd, each read kept CACHE_S seconds (a price change reaches
    the meter within that time)."""

    CACHE_S = 5.0

    def __init__(self, registry, models=None, clock=time.monotonic) -> None:
        self.registry, self.models, self.clock = registry, models, clock
        self._cache: dict[tuple[str, str], tuple[float, dict | None]] = {}

    async def get(self, name: str, version: str) -> dict | None:
        """The manifest dict of ``name@version`` (None: unknown). Raises the registry's errors on a miss."""
        if self.models is not None:
            return self.models.snapshot.versions.get(name, {}).get(version)
        at, m = self._cache.get((name, version), (None, None))
        if at is None or self.clock() - at > self.CACHE_S:
            m = await self.registry.get_model_version(name, version)
            self._cache[(name, version)] = (self.clock(), m)
        return m
