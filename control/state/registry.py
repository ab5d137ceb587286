"""etcd-backed registry: model versions, routing tables, tenants, worker leases, watches.

All values are JSON objects (orjson). Every etcd call is bounded by the registry's ``timeout``
(seconds; ``asyncio.wait_for`` plus the gRPC deadline); a call that exceeds it raises
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
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Mapping, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import orjson

from control.state import names

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0
SUPPORTED_FORMATS = ("gguf",)
SUPPORTED_TOKENIZERS = ("gguf",)
MANIFEST_STATUSES = ("active", "disabled", "retired")

# Sampling defaults a manifest may carry, with their accepted Python types.
_SAMPLING_DEFAULTS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "max_tokens": (int,),
    "repetition_penalty": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "seed": (int,),
    "stop": (list, str),
}


# ---------------------------------------------------------------------------------------------
# Model manifest


@dataclass(frozen=True)
class ModelManifest:
    """Manifest of one model version, stored at ``/actorserve/models/{name}/versions/{version}``.

    Validated on construction; every problem raises ValueError naming the field.

    * ``artifact``: path of the weights file (non-empty string).
    * ``format``: only ``"gguf"`` for now; others raise
      ``ValueError("format X is not supported yet (supported: gguf)")``.
    * ``context_length``: max tokens (prompt + completion), positive int, or None (from the artifact).
    * ``memory_bytes``: memory the weights need, in bytes, non-negative int or None (unknown).
    * ``tokenizer``: ``"gguf"`` (read from the artifact).
    * ``chat_template``: ``"gguf"`` (from the artifact) or an inline Jinja template string.
    * ``defaults``: sampling defaults (temperature, top_p, top_k, min_p, max_tokens,
      repetition_penalty, presence_penalty, frequency_penalty, seed, stop).
    * ``status``: one of ``active``, ``disabled``, ``retired``.
    * ``extra``: unknown keys met by from_dict, kept so that a round trip loses nothing.
    """

    name: str
    version: str
    artifact: str
    format: str = "gguf"
    quantization: str | None = None
    context_length: int | None = None
    memory_bytes: int | None = None
    tokenizer: str = "gguf"
    chat_template: str = "gguf"
    defaults: dict[str, Any] = field(default_factory=dict)
    status: str = "active"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names.validate_name("model name", self.name)
        names.validate_name("model version", self.version)
        if not isinstance(self.artifact, str) or not self.artifact:
            raise ValueError("artifact must be a non-empty path string")
        if self.format not in SUPPORTED_FORMATS:
            raise ValueError(
                f"format {self.format} is not supported yet (supported: {', '.join(SUPPORTED_FORMATS)})"
            )
        if self.quantization is not None and (not isinstance(self.quantization, str) or not self.quantization):
            raise ValueError("quantization must be a non-empty string or null")
        for fname, minimum in (("context_length", 1), ("memory_bytes", 0)):
            v = getattr(self, fname)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < minimum):
                raise ValueError(f"{fname} must be an integer >= {minimum} or null, got {v!r}")
        if self.tokenizer not in SUPPORTED_TOKENIZERS:
            raise ValueError(
                f"tokenizer {self.tokenizer} is not supported yet (supported: {', '.join(SUPPORTED_TOKENIZERS)})"
            )
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ValueError('chat_template must be "gguf" or a non-empty template string')
        if not isinstance(self.defaults, Mapping):
            raise ValueError("defaults must be an object")
        for k, v in self.defaults.items():
            types = _SAMPLING_DEFAULTS.get(k)
            if types is None:
                raise ValueError(
                    f"defaults.{k} is not a known sampling parameter "
                    f"(known: {', '.join(sorted(_SAMPLING_DEFAULTS))})"
                )
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"defaults.{k} has the wrong type ({type(v).__name__})")
            if k == "stop" and isinstance(v, list) and not all(isinstance(s, str) for s in v):
                raise ValueError("defaults.stop must be a string or a list of strings")
        if self.status not in MANIFEST_STATUSES:
            raise ValueError(f"status must be one of {', '.join(MANIFEST_STATUSES)}, got {self.status!r}")
        if not isinstance(self.extra, Mapping):
            raise ValueError("extra must be an object")
        # Private copies so that callers cannot mutate a frozen manifest through their dicts.
        object.__setattr__(self, "defaults", dict(self.defaults))
        object.__setattr__(self, "extra", dict(self.extra))

    @property
    def ref(self) -> names.ModelRef:
        """``name@version`` as a ModelRef."""
        return names.ModelRef(self.name, self.version)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (unknown keys from ``extra`` merged back at top level)."""
        d: dict[str, Any] = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name != "extra":
                v = getattr(self, f.name)
                d[f.name] = dict(v) if isinstance(v, dict) else v
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelManifest":
        """Build from a dict (e.g. stored JSON). Unknown keys go to ``extra``; ValueError if invalid."""
        if not isinstance(data, Mapping):
            raise ValueError("manifest must be an object")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [k for k in ("name", "version", "artifact") if k not in data]
        if missing:
            raise ValueError(f"manifest is missing {', '.join(missing)}")
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known and k != "extra"}
        return cls(**kwargs, extra=extra)


