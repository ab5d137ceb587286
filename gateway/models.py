"""Model reference resolution at the gateway: ``name`` / ``name@version`` -> one concrete version.

Reads the registry (models, versions, routing, leased workers) from etcd and keeps a snapshot
refreshed by a watch on ``/actorserve/models/`` plus a periodic re-read, so a request never waits
on etcd. A routing edit seen by the watch is applied at once (a rollback takes effect in
milliseconds); other edits trigger a re-read.

Resolution of ``name`` (control/state/routing.py ``choose_version``): the routing table's canary for the
requests its weight and stickiness select, else the table's stable version; with no usable stable,
the highest active version that has live workers (else the highest active one), so registering a
new version does not move traffic to it before it is served. ``name@version`` pins an active version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from control.state.routing import RoutingTable, choose_version
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)


def version_order(v: str) -> tuple:
    """Sort key: integers numerically and before other strings."""
    return (0, int(v), "") if v.isdigit() else (1, 0, v)


def not_found(model: str) -> ApiError:
    """The 404 of an unknown (or, later, not allowed) model: indistinguishable by design."""
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


@dataclass
class ModelSnapshot:
    """Registry state as last read."""

    versions: dict[str, dict[str, dict]] = field(default_factory=dict)  # name -> version -> manifest
    routing: dict[str, dict] = field(default_factory=dict)  # name -> routing record
    workers: dict[tuple[str, str], int] = field(default_factory=dict)  # (name, version) -> live workers
    read_at: float = 0.0  # time.time() of the read
    adapters: dict[str, dict[str, dict]] = field(default_factory=dict)  # name -> adapter -> record

    def resolve(self, ref: str, *, tenant: str = "", request_key: str = "") -> tuple[str, str]:
        """(name, version) for a model reference; ApiError 404 when unknown (see :meth:`resolve_ref`)."""
        return self.resolve_ref(ref, tenant=tenant, request_key=request_key)[:2]

    def resolve_ref(self, ref: str, *, tenant: str = "", request_key: str = "") -> tuple[str, str, str | None]:
        """(name, version, adapter id or None) for a model reference; ApiError 404 when unknown. The adapter id
        is ``adapter~revision`` (control/state/adapters.py ``adapter_id``): it changes when the name is registered
        again, so workers and the prefix cache never mix two registrations' weights.

        ``tenant`` and ``request_key`` (the request id) feed the canary split's stickiness. ``name:adapter``
        goes to the version the adapter was registered for, whatever the routing table says (a canary may not
        fit the adapter); ``name@version:adapter`` only to that version. A retired adapter, one registered
        for another version, or one whose tenant list leaves ``tenant`` out is not found (404).
        """
        from control.state.adapters import adapter_id, visible_to
        from control.state.names import parse_model_ref
        try:
            parsed = parse_model_ref(ref)
        except (ValueError, TypeError):
            raise not_found(str(ref)) from None
        active = self.active_versions(parsed.name)
        if parsed.adapter:
            rec = self.adapters.get(parsed.name, {}).get(parsed.adapter)
            version = (rec or {}).get("version")
            if (not visible_to(rec, tenant or None) or version not in active
                    or (parsed.version and parsed.version != version)):
                raise not_found(ref)
            return parsed.name, version, adapter_id(rec)
        return (*self._resolve_base(parsed, ref, active, tenant, request_key), None)

    def adapter_path(self, name: str, adapter: str | None) -> str:
        """The PEFT directory of ``name``'s adapter (a name or an id ``adapter~revision``) from its record ("" for
        none)."""
        if not adapter:
            return ""
        return str((self.adapters.get(name, {}).get(adapter.split("~", 1)[0]) or {}).get("path", ""))

    def _resolve_base(self, parsed, ref: str, active: frozenset[str], tenant: str, request_key: str) -> tuple[str, str]:
        if parsed.version:
            if parsed.version not in active:
                raise not_found(ref)
            return parsed.name, parsed.version
        version = choose_version(parsed.name, self.table(parsed.name), active, tenant=tenant,
                                 request_key=request_key, fallback=self.fallback_version(parsed.name))
        if version is None:
            raise not_found(ref)
        return parsed.name, version

    def active_versions(self, name: str) -> frozenset[str]:
        """Versions of ``name`` whose manifest status is active."""
        return frozenset(v for v, m in self.versions.get(name, {}).items() if m.get("status", "active") == "active")

    def table(self, name: str) -> RoutingTable:
        """The model's routing table (empty when unset or unreadable)."""
        try:
            return RoutingTable.from_dict(self.routing.get(name))
        except (ValueError, TypeError) as exc:
            log.warning("routing table of %s is invalid (%s); using defaults", name, exc)
            return RoutingTable()

    def fallback_version(self, name: str) -> str | None:
        """Highest active version with live workers, else the highest active one, else None."""
        active = self.active_versions(name)
        served = [v for v in active if self.workers.get((name, v), 0) > 0]
        pool = served or list(active)
        return max(pool, key=version_order) if pool else None

    def model_list(self, tenant: str | None = None) -> list[dict]:
        """``/v1/models`` entries: one per model name (``name``) and per active version (``name@version``);
        retired and disabled versions (404 when asked for) are left out, so is a name without an active one.
        Then the active adapters (``name:adapter``, ``parent`` = ``name@version``) that ``tenant`` may use
        (None: all)."""
        return self._base_list() + self._adapter_list(tenant)

    def _adapter_list(self, tenant: str | None) -> list[dict]:
        from control.state.adapters import visible_to
        out = []
        for name, recs in sorted(self.adapters.items()):
            for adapter, rec in sorted(recs.items()):
                if visible_to(rec, tenant) and rec.get("version") in self.active_versions(name):
                    out.append({"id": f"{name}:{adapter}", "object": "model", "created": int(rec.get("created", 0)),
                                "owned_by": "actorserve", "parent": f"{name}@{rec['version']}"})
        return out

    def _base_list(self) -> list[dict]:
        out = []
        for name, vers in sorted(self.versions.items()):
            active = self.active_versions(name)
            if not active:
                continue
            created = int(min((m.get("created", 0) for m in vers.values()), default=0))
            out.append({"id": name, "object": "model", "created": created, "owned_by": "actorserve"})
            for v in sorted(active, key=version_order):
                out.append({"id": f"{name}@{v}", "object": "model", "created": created, "owned_by": "actorserve"})
        return out

    def routed_versions(self) -> list[tuple[str, str]]:
        """(name, version) pairs that unpinned traffic can reach now: each model's stable (or fallback)
        version and the canary of a running rollout."""
        out = []
        for name in self.versions:
            t, active = self.table(name), self.active_versions(name)
            stable = t.stable if t.stable in active else self.fallback_version(name)
            out += [(name, v) for v in {stable, t.canary if t.rollout_active else None} if v in active]
        return out

    def all_versions_served(self) -> bool:
        """Every version unpinned traffic can reach has at least one leased worker (readiness). A version
        being brought up or drained alongside does not make the gateway unready."""
        routed = self.routed_versions()
        return bool(routed) and all(self.workers.get(k, 0) > 0 for k in routed)


