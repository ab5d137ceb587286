"""Server configs and probes of the cluster test: the 3-node NATS cluster (config files), the 3-member
etcd cluster (argv), the credentials, and the small checks the test runs against them.

NATS (docs.nats.io, "Clustering" and "JetStream Clustering"): every server listens on its host's address
(client 4222, routes 6222, monitoring 8222), names itself ``n-<host>``, routes to the two others with a
route user, runs JetStream with its own store directory; the ``authorization`` block is
bus/nats_auth.py's (internal operator user, the per-role users of control/ops/nats_roles.py, the
tenant's key user). etcd: members ``e-<host>`` with client 2379 and peer 2380 on the host's address,
``--initial-cluster`` naming all three and a token unique to the run.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from control.ops.embedded_nats import nats_tls_block
from control.ops.embedded_server import find_binary

if TYPE_CHECKING:
    from tests.cluster.stack import Cluster

NATS_PORT, NATS_ROUTE_PORT, NATS_MONITOR_PORT = 4222, 6222, 8222
ETCD_PORT, ETCD_PEER_PORT = 2379, 2380
NATS_CLUSTER = "actorserve"


def binary(name: str) -> str:
    """Path of ``nats-server`` / ``etcd`` / ``etcdctl`` (next to the venv's python, else PATH)."""
    return find_binary(name)


@dataclass
class Auth:
    """Every NATS credential of the cluster (kept under ``secrets_dir``, mode 0600)."""

    secrets_dir: Path
    internal: str
    roles: dict[str, str]
    route_password: str
    tenant_users: list[dict] = field(default_factory=list)

    @classmethod
    def create(cls, secrets_dir: Path) -> "Auth":
        """Fresh passwords (bus/nats_auth.py and nats_roles.py files under ``secrets_dir``)."""
        from bus.nats_auth import internal_password
        from control.ops.nats_roles import role_passwords

        secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return cls(secrets_dir, internal_password(secrets_dir), role_passwords(secrets_dir),
                   secrets.token_urlsafe(18))

    def url(self, role: str | None, addr: str, scheme: str = "nats") -> str:
        """``nats://user:password@addr:4222`` of ``role`` (None: the internal operator user; ``scheme``
        ``tls`` with TLS)."""
        from bus.subjects import role_user
        from bus.nats_auth import INTERNAL_USER, with_credentials

        base = f"{scheme}://{addr}:{NATS_PORT}"
        if role is None:
            return with_credentials(base, INTERNAL_USER, self.internal)
        return with_credentials(base, role_user(role), self.roles[role])

    def authorization(self) -> str:
        """The ``authorization { users = [...] }`` block of every server."""
        from bus.nats_auth import authorization_block
        from control.ops.nats_roles import role_users

        return authorization_block(self.internal, self.tenant_users, role_users(self.roles))


def write_nats_config(cluster: "Cluster", host: str) -> Path:
    """Write ``<base>/<host>/nats.conf`` (0600: it holds the passwords); returns its path."""
    from control.ops.nats_roles import write_private

    addr = cluster.addr(host)
    store = cluster.base / host / "jetstream"
    routes = [f"nats-route://route:{cluster.auth.route_password}@{cluster.addr(h)}:{NATS_ROUTE_PORT}"
              for h in ("h1", "h2", "h3") if h != host]
    conf = (
        f'server_name: "n-{host}"\n'
        f'listen: "{addr}:{NATS_PORT}"\n'
        f'http: "{addr}:{NATS_MONITOR_PORT}"\n'
        "max_payload: 8MB\n"
        # a silent peer (partitioned host) is dropped after 2 unanswered PINGs 2 s apart, and a write to
        # it stalls at most 2 s (defaults: 2 min, 10 s)
        'ping_interval: "2s"\nping_max: 2\nwrite_deadline: "2s"\n'
        f'jetstream {{\n  store_dir: "{store}"\n  max_file_store: 1G\n  max_memory_store: 256M\n}}\n'
        "cluster {\n"
        f'  name: "{NATS_CLUSTER}"\n'
        f'  listen: "{addr}:{NATS_ROUTE_PORT}"\n'
        f'  authorization {{ user: "route", password: "{cluster.auth.route_password}" }}\n'
        f"  routes: {json.dumps(routes)}\n"
        "  no_advertise: true\n"  # clients keep their own URL list (gossiped URLs carry no credentials)
        + _route_tls(cluster.tls_dir) +
        "}\n"
        + cluster.auth.authorization()
        + nats_tls_block(cluster.tls_dir)
    )
    path = cluster.base / host / "nats.conf"
    write_private(path, conf)
    return path


def _route_tls(tls_dir: Path | None) -> str:
    """The ``cluster { tls {...} }`` block: routes are mutual TLS, so each server presents a certificate
    with client and server use -- ``etcd-peer`` (the cluster-internal peer certificate of ``actorserve
    certs``: both uses, every member's address); ``nats-server`` is a server-only certificate."""
    if tls_dir is None:
        return ""
    return ("  tls {\n"
            f"    cert_file: {json.dumps(str(tls_dir / 'etcd-peer.pem'))}\n"
            f"    key_file: {json.dumps(str(tls_dir / 'etcd-peer-key.pem'))}\n"
            f"    ca_file: {json.dumps(str(tls_dir / 'ca.pem'))}\n"
            "    timeout: 5\n"
            "  }\n")


def etcd_argv(cluster: "Cluster", host: str) -> list[str]:
    """argv of the host's etcd member (data in ``<base>/<host>/etcd``; same argv on a restart: an
    existing data directory ignores the ``--initial-*`` flags)."""
    from control.ops.embedded import etcd_tls_flags

    addr, sch = cluster.addr(host), "https" if cluster.tls else "http"
    peers = ",".join(f"e-{h}={sch}://{cluster.addr(h)}:{ETCD_PEER_PORT}" for h in ("h1", "h2", "h3"))
    return [binary("etcd"), "--name", f"e-{host}", "--data-dir", str(cluster.base / host / "etcd"),
            "--listen-client-urls", f"{sch}://{addr}:{ETCD_PORT}",
            "--advertise-client-urls", f"{sch}://{addr}:{ETCD_PORT}",
            "--listen-peer-urls", f"{sch}://{addr}:{ETCD_PEER_PORT}",
            "--initial-advertise-peer-urls", f"{sch}://{addr}:{ETCD_PEER_PORT}",
            *(etcd_tls_flags(cluster.tls_dir) if cluster.tls else ()),
            "--initial-cluster", peers, "--initial-cluster-state", "new",
            "--initial-cluster-token", f"actorserve-{cluster.net.owner}",
            "--heartbeat-interval", "150", "--election-timeout", "1500",
            "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024**3)]


# -- state read by the test ---------------------------------------------------------------------------

async def tenant_users(etcd_urls: str, tls=None) -> list[dict]:
    """NATS user entries of every tenant key (bus/nats_auth.py); ``tls``: bus.tls.TlsFiles."""
    from bus.nats_auth import tenant_users as users
    from control.state.registry import Registry

    async with Registry.connect(etcd_urls, tls=tls) as reg:
        return users(await reg.list_tenants())


async def registry_state(etcd_urls: str, tls=None) -> tuple[dict | None, dict]:
    """(the active scheduler's election value, the registered workers) of the test model."""
    from control.state.names import scheduler_key
    from control.state.registry import Registry
    from tests.cluster.stack import MODEL, VERSION

    async def go():
        async with Registry.connect(etcd_urls, timeout=3.0, tls=tls) as reg:
            return await reg.get_json(scheduler_key(MODEL, VERSION)), await reg.list_workers(MODEL, VERSION)
    return await asyncio.wait_for(go(), 5.0)


def etcd_leader(cluster: "Cluster") -> str | None:
    """The host whose etcd member leads (``etcdctl endpoint status``), None if none answers."""
    eps = cluster.etcd_urls()
    tls = cluster.tls_files()
    certs = ["--cacert", tls.ca, "--cert", tls.cert, "--key", tls.key] if tls else []
    r = subprocess.run([binary("etcdctl"), "--endpoints", eps, *certs, "endpoint", "status", "-w", "json",
                        "--command-timeout=2s"], capture_output=True, text=True, timeout=10)
    try:
        rows = json.loads(r.stdout or "[]")
    except json.JSONDecodeError:
        return None
    for row in rows:
        st = row.get("Status") or {}
        if st.get("leader") and st.get("leader") == (st.get("header") or {}).get("member_id"):
            ep = row.get("Endpoint", "")
            return next((h for h in ("h1", "h2", "h3") if f"//{cluster.addr(h)}:" in ep), None)
    return None


async def stream_leader(cluster: "Cluster", stream: str) -> str | None:
    """The host whose nats-server leads JetStream stream ``stream`` (stream info ``cluster.leader``)."""
    import nats

    nc = await nats.connect(cluster.nats_urls(None).split(","), connect_timeout=3, max_reconnect_attempts=1,
                            allow_reconnect=False, **({"tls": cluster.client_ssl()} if cluster.tls else {}))
    try:
        info = await nc.jetstream(timeout=3).stream_info(stream)
        leader = info.cluster.leader if info.cluster else None
        return leader[2:] if leader and leader.startswith("n-") else leader
    finally:
        await nc.close()


async def stream_replicas(cluster: "Cluster") -> dict[str, int]:
    """``{stream: replicas}`` of every JetStream stream (KV buckets and object stores are streams too)."""
    import nats

    nc = await nats.connect(cluster.nats_urls(None).split(","), connect_timeout=3, max_reconnect_attempts=1,
                            allow_reconnect=False, **({"tls": cluster.client_ssl()} if cluster.tls else {}))
    try:
        js = nc.jetstream(timeout=3)
        return {s.config.name: s.config.num_replicas for s in await js.streams_info()}
    finally:
        await nc.close()


def probe(url: str, key: str, model: str, timeout: float = 8.0, verify=None) -> str | None:
    """None when the gateway at ``url`` serves what the load uses: ``/readyz`` 200, a 2-token chat
    completion with an ``Idempotency-Key`` (the as_idem bucket), an async job accepted (the AS_JOBS
    stream and as_jobs bucket); else what failed."""
    import uuid

    headers = {"Authorization": f"Bearer {key}"}
    chat = {"model": model, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2,
            "deadline_ms": int(timeout * 1000)}
    try:
        v = verify if verify is not None else True
        if httpx.get(url + "/readyz", timeout=2, verify=v).status_code != 200:
            return "not ready"
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=timeout, verify=v,
                       headers={**headers, "Idempotency-Key": f"probe-{uuid.uuid4().hex}"})
        if r.status_code != 200:
            return f"probe answered {r.status_code} {r.text[:120]}"
        j = httpx.post(url + "/v1/jobs", timeout=timeout, headers=headers, verify=v,
                       json={"endpoint": "/v1/chat/completions", "body": chat})
        if j.status_code != 202:
            return f"job probe answered {j.status_code} {j.text[:120]}"
    except httpx.HTTPError as e:
        return repr(e)[:160]
    return None