# ---------------------------------------------------------------------------------------------
# helpers


def parse_etcd_url(url: str) -> tuple[str, int]:
    """Split an etcd client URL (``http://host:port``, ``host:port``; a comma list uses the first)
    into ``(host, port)``. Raises ValueError if no port can be found."""
    first = url.split(",")[0].strip()
    if "://" not in first:
        first = "http://" + first
    parts = urlsplit(first)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"etcd url {url!r}: scheme must be http or https")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"etcd url {url!r} must be host:port")
    return parts.hostname, parts.port


def _dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def _loads(raw: bytes) -> Any:
    return orjson.loads(raw)


def _key(k: str) -> bytes:
    return k.encode("utf-8")


# gRPC channel reconnect backoff (gRPC's doc/connection-backoff.md: 1 s initial, x1.6, up to 120 s by
# default). After a few seconds of etcd being away the default delay grows past a lease's TTL, so a
# keepalive reached a restarted etcd 3.9 s after it came back and the 2 s lease had expired (CI of
# stop 12). Leases here live 2-5 s: reconnect within half a second.
GRPC_RECONNECT_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
}


# ---------------------------------------------------------------------------------------------
# Worker lease


class OutageLog:
    """Logs an etcd outage once when it starts and once when it ends (not once per failed attempt).

    ``failed(exc)`` on each failed call, ``ok()`` on each successful one; ``down_since`` is the
    monotonic time of the first failure of the current outage (None while etcd answers)."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.log, self.what = logger, what
        self.down_since: float | None = None
        self.outages = 0  # outages seen so far

    def failed(self, exc: BaseException) -> bool:
        """Record a failed attempt; True (and one warning logged) when it starts a new outage."""
        if self.down_since is not None:
            return False
        self.down_since = time.monotonic()
        self.outages += 1
        self.log.warning("%s: etcd unreachable (%r); retrying quietly until it answers", self.what, exc)
        return True

    def ok(self) -> float | None:
        """Record a success; returns the outage's length in seconds when this ends one (logged), else None."""
        if self.down_since is None:
            return None
        took, self.down_since = time.monotonic() - self.down_since, None
        self.log.warning("%s: etcd answers again after %.1f s", self.what, took)
        return took


