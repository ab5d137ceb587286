"""Model reference resolution at the gateway: ``name`` / ``name@version`` -> one concrete version.

Reads the registry (models, versions, routing, leased workers) from etcd and keeps a snapshot
refreshed by a watch on ``/actorserve/models/`` plus a periodic re-read, so a request never waits
on etcd. Resolution of ``name``: the routing table's stable version when set, else the highest
active version (numeric order when versions are integers). Canary weights come in a later issue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

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

    def resolve(self, ref: str) -> tuple[str, str]:
        """(name, version) for a model reference; ApiError 404 when unknown. Adapters: later issue."""
        from control.names import parse_model_ref
        try:
            parsed = parse_model_ref(ref)
        except (ValueError, TypeError):
            raise not_found(str(ref)) from None
        active = {v: m for v, m in self.versions.get(parsed.name, {}).items() if m.get("status", "active") == "active"}
        if parsed.adapter:
            raise not_found(ref)
        if parsed.version:
            if parsed.version not in active:
                raise not_found(ref)
            return parsed.name, parsed.version
        stable = self.routing.get(parsed.name, {}).get("stable")
        if stable in active:
            return parsed.name, stable
        if not active:
            raise not_found(ref)
        return parsed.name, max(active, key=version_order)

    def model_list(self) -> list[dict]:
        """``/v1/models`` entries: one per model name (``name``) and per version (``name@version``)."""
        out = []
        for name, vers in sorted(self.versions.items()):
            created = int(min((m.get("created", 0) for m in vers.values()), default=0))
            out.append({"id": name, "object": "model", "created": created, "owned_by": "actorserve"})
            for v in sorted(vers, key=version_order):
                out.append({"id": f"{name}@{v}", "object": "model", "created": created, "owned_by": "actorserve"})
        return out

    def all_versions_served(self) -> bool:
        """Every active version has at least one leased worker (readiness)."""
        active = [(n, v) for n, vs in self.versions.items() for v, m in vs.items()
                  if m.get("status", "active") == "active"]
        return bool(active) and all(self.workers.get(k, 0) > 0 for k in active)


class ModelResolver:
    """Keeps a ModelSnapshot fresh from etcd. ``snapshot`` is always usable (possibly stale)."""

    def __init__(self, registry, refresh_s: float = 1.0) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self.snapshot = ModelSnapshot()
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        """First read (bounded), then background refresh."""
        try:
            await asyncio.wait_for(self.refresh(), 5.0)
        except Exception as exc:
            log.warning("initial registry read failed: %s", exc)
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop refreshing."""
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        """Re-read models, routing and worker counts."""
        models = await self.registry.list_models()
        routing, workers = {}, {}
        for name, vers in models.items():
            routing[name] = await self.registry.get_routing(name) or {}
            for v in vers:
                workers[(name, v)] = len(await self.registry.list_workers(name, v))
        self.snapshot = ModelSnapshot(models, routing, workers, time.time())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await asyncio.wait_for(self.refresh(), 5.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep serving from the last snapshot while etcd is away
                log.warning("registry refresh failed: %s", exc)