class ModelResolver:
    """Keeps a ModelSnapshot fresh from etcd. ``snapshot`` is always usable (possibly stale).

    A watch on ``/actorserve/models/`` applies routing edits to the snapshot as they arrive and wakes
    a re-read for any other edit; a periodic re-read every ``refresh_s`` seconds also picks up worker
    leases and heals a broken watch.
    """

    def __init__(self, registry, refresh_s: float = 1.0) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self.snapshot = ModelSnapshot()
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()
        self._seq = 0  # number of routing records applied from the watch
        self._watched: dict[str, tuple[int, dict | None]] = {}  # name -> (seq, record) of the last one

    async def start(self) -> None:
        """First read (bounded), then background refresh and watch."""
        try:
            await asyncio.wait_for(self.refresh(), 5.0)
        except Exception as exc:
            log.warning("initial registry read failed: %s", exc)
        self._tasks = [asyncio.create_task(self._loop()), asyncio.create_task(self._watch())]

    async def stop(self) -> None:
        """Stop refreshing."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def refresh(self) -> None:
        """Re-read models, routing and worker counts. A routing record the watch applied while this
        read was under way wins over the (older) one read here."""
        seq0 = self._seq
        models = await self.registry.list_models()
        adapters = await self.registry.list_adapters()
        routing, workers = {}, {}
        for name, vers in models.items():
            routing[name] = await self.registry.get_routing(name) or {}
            for v in vers:
                workers[(name, v)] = len(await self.registry.list_workers(name, v))
        for name, (seq, record) in self._watched.items():
            if seq > seq0:
                routing[name] = record or {}
        self.snapshot = ModelSnapshot(models, routing, workers, time.time(), adapters)

    def apply_routing(self, name: str, record: dict | None) -> None:
        """Install one model's routing record in the snapshot now (from the watch)."""
        self._seq += 1
        self._watched[name] = (self._seq, record)
        snap = self.snapshot
        routing = {**snap.routing, name: record or {}}
        self.snapshot = ModelSnapshot(snap.versions, routing, snap.workers, snap.read_at, snap.adapters)

    async def _watch(self) -> None:
        from control.state.names import models_prefix, routing_key
        prefix = models_prefix()
        while True:
            try:
                async for event, key, value in self.registry.watch_prefix(prefix):
                    name = key[len(prefix):].split("/", 1)[0]
                    if key == routing_key(name):
                        self.apply_routing(name, value if event == "put" else None)
                    else:
                        self._changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("registry watch failed: %s; retrying", exc)
                await asyncio.sleep(1.0)

    async def _loop(self) -> None:
        from control.state.registry import OutageLog

        outage = OutageLog(log, "gateway registry refresh (serving from the last snapshot)")
        while True:
            try:
                async with asyncio.timeout(self.refresh_s):
                    await self._changed.wait()
            except TimeoutError:
                pass
            self._changed.clear()
            try:
                async with asyncio.timeout(5.0):
                    await self.refresh()
                outage.ok()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep serving from the last snapshot while etcd is away (logged once)
                outage.failed(exc)
