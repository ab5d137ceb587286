"""API key authentication at the gateway: a cache of tenants and key hashes, kept live by an etcd watch.

Every gateway holds the whole ``/actorserve/tenants/`` prefix in memory (tenants are few and small):
a request never waits on etcd. The watch delivers a revocation in milliseconds, so a revoked key is
refused on every gateway well within the 1 s of issue 5. While etcd is unreachable the last known
state keeps serving (the watch reconnects and resumes after its last revision).
"""

from __future__ import annotations

import asyncio
import logging

from actors.aio import cancel_tasks
from control.state import names
from control.state.tenants import Tenant, TenantError, hash_key, parse_bearer
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)


def unauthorized(key: str | None) -> ApiError:
    """The 401 of a missing, unknown or revoked key (OpenAI shape, code ``invalid_api_key``)."""
    if not key:
        msg = ("You didn't provide an API key. You need to provide your API key in an Authorization header "
               "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
    else:
        shown = key[:6] + "*" * 4 + key[-4:] if len(key) > 12 else "*" * len(key)
        msg = f"Incorrect API key provided: {shown}."
    return ApiError(401, msg, code="invalid_api_key", type="invalid_request_error")


class TenantCache:
    """In-memory view of every tenant, refreshed by a watch on ``/actorserve/tenants/``.

    ``registry``: a connected control.state.registry.Registry. Use ``await start()`` / ``await stop()``.
    """

    def __init__(self, registry) -> None:
        self.registry = registry
        self.tenants: dict[str, Tenant] = {}
        self._by_hash: dict[str, str] = {}  # key hash -> tenant id
        self._task: asyncio.Task | None = None
        self.version = 0  # bumped on every applied change (tests, diagnostics)

    async def start(self) -> None:
        """Load every tenant (bounded by the registry timeout; a failure is logged) and start watching."""
        try:
            for tid, rec in (await self.registry.list_tenants()).items():
                self._apply("put", tid, rec)
        except Exception as exc:
            log.warning("initial tenant load failed (%s); waiting for the watch", exc)
        self._task = asyncio.create_task(self._watch(), name="tenant-watch")

    async def stop(self) -> None:
        """Stop watching."""
        await cancel_tasks([self._task])

    async def _watch(self) -> None:
        prefix = names.tenants_prefix()
        while True:
            try:
                async for event, key, value in self.registry.watch_prefix(prefix, include_existing=True):
                    self._apply(event, key[len(prefix):], value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # watch_prefix retries internally; this is a last resort
                log.warning("tenant watch failed (%s); restarting", exc)
                await asyncio.sleep(1.0)

    def _apply(self, event: str, tenant_id: str, record) -> None:
        if event == "delete" or record is None:
            self.tenants.pop(tenant_id, None)
        else:
            try:
                self.tenants[tenant_id] = Tenant.from_record(tenant_id, record)
            except (TenantError, ValueError, TypeError) as exc:
                log.warning("ignoring malformed tenant record %s: %s", tenant_id, exc)
                self.tenants.pop(tenant_id, None)
        self._by_hash = {h: t.id for t in self.tenants.values() for h in t.active_key_hashes()}
        self.version += 1

    def authenticate(self, authorization: str | None) -> Tenant:
        """Tenant of an ``Authorization: Bearer <key>`` header value.

        Raises ApiError 401 (``invalid_api_key``) for a missing, malformed, unknown or revoked key."""
        key = parse_bearer(authorization)
        if key is None:
            raise unauthorized(None)
        tid = self._by_hash.get(hash_key(key))
        tenant = self.tenants.get(tid) if tid else None
        if tenant is None:
            raise unauthorized(key)
        return tenant

    def check_model(self, tenant: Tenant, model: object) -> None:
        """Raise the same 404 as an unknown model if ``tenant`` may not use ``model`` (a model reference).

        A malformed reference is left to the resolver (which also answers 404)."""
        from control.state.names import parse_model_ref
        from gateway.models import not_found

        try:
            name = parse_model_ref(model).name if isinstance(model, str) else None
        except ValueError:
            return
        if name is not None and not tenant.allows_model(name):
            raise not_found(model)
