"""The etcd client the registry uses: an ``aetcd.Client`` whose gRPC channel spans every member of a
cluster, optionally over mutual TLS.

An etcd URL here is one member (``http://10.0.0.1:2379``) or a comma-separated list of members
(``https://a:2379,https://b:2379,https://c:2379``; a missing scheme means ``http``; all members share
one scheme). :func:`parse_etcd_urls` validates it.

:class:`EtcdClient` replaces ``aetcd.Client.connect`` (which dials one ``host:port`` in clear) with a
channel to all members at once:

* target ``ipv4:a:p,b:p,...`` (``ipv6:`` for IPv6 addresses; names are resolved when the channel is
  built, IPv4 preferred); a single host name stays a ``dns:`` target so gRPC re-resolves it;
* ``round_robin`` load balancing: calls go to the members that answer; a member that dies (connection
  refused/reset) or goes silent (HTTP/2 keepalive, ``KEEPALIVE_TIME_MS``) is skipped until it is back;
* gRPC retries (service config) of a call that failed with UNAVAILABLE on another member: a member cut
  off from its cluster answers "etcdserver: no leader" (UNAVAILABLE) at once, because every call carries
  the ``hasleader`` metadata etcd's own clientv3 uses for watches (the member refuses calls, and ends
  watch streams, while it has no leader);
* per-attempt deadlines on a cluster of several members: a member that loses its leader keeps the
  proposals it forwarded until etcd's request timeout (5 s + 2 election timeouts), so the first write
  after the leader died took 6 s; each unary call here gets ``attempt_timeout`` seconds (default a third
  of ``timeout``, at least 1 s) and is tried again, on another member, until ``timeout`` has passed.
  A retried write may already have been applied: puts and deletes are idempotent; a retried
  create-if-absent transaction then reports the key taken (the election's candidate waits for its own
  unrefreshed lease to expire, ``ttl`` seconds), a retried lease grant leaves an unused lease to expire;
* with TLS (:class:`bus.tls.TlsFiles`; ``https`` URLs): ``grpc.ssl_channel_credentials`` with the CA and
  the client certificate (whose CN is the etcd user name when etcd runs with ``--client-cert-auth`` and
  auth enabled, docs/security.md). The name checked against the server certificate is the first member's
  host (``grpc.ssl_target_name_override``): every member's certificate must carry every member name.

Watches (``control.state.watch``) and lease keepalives (``control.state.leases``) need nothing more: a
broken watch stream is re-opened (on a live member) after the last revision seen, and leases are
cluster-wide, so a keepalive that reaches any live member keeps them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc, watcher

from bus.tls import TlsFiles

__all__ = ["EtcdEndpoints", "EtcdClient", "parse_etcd_urls", "channel_options", "KEEPALIVE_TIME_MS"]

# gRPC channel reconnect backoff (gRPC's doc/connection-backoff.md: 1 s initial, x1.6, up to 120 s by
# default). After a few seconds of etcd being away the default delay grows past a lease's TTL, so a
# keepalive reached a restarted etcd 3.9 s after it came back and the 2 s lease had expired (CI of
# stop 12). Leases here live 2-5 s: reconnect within half a second.
GRPC_RECONNECT_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
}

# HTTP/2 keepalive pings on a connection with calls in flight, so a member that went silent (partition,
# host down without a RST) is marked failed after KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS and its calls
# move on. etcd refuses pings more often than every 5 s (--grpc-keepalive-min-time) and pings without
# calls (GOAWAY "too_many_pings"), hence 6 s and no pings while idle.
KEEPALIVE_TIME_MS = 6000
KEEPALIVE_TIMEOUT_MS = 3000

_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{
        "name": [{"service": s} for s in ("etcdserverpb.KV", "etcdserverpb.Lease", "etcdserverpb.Watch",
                                          "etcdserverpb.Maintenance", "etcdserverpb.Cluster", "etcdserverpb.Auth")],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }],
}

# etcd's rpctypes.MetadataRequireLeaderKey / MetadataHasLeader.
_REQUIRE_LEADER = (("hasleader", "true"),)


@dataclass(frozen=True)
class EtcdEndpoints:
    """The members of one etcd cluster: ``scheme`` (``http`` or ``https``) and ``members``, a tuple of
    ``(host, port)``. Build with :func:`parse_etcd_urls`."""

    scheme: str
    members: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if self.scheme not in ("http", "https"):
            raise ValueError(f"etcd url scheme must be http or https, got {self.scheme!r}")
        if not self.members:
            raise ValueError("etcd url names no member")

    @property
    def tls(self) -> bool:
        """True for ``https`` URLs."""
        return self.scheme == "https"

    def urls(self) -> list[str]:
        """One ``scheme://host:port`` per member (IPv6 hosts bracketed)."""
        return [f"{self.scheme}://{_hostport(h, p)}" for h, p in self.members]

    def grpc_target(self) -> str:
        """The gRPC target spanning every member (see the module docstring). Raises ValueError when a
        name does not resolve, or when the members mix IPv4-only and IPv6-only addresses."""
        if len(self.members) == 1 and not _is_ip(self.members[0][0]):
            return f"dns:///{_hostport(*self.members[0])}"
        resolved = [(_resolve(h, p), p) for h, p in self.members]
        if all(v4 for (v4, _), _ in resolved):
            return "ipv4:" + ",".join(f"{v4}:{p}" for (v4, _), p in resolved)
        if all(v6 for (_, v6), _ in resolved):
            return "ipv6:" + ",".join(f"[{v6}]:{p}" for (_, v6), p in resolved)
        raise ValueError(f"etcd members {self.urls()} mix IPv4-only and IPv6-only addresses")


