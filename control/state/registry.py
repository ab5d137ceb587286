"""etcd-backed registry: model versions, routing tables, tenants, worker leases, watches.

The pieces it is built from live beside it: ``control.state.manifest`` (ModelManifest, the validated
model-version record), ``control.state.leases`` (WorkerLease, OutageLog) and ``control.state.watch``
(the watch machinery); the names are re-exported here, where most callers import them.

All values are JSON objects (orjson). Every etcd call is bounded by the registry's ``timeout``
(seconds; ``asyncio.timeout`` plus the gRPC deadline); a call that exceeds it raises
``TimeoutError``, and connection problems raise ``aetcd.exceptions.ClientError`` subclasses.

Usage::

    async with Registry.connect("http://127.0.0.1:2379") as reg:
        await reg.put_model_version("smollm2", "v1", {"artifact": "/m.gguf", "format": "gguf"})
        lease = await reg.register_worker("smollm2", "v1", "w1", {"pool": "cpu"}, ttl=3)
        ...
        await lease.revoke()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Mapping, TypeVar

import aetcd
import orjson

from bus.tls import TlsFiles
from control.state import names
from control.state.etcd_client import GRPC_RECONNECT_OPTIONS, EtcdClient, parse_etcd_urls
from control.state.leases import OutageLog, WorkerLease
from control.state.manifest import MANIFEST_STATUSES, SUPPORTED_FORMATS, SUPPORTED_TOKENIZERS, ModelManifest
from control.state.watch import watch_prefix

__all__ = ["Registry", "ModelManifest", "WorkerLease", "OutageLog", "parse_etcd_url", "parse_etcd_urls",
           "DEFAULT_TIMEOUT", "SUPPORTED_FORMATS", "SUPPORTED_TOKENIZERS", "MANIFEST_STATUSES",
           "GRPC_RECONNECT_OPTIONS"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0

# ---------------------------------------------------------------------------------------------
# helpers


def parse_etcd_url(url: str) -> tuple[str, int]:
    """Split an etcd client URL (``http://host:port``, ``host:port``; a comma list gives its first member)
    into ``(host, port)``. Raises ValueError for a malformed URL (see parse_etcd_urls for the list)."""
    return parse_etcd_urls(url).members[0]


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def _loads(raw: bytes) -> Any:
    return orjson.loads(raw)


def _key(k: str) -> bytes:
    return k.encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Registry


class Registry:
    """Typed access to the actorserve keys in etcd (see control.state.names for the layout).

    Create with ``async with Registry.connect(url) as reg`` (or ``await Registry.open(url)`` and
    ``await reg.close()``). ``timeout`` bounds every call, in seconds.
    """

    def __init__(self, client: aetcd.Client, *, timeout: float = DEFAULT_TIMEOUT, url: str = "") -> None:
        self.client = client
        self.timeout = float(timeout)
        self.url = url
        self._leases: set[WorkerLease] = set()

    # -- connection ------------------------------------------------------------------------

    @classmethod
    async def open(cls, etcd_url: str, *, timeout: float = DEFAULT_TIMEOUT,
                   tls: TlsFiles | None = None) -> "Registry":
        """Connect to etcd at ``etcd_url`` (``http://host:port``, or a comma-separated list of cluster
        members, ``https://a:2379,https://b:2379``; control.state.etcd_client) and check it answers.

        ``tls`` (https URLs): CA, client certificate and key; default from ``ACTORSERVE_TLS_CA`` /
        ``_CERT`` / ``_KEY`` (bus.tls). Raises ValueError for a malformed URL or https without a CA,
        TimeoutError / aetcd ClientError if no member answers within ``timeout`` seconds.
        """
        endpoints = parse_etcd_urls(etcd_url)
        if endpoints.tls and tls is None:
            tls = TlsFiles.from_env()
        client = EtcdClient(endpoints, tls=tls, timeout=timeout, connect_wait_timeout=int(max(1, timeout)))
        reg = cls(client, timeout=timeout, url=etcd_url)
        try:
            await reg._call(client.connect())
            await reg._call(client.status())
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), timeout)
            raise
        return reg

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, etcd_url: str, *, timeout: float = DEFAULT_TIMEOUT,
                      tls: TlsFiles | None = None) -> AsyncIterator["Registry"]:
        """Async context manager yielding a connected Registry; closes it on exit (see open)."""
        reg = await cls.open(etcd_url, timeout=timeout, tls=tls)
        try:
            yield reg
        finally:
            await reg.close()

    async def close(self) -> None:
        """Stop every keepalive started here (without revoking: leases then expire by TTL —
        revoke them first for a clean stop) and close the connection."""
        for lease in list(self._leases):
            await lease.stop_keepalive()
        self._leases.clear()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.client.close(), self.timeout)

    async def _call(self, aw: Awaitable[T]) -> T:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result and drops a cancel that
        # arrives as the call completes (cpython#86296): a SIGTERM during an actor's start-up was lost that way
        # (14 of 16 schedulers SIGTERMed right at start never exited; tests/integration/test_sigterm_at_start.py)
        async with asyncio.timeout(self.timeout):
            return await aw

    # -- generic JSON helpers --------------------------------------------------------------

    async def put_json(self, key: str, value: Any, *, lease: int | None = None) -> int:
        """Store ``value`` (JSON-serialisable) at ``key``, optionally attached to lease id
        ``lease``. Returns the etcd revision of the write."""
        resp = await self._call(self.client.put(_key(key), _dumps(value), lease=lease))
        return int(resp.header.revision)

    async def get_json(self, key: str) -> Any | None:
        """Return the decoded JSON value at ``key``, or None if the key does not exist.

        Raises ValueError if the stored value is not valid JSON."""
        resp = await self._call(self.client.get(_key(key)))
        if resp is None:
            return None
        try:
            return _loads(resp.value)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"value at {key} is not valid JSON: {e}") from e

    async def get_json_lease(self, key: str) -> tuple[Any | None, int]:
        """Return ``(decoded value, lease id)`` of ``key`` (lease 0: not leased); ``(None, 0)`` if absent."""
        resp = await self._call(self.client.get(_key(key)))
        if resp is None:
            return None, 0
        try:
            return _loads(resp.value), int(getattr(resp, "lease", 0) or 0)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"value at {key} is not valid JSON: {e}") from e

    async def get_prefix_json(self, prefix: str) -> dict[str, Any]:
        """Return ``{key: decoded value}`` for every key under ``prefix`` (sorted by key).

        Values that are not valid JSON are logged and skipped."""
        return (await self.get_prefix_json_rev(prefix))[1]

    async def get_prefix_json_rev(self, prefix: str) -> tuple[int, dict[str, Any]]:
        """Like :meth:`get_prefix_json`, with the etcd revision of the read: ``(revision, {key: value})``
        (a watch started at ``revision + 1`` misses nothing)."""
        resp = await self._call(self.client.get_prefix(_key(prefix), sort_order="ascend", sort_target="key"))
        out: dict[str, Any] = {}
        for kv in resp:
            k = kv.key.decode("utf-8")
            try:
                out[k] = _loads(kv.value)
            except orjson.JSONDecodeError:
                log.warning("skipping non-JSON value at %s", k)
        return int(resp.header.revision), out

    async def delete(self, key: str) -> bool:
        """Delete ``key``; return True if it existed."""
        resp = await self._call(self.client.delete(_key(key)))
        return resp is not None and bool(getattr(resp, "deleted", 0))

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; return how many were deleted."""
        resp = await self._call(self.client.delete_prefix(_key(prefix)))
        return int(getattr(resp, "deleted", 0))

    async def put_if_absent(self, key: str, value: Any, *, lease: int | None = None) -> bool:
        """Create ``key`` only if it does not exist (atomic; e.g. for elections).
        Returns True if this call created it."""
        tx = self.client.transactions
        ok, _ = await self._call(
            self.client.transaction(
                compare=[tx.create(_key(key)) == 0],
                success=[tx.put(_key(key), _dumps(value), lease=lease)],
                failure=[],
            )
        )
        return bool(ok)

    async def get_json_rev(self, key: str) -> tuple[Any | None, int]:
        """Return ``(decoded value, mod_revision)`` of ``key``; ``(None, 0)`` if it does not exist.

        Pair with put_json_if_rev for a compare-and-swap update. Raises ValueError for non-JSON."""
        resp = await self._call(self.client.get(_key(key)))
        if resp is None:
            return None, 0
        try:
            return _loads(resp.value), int(resp.mod_revision)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"value at {key} is not valid JSON: {e}") from e

    async def put_json_if_rev(self, key: str, value: Any, mod_revision: int) -> bool:
        """Store ``value`` at ``key`` only if the key's mod_revision is still ``mod_revision``
        (0: only if the key does not exist). Atomic; returns True if written."""
        tx = self.client.transactions
        cmp = tx.create(_key(key)) == 0 if mod_revision == 0 else tx.mod(_key(key)) == int(mod_revision)
        ok, _ = await self._call(
            self.client.transaction(compare=[cmp], success=[tx.put(_key(key), _dumps(value))], failure=[])
        )
        return bool(ok)

    async def grant_lease(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds; return its id (no keepalive is started)."""
        lease = await self._call(self.client.lease(int(ttl)))
        return int(lease.id)

    # -- models ----------------------------------------------------------------------------

    async def put_model_version(
        self, name: str, version: str, manifest: Mapping[str, Any] | ModelManifest
    ) -> ModelManifest:
        """Validate and store the manifest of ``name@version``; return the stored manifest.

        ``name``/``version`` in the manifest may be omitted (filled in) but must match if given.
        Raises ValueError for an invalid manifest (e.g. unsupported format) or names.
        """
        names.validate_name("model name", name)
        names.validate_name("model version", version)
        data = manifest.to_dict() if isinstance(manifest, ModelManifest) else dict(manifest)
        for fname, expected in (("name", name), ("version", version)):
            if data.setdefault(fname, expected) != expected:
                raise ValueError(f"manifest {fname} {data[fname]!r} does not match {expected!r}")
        m = ModelManifest.from_dict(data)
        await self.put_json(names.model_version_key(name, version), m.to_dict())
        return m

    async def get_model_version(self, name: str, version: str) -> dict[str, Any] | None:
        """Return the stored manifest dict of ``name@version``, or None if unknown."""
        return await self.get_json(names.model_version_key(name, version))

    async def get_manifest(self, name: str, version: str) -> ModelManifest | None:
        """Like get_model_version, parsed into a ModelManifest (ValueError if invalid)."""
        d = await self.get_model_version(name, version)
        return None if d is None else ModelManifest.from_dict(d)

    async def delete_model_version(self, name: str, version: str) -> bool:
        """Delete the manifest of ``name@version``; return True if it existed."""
        return await self.delete(names.model_version_key(name, version))

    async def list_model_versions(self, name: str) -> dict[str, dict[str, Any]]:
        """Return ``{version: manifest}`` for one model."""
        prefix = names.model_versions_prefix(name)
        return {k[len(prefix):]: v for k, v in (await self.get_prefix_json(prefix)).items()}

    async def list_models(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Return ``{name: {version: manifest}}`` for every registered model version."""
        return await self._per_model("versions")

    async def list_adapters(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Return ``{model name: {adapter: record}}`` for every adapter record (control/state/adapters.py)."""
        return await self._per_model("adapters")

    async def list_model_adapters(self, name: str) -> dict[str, dict[str, Any]]:
        """Return ``{adapter: record}`` of one model (its adapters prefix only)."""
        prefix = names.adapters_prefix(name)
        return {k[len(prefix):]: v for k, v in (await self.get_prefix_json(prefix)).items()}

    async def _per_model(self, segment: str) -> dict[str, dict[str, dict[str, Any]]]:
        """``{name: {key: value}}`` of the keys ``/actorserve/models/{name}/{segment}/{key}``."""
        prefix = names.models_prefix()
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for k, v in (await self.get_prefix_json(prefix)).items():
            parts = k[len(prefix):].split("/")
            if len(parts) == 3 and parts[1] == segment:
                out.setdefault(parts[0], {})[parts[2]] = v
        return out

    async def get_routing(self, name: str) -> dict[str, Any] | None:
        """Return the routing table of model ``name``, or None if it has none."""
        return await self.get_json(names.routing_key(name))

    async def ensure_stable(self, name: str, version: str) -> str:
        """Make ``version`` the routing table's stable version unless the table already names one; return
        the stable version. The first registered version of a model thus takes its traffic, and later
        versions take none until a rollout or promote (control/state/routing.py)."""
        from control.state.routing import RoutingTable
        key = names.routing_key(name)
        for _ in range(20):
            rec, rev = await self.get_json_rev(key)
            if rec and rec.get("stable"):
                return str(rec["stable"])
            table = RoutingTable.from_dict(rec).to_dict() | {"stable": version}
            if rec is None and await self.put_if_absent(key, table):
                return version
            if rec is not None and await self.put_json_if_rev(key, table, rev):
                return version
        raise RuntimeError(f"routing table of {name} kept changing; retry")

    async def put_routing(self, name: str, routing: Mapping[str, Any]) -> int:
        """Store the routing table of model ``name`` (a JSON object); returns the revision."""
        if not isinstance(routing, Mapping):
            raise ValueError("routing must be an object")
        return await self.put_json(names.routing_key(name), dict(routing))

    # -- tenants ---------------------------------------------------------------------------

    async def put_tenant(self, tenant_id: str, record: Mapping[str, Any]) -> int:
        """Store a tenant record (JSON object) at ``/actorserve/tenants/{id}``."""
        return await self.put_json(names.tenant_key(tenant_id), dict(record))

    async def get_tenant(self, tenant_id: str) -> dict[str, Any] | None:
        """Return a tenant record, or None if unknown."""
        return await self.get_json(names.tenant_key(tenant_id))

    async def list_tenants(self) -> dict[str, dict[str, Any]]:
        """Return ``{tenant_id: record}``."""
        prefix = names.tenants_prefix()
        return {k[len(prefix):]: v for k, v in (await self.get_prefix_json(prefix)).items()}

    # -- workers ---------------------------------------------------------------------------

    async def register_worker(
        self, name: str, version: str, worker_id: str, info: Mapping[str, Any], ttl: int = 3
    ) -> WorkerLease:
        """Register a worker of ``name@version`` under a lease of ``ttl`` seconds (1..5) and
        start its keepalive. Returns the WorkerLease; ``await lease.revoke()`` on clean stop.
        Raises ValueError for bad names or ttl."""
        return await self.put_leased(names.worker_key(name, version, worker_id), info, ttl)

    async def put_leased(self, key: str, info: Mapping[str, Any], ttl: int = 3) -> WorkerLease:
        """Put ``key`` -> ``info`` under a fresh lease of ``ttl`` s (1..5), overwriting, and keep it alive
        (like :meth:`register_worker` for any key, e.g. ``names.metrics_key``). ``revoke()`` on clean stop."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 5:
            raise ValueError(f"ttl must be an integer number of seconds in 1..5, got {ttl!r}")
        lease = await self._call(self.client.lease(ttl))
        try:
            await self.put_json(key, dict(info), lease=int(lease.id))
        except BaseException:
            with contextlib.suppress(Exception):
                await self._call(self.client.revoke_lease(lease.id))
            raise
        wl = WorkerLease(self, key, lease, ttl)
        wl._start()
        self._leases.add(wl)
        return wl

    async def acquire_leased(self, key: str, info: Mapping[str, Any], ttl: int = 2) -> WorkerLease | None:
        """Create ``key`` under a fresh lease of ``ttl`` s (1..5) only if it does not exist; keep it alive.

        Returns the lease (``lost`` is set if it expires behind our back; ``revoke()`` to resign), or
        None when someone else holds the key. Used for elections (e.g. the active scheduler)."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= 5:
            raise ValueError(f"ttl must be an integer number of seconds in 1..5, got {ttl!r}")
        lease = await self._call(self.client.lease(ttl))
        if not await self.put_if_absent(key, dict(info), lease=int(lease.id)):
            with contextlib.suppress(Exception):
                await self._call(self.client.revoke_lease(lease.id))
            return None
        wl = WorkerLease(self, key, lease, ttl)
        wl._start()
        self._leases.add(wl)
        return wl

    async def list_hosts(self) -> dict[str, dict[str, Any]]:
        """Return ``{host_id: record}`` of the live multi-version worker hosts (``names.host_key``)."""
        prefix = names.hosts_prefix()
        return {k[len(prefix):]: v for k, v in (await self.get_prefix_json(prefix)).items()}

    async def list_workers(self, name: str, version: str) -> dict[str, dict[str, Any]]:
        """Return ``{worker_id: info}`` for the live workers of ``name@version``."""
        prefix = names.workers_prefix(name, version)
        return {k[len(prefix):]: v for k, v in (await self.get_prefix_json(prefix)).items()}

    # -- watches ---------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, *, start_revision: int | None = None, include_existing: bool = False,
                     retry_delay: float = 0.5, max_retry_delay: float = 2.0
                     ) -> AsyncIterator[tuple[str, str, Any | None]]:
        """Yield ``(event, key, value)`` for every change under ``prefix``, forever: ``"put"`` (decoded
        JSON) or ``"delete"`` (None); ``include_existing`` yields the current keys first. Resumes after a
        broken stream and resyncs after compaction, so no event is lost or repeated; see
        :func:`control.state.watch.watch_prefix`. Stop by breaking out of the loop / closing it."""
        return watch_prefix(self, prefix, start_revision=start_revision, include_existing=include_existing,
                            retry_delay=retry_delay, max_retry_delay=max_retry_delay)