class WorkerLease:
    """A leased key (worker registration, election, metrics endpoint): an etcd lease plus the key,
    kept alive by a task.

    The keepalive refreshes every ``ttl / 3`` seconds. While etcd does not answer (stopped,
    restarting, unreachable) it keeps the lease and keeps retrying (backoff from ``ttl / 6`` up to
    ``ttl / 3`` s; each try bounded by ``ttl / 2`` s), logging once per outage: etcd keeps leases
    across its own restart and extends them, so the key usually survives; the owner keeps serving
    from what it knows. ``reachable`` is False during an outage, and ``recovered`` is set each
    time etcd answers again after one (owners that must re-check what they hold, e.g. an elected
    scheduler, wait on it and clear it). ``lost`` is set, and the task ends, only when etcd says
    the lease is gone (expired during the outage, or revoked behind our back); the owner should then
    register again. ``revoke()`` deletes the key at once (clean stop).

    ``give_up_after``: seconds without a successful refresh after which ``lost`` is set anyway
    (None, the default: never; an owner that must not hold a key it cannot renew sets it).
    """

    def __init__(self, registry: "Registry", key: str, lease: Any, ttl: int,
                 give_up_after: float | None = None) -> None:
        self.registry = registry
        self.key = key
        self.ttl = int(ttl)
        self._lease = lease
        self.lost = asyncio.Event()
        self.recovered = asyncio.Event()
        self.give_up_after = give_up_after
        self._task: asyncio.Task[None] | None = None
        self._last_ok = time.monotonic()
        self._outage = OutageLog(log, f"lease {key}")
        self.refreshes = 0

    @property
    def lease_id(self) -> int:
        """The etcd lease id."""
        return int(self._lease.id)

    @property
    def active(self) -> bool:
        """True while the keepalive task runs and the lease is not known to be lost."""
        return self._task is not None and not self._task.done() and not self.lost.is_set()

    @property
    def reachable(self) -> bool:
        """False while refreshes fail (etcd away); True otherwise."""
        return self._outage.down_since is None

    @property
    def outages(self) -> int:
        """How many etcd outages this lease has lived through (or is in)."""
        return self._outage.outages

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive(), name=f"lease-keepalive:{self.key}"
        )

    async def _keepalive(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        retry = max(self.ttl / 6.0, 0.1)
        per_try = max(0.5, min(self.registry.timeout, self.ttl / 2.0))
        delay = interval
        while True:
            await asyncio.sleep(delay)
            try:
                reply = await asyncio.wait_for(self.registry.client.refresh_lease(self.lease_id), per_try)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd away: keep the lease, keep trying (quietly)
                self._outage.failed(e)
                if self.give_up_after is not None and time.monotonic() - self._last_ok >= self.give_up_after:
                    log.error("lease for %s given up: no refresh for %.1f s (%r)", self.key,
                              time.monotonic() - self._last_ok, e)
                    self.lost.set()
                    return
                delay = min(interval, (delay if delay < interval else retry) * 1.5)
                continue
            if self._outage.ok() is not None:
                self.recovered.set()
            if reply is None or int(getattr(reply, "TTL", 0)) <= 0:
                log.error("lease for %s lost: etcd no longer knows lease %x", self.key, self.lease_id)
                self.lost.set()
                return
            self._last_ok = time.monotonic()
            self.refreshes += 1
            delay = interval

    async def stop_keepalive(self) -> None:
        """Stop refreshing without revoking: the key expires after at most ``ttl`` seconds
        (what a crashed worker looks like to everyone else)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def revoke(self) -> None:
        """Stop the keepalive and revoke the lease, deleting the key now (clean shutdown).

        Errors from etcd (e.g. lease already expired) are logged, not raised.
        """
        await self.stop_keepalive()
        try:
            await self.registry._call(self.registry.client.revoke_lease(self.lease_id))
        except Exception as e:
            log.warning("revoking lease for %s failed: %r", self.key, e)

    async def update(self, info: dict[str, Any]) -> None:
        """Replace the registered info, keeping the same lease."""
        await self.registry.put_json(self.key, info, lease=self.lease_id)

    async def __aenter__(self) -> "WorkerLease":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.revoke()


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
    async def open(cls, etcd_url: str, *, timeout: float = DEFAULT_TIMEOUT) -> "Registry":
        """Connect to etcd at ``etcd_url`` (``http://host:port``) and check it answers.

        Raises ValueError for a malformed URL, TimeoutError / aetcd ClientError if etcd does not
        answer within ``timeout`` seconds.
        """
        host, port = parse_etcd_url(etcd_url)
        client = aetcd.Client(host=host, port=port, timeout=timeout, connect_wait_timeout=int(max(1, timeout)),
                              options=GRPC_RECONNECT_OPTIONS)
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
    async def connect(cls, etcd_url: str, *, timeout: float = DEFAULT_TIMEOUT) -> AsyncIterator["Registry"]:
        """Async context manager yielding a connected Registry; closes it on exit (see open)."""
        reg = await cls.open(etcd_url, timeout=timeout)
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
        return await asyncio.wait_for(aw, self.timeout)

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
        resp = await self._call(self.client.get_prefix(_key(prefix), sort_order="ascend", sort_target="key"))
        out: dict[str, Any] = {}
        for kv in resp:
            k = kv.key.decode("utf-8")
            try:
                out[k] = _loads(kv.value)
            except orjson.JSONDecodeError:
                log.warning("skipping non-JSON value at %s", k)
        return out

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
        prefix = names.models_prefix()
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for k, v in (await self.get_prefix_json(prefix)).items():
            parts = k[len(prefix):].split("/")
            if len(parts) == 3 and parts[1] == "versions":
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

    async def list_workers(self, name: str, version: str) -> dict[str, dict[str, Any]]:
        """Return ``{worker_id: info}`` for the live workers of ``name@version``."""
        prefix = names.workers_prefix(name, version)
        return {k[len(prefix):]: v for k, v in (await self.get_prefix_json(prefix)).items()}

    # -- watches ---------------------------------------------------------------------------

    async def watch_prefix(
        self,
        prefix: str,
        *,
        start_revision: int | None = None,
        include_existing: bool = False,
        retry_delay: float = 0.5,
        max_retry_delay: float = 2.0,
    ) -> AsyncIterator[tuple[str, str, Any | None]]:
        """Yield ``(event, key, value)`` for every change under ``prefix``, forever.

        ``event`` is ``"put"`` (value = decoded JSON) or ``"delete"`` (value None). With
        ``include_existing`` the current keys are yielded first as puts (list-then-watch, no gap).
        On a broken stream it reconnects with backoff (``retry_delay`` doubling up to
        ``max_retry_delay`` seconds) and resumes after the last seen revision, so no event is lost
        or repeated. If that revision was compacted it resyncs: current keys as puts, and deletes
        for keys it had seen that are gone. Non-JSON values are logged and skipped. While etcd is
        away (also for the first listing) it keeps retrying and logs once per outage, not per try.
        Stop by breaking out of the loop / closing the generator.
        """
        known: set[str] = set()
        next_rev = start_revision
        outage = OutageLog(log, f"watch on {prefix}")
        if include_existing or next_rev is None:
            snap_rev, snapshot = await self._snapshot_retrying(prefix, retry_delay, max_retry_delay, outage)
            if include_existing:
                for k, v in snapshot.items():
                    known.add(k)
                    yield "put", k, v
            if next_rev is None:
                next_rev = snap_rev + 1
        delay = retry_delay
        while True:
            watch = None
            try:
                watch = await self._call(self.client.watch_prefix(_key(prefix), start_revision=next_rev))
                delay = retry_delay
                outage.ok()
                async for ev in watch:
                    k = ev.kv.key.decode("utf-8")
                    next_rev = int(ev.kv.mod_revision) + 1
                    if ev.kind == "DELETE":
                        known.discard(k)
                        yield "delete", k, None
                    else:
                        try:
                            v = _loads(ev.kv.value)
                        except orjson.JSONDecodeError:
                            log.warning("watch %s: skipping non-JSON value at %s", prefix, k)
                            continue
                        known.add(k)
                        yield "put", k, v
                # The iterator ended without an error: the watch was cancelled under us (etcd going away).
                outage.failed(RuntimeError("watch stream ended"))
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_retry_delay)
            except aetcd.exceptions.RevisionCompactedError as e:
                log.warning("watch on %s: revision %s compacted (%r); resyncing", prefix, next_rev, e)
                snap_rev, snapshot = await self._snapshot_retrying(prefix, retry_delay, max_retry_delay, outage)
                for k in sorted(known - snapshot.keys()):
                    known.discard(k)
                    yield "delete", k, None
                for k, v in snapshot.items():
                    known.add(k)
                    yield "put", k, v
                next_rev = snap_rev + 1
                continue
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:
                if not outage.failed(e):
                    log.debug("watch on %s failed (%r); reconnecting in %.1f s", prefix, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_retry_delay)
            finally:
                if watch is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(watch.cancel(), 1.0)

    async def _snapshot(self, prefix: str) -> tuple[int, dict[str, Any]]:
        resp = await self._call(self.client.get_prefix(_key(prefix), sort_order="ascend", sort_target="key"))
        out: dict[str, Any] = {}
        for kv in resp:
            k = kv.key.decode("utf-8")
            try:
                out[k] = _loads(kv.value)
            except orjson.JSONDecodeError:
                log.warning("skipping non-JSON value at %s", k)
        return int(resp.header.revision), out

    async def _snapshot_retrying(self, prefix: str, delay: float, max_delay: float,
                                 outage: "OutageLog | None" = None) -> tuple[int, dict[str, Any]]:
        outage = outage or OutageLog(log, f"listing of {prefix}")
        while True:
            try:
                out = await self._snapshot(prefix)
                outage.ok()
                return out
            except Exception as e:
                outage.failed(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, max_delay)