def parse_etcd_urls(url: str) -> EtcdEndpoints:
    """Parse an etcd URL or comma-separated list of member URLs (``http://a:2379,http://b:2379``;
    ``host:port`` means http) into :class:`EtcdEndpoints`. Raises ValueError naming the bad part: no
    member, a scheme other than http/https, mixed schemes, a member without host or port."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("etcd url is empty")
    schemes: set[str] = set()
    members: list[tuple[str, int]] = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        full = part if "://" in part else "http://" + part
        try:
            parts = urlsplit(full)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"etcd url {part!r}: {e}") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"etcd url {part!r}: scheme must be http or https")
        if not parts.hostname or port is None:
            raise ValueError(f"etcd url {part!r} must be host:port")
        schemes.add(parts.scheme)
        members.append((parts.hostname, port))
    if len(schemes) > 1:
        raise ValueError(f"etcd url {url!r} mixes http and https members")
    if not members:
        raise ValueError(f"etcd url {url!r} names no member")
    return EtcdEndpoints(schemes.pop(), tuple(members))


def channel_options(endpoints: EtcdEndpoints, extra: dict | None = None) -> dict:
    """gRPC channel options for ``endpoints``: reconnect backoff, keepalive, load balancing and retries,
    and the TLS name override for an https cluster; ``extra`` is added last."""
    opts = dict(GRPC_RECONNECT_OPTIONS)
    opts.update({
        "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
        "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.enable_retries": 1,
        "grpc.service_config": json.dumps(_SERVICE_CONFIG),
    })
    if endpoints.tls:
        opts["grpc.ssl_target_name_override"] = endpoints.members[0][0]
    opts.update(extra or {})
    return opts


class EtcdClient(aetcd.Client):
    """``aetcd.Client`` over every member of ``endpoints`` (:class:`EtcdEndpoints`), in clear or over
    mutual TLS (``tls``: :class:`bus.tls.TlsFiles`, required for https members: its CA verifies the
    members, its certificate and key identify this client). ``timeout`` (s) bounds each call;
    ``options`` are added to :func:`channel_options`. Raises ValueError for https without TLS files."""

    def __init__(self, endpoints: EtcdEndpoints, *, tls: TlsFiles | None = None, timeout: float | None = None,
                 attempt_timeout: float | None = None, options: dict | None = None,
                 connect_wait_timeout: int = 3) -> None:
        if endpoints.tls and (tls is None or not tls.ca):
            raise ValueError("https etcd members need a CA to verify them (ACTORSERVE_TLS_CA, docs/security.md)")
        host, port = endpoints.members[0]
        self.call_timeout = None if timeout is None else float(timeout)
        if len(endpoints.members) > 1 and timeout is not None:
            attempt = float(attempt_timeout) if attempt_timeout else max(1.0, float(timeout) / 3.0)
        else:
            attempt = timeout
        super().__init__(host=host, port=port, timeout=attempt, options=channel_options(endpoints, options),
                         connect_wait_timeout=connect_wait_timeout)
        self.endpoints = endpoints
        self.tls = tls if endpoints.tls else None

    async def connect(self) -> None:  # noqa: D401 - same contract as aetcd.Client.connect
        """Build the channel and stubs once (later calls return at once); nothing is dialled until the
        first call. Raises ValueError when a member name does not resolve or a TLS file is unreadable."""
        if self._connected.is_set():
            return
        target = self.endpoints.grpc_target()
        options = list(self._options.items())
        if self.tls is not None:
            creds = grpc.ssl_channel_credentials(**self.tls.grpc_credentials_args())
            self.channel = rpc.secure_channel(target, creds, options=options)
        else:
            self.channel = rpc.insecure_channel(target, options=options)
        self.metadata = _REQUIRE_LEADER
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self.auth_stub = rpc.AuthStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        self._connected.set()


_RETRIED = ("get", "get_prefix", "get_range", "put", "delete", "delete_prefix", "transaction", "lease",
            "revoke_lease", "refresh_lease", "get_lease_info", "status")
_RETRYABLE = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)


def _retrying(name: str):
    """``aetcd.Client.<name>`` tried again on another member after a per-attempt deadline or UNAVAILABLE,
    until the client's ``call_timeout`` has passed (clusters of several members only)."""
    parent = getattr(aetcd.Client, name)

    async def method(self: "EtcdClient", *args, **kwargs):
        if self.call_timeout is None or len(self.endpoints.members) < 2:
            return await parent(self, *args, **kwargs)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout
        delay = 0.05
        while True:
            try:
                return await parent(self, *args, **kwargs)
            except _RETRYABLE:
                if loop.time() + delay >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = parent.__doc__
    return method


for _name in _RETRIED:
    if hasattr(aetcd.Client, _name):
        setattr(EtcdClient, _name, _retrying(_name))


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _resolve(host: str, port: int) -> tuple[str | None, str | None]:
    """``(first IPv4 address, first IPv6 address)`` of ``host`` (either may be None); ValueError if none."""
    if _is_ip(host):
        ip = ipaddress.ip_address(host)
        return (host, None) if ip.version == 4 else (None, host)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"etcd member {host!r} does not resolve: {e}") from None
    v4 = next((i[4][0] for i in infos if i[0] == socket.AF_INET), None)
    v6 = next((i[4][0] for i in infos if i[0] == socket.AF_INET6), None)
    if v4 is None and v6 is None:
        raise ValueError(f"etcd member {host!r} does not resolve")
    return v4, v6
