"""Embedded infrastructure: real ``nats-server`` and ``etcd`` processes on loopback ports, and the
``endpoints.json`` file that tells actors and CLI verbs where they are.

Used by ``actorserve up`` and by the test fixtures. The process handling every server shares (binary
lookup, free ports kept across ``restart()``, own process group, pid file, log under the state
directory, sync and async start/stop) is :class:`ServerProcess` (control/ops/embedded_server.py);
:class:`EmbeddedNats` (its config and users) is in control/ops/embedded_nats.py; this module has
:class:`EmbeddedEtcd`, :class:`EmbeddedStack` (both servers) and the endpoints file.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from control.ops.embedded_nats import EmbeddedNats
from control.ops.embedded_server import ServerProcess, http_get_json
from control.ops.ports import LOOPBACK

ENDPOINTS_FILE = "endpoints.json"
ETCD_AUTH_MARKER = "etcd-auth-enabled"  # <state-dir>/etcd-auth-enabled: this etcd data has auth (RBAC) on


class EmbeddedEtcd(ServerProcess):
    """A single-member ``etcd`` on 127.0.0.1.

    Client and peer ports are free loopback ports; data lives in ``<state-dir>/etcd/``.
    ``url`` is ``http://127.0.0.1:PORT``. Ready when ``GET /health`` returns ``{"health":"true"}``.
    """

    name = "etcd"
    binary = "etcd"
    port_count = 2

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        startup_timeout: float = 30.0,
        quota_backend_bytes: int = 2 * 1024**3,
        tls_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(state_dir, startup_timeout=startup_timeout)
        self.quota_backend_bytes = int(quota_backend_bytes)
        self.tls_dir = None if tls_dir is None else Path(tls_dir)  # `actorserve certs` output: mutual TLS on

    @property
    def scheme(self) -> str:
        """``https`` with ``tls_dir``, else ``http``."""
        return "https" if self.tls_dir is not None else "http"

    @property
    def url(self) -> str:
        """Client URL, ``http://127.0.0.1:PORT`` (``https://`` with ``tls_dir``)."""
        return f"{self.scheme}://{LOOPBACK}:{self.port}"

    @property
    def peer_port(self) -> int:
        """Peer (raft) port on 127.0.0.1. Raises RuntimeError before the first start."""
        if self.ports is None:
            raise RuntimeError("etcd has not been started")
        return self.ports[1]

    def _argv(self, binary: str) -> list[str]:
        client = f"{self.scheme}://{LOOPBACK}:{self.port}"
        peer = f"{self.scheme}://{LOOPBACK}:{self.peer_port}"
        return [
            binary,
            "--name", "default",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            "--quota-backend-bytes", str(self.quota_backend_bytes),
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "1h",
        ] + (etcd_tls_flags(self.tls_dir) if self.tls_dir is not None else [])

    def _ready(self) -> bool:
        if self.tls_dir is not None:
            return _https_health(f"{self.url}/health", self.tls_dir)
        body = http_get_json(f"{self.url}/health")
        return isinstance(body, dict) and str(body.get("health")) == "true"


def etcd_tls_flags(tls_dir: str | os.PathLike[str]) -> list[str]:
    """etcd flags for mutual TLS with the files of ``actorserve certs`` in ``tls_dir`` (docs/security.md):
    client port (``etcd-server``, clients must present a certificate of the CA; the CN is the etcd user)
    and peer port (``etcd-peer``, members must present one too)."""
    d = Path(tls_dir)
    return ["--cert-file", str(d / "etcd-server.pem"), "--key-file", str(d / "etcd-server-key.pem"),
            "--trusted-ca-file", str(d / "ca.pem"), "--client-cert-auth",
            "--peer-cert-file", str(d / "etcd-peer.pem"), "--peer-key-file", str(d / "etcd-peer-key.pem"),
            "--peer-trusted-ca-file", str(d / "ca.pem"), "--peer-client-cert-auth"]


def _https_health(url: str, tls_dir: Path) -> bool:
    """etcd's ``/health`` over mutual TLS with the root certificate (loopback)."""
    import ssl
    import urllib.request

    from bus.tls import TlsFiles
    ctx = TlsFiles.in_dir(tls_dir, "root").client_context()
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=ctx) as resp:  # noqa: S310 (loopback only)
            body = json.loads(resp.read().decode("utf-8"))
    except (OSError, ValueError, ssl.SSLError):
        return False
    return isinstance(body, dict) and str(body.get("health")) == "true"


class EmbeddedStack:
    """Both embedded servers (etcd and nats-server) under one state directory.

    ``start()`` starts etcd then NATS (if NATS fails, etcd is stopped again before raising);
    ``stop()`` stops NATS then etcd. Usable as ``with`` / ``async with``. ``nats_auth``: NATS users on
    (an internal user for the actors, tenant users via ``nats.set_tenant_users``; bus/nats_auth.py).
    """

    def __init__(self, state_dir: str | os.PathLike[str], *, startup_timeout: float = 30.0,
                 nats_auth: bool = False, tls_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir).resolve()
        self.tls_dir = None if tls_dir is None else Path(tls_dir)  # TLS on both, etcd RBAC (docs/security.md)
        self.etcd = EmbeddedEtcd(self.state_dir, startup_timeout=startup_timeout, tls_dir=self.tls_dir)
        self.nats = EmbeddedNats(self.state_dir, startup_timeout=startup_timeout, auth=nats_auth,
                                 tls_dir=self.tls_dir)

    @property
    def nats_url(self) -> str:
        """``nats://127.0.0.1:PORT`` of the embedded NATS server, with the internal user's credentials
        (``nats://actorserve:PASSWORD@...``) when ``nats_auth`` is on."""
        return self.nats.client_url

    @property
    def etcd_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the embedded etcd."""
        return self.etcd.url

    def start(self) -> "EmbeddedStack":
        """Start etcd and NATS; RuntimeError (with log tails) if either fails."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        marker = self.state_dir / ETCD_AUTH_MARKER
        if self.tls_dir is None and marker.exists():  # etcd keeps auth on in its data: plain clients get nothing
            raise RuntimeError(f"{self.state_dir} was set up with TLS (etcd auth is on in its data): start it "
                               f"with TLS again (`actorserve up --tls`) or use another state directory")
        self.etcd.start()
        try:
            if self.tls_dir is not None:  # per-role etcd users and roles, auth on (once; kept in etcd's data)
                from bus.tls import TlsFiles
                from control.ops.etcd_auth import enable_rbac_sync
                enable_rbac_sync(self.etcd.url, TlsFiles.in_dir(self.tls_dir, "root"))
                marker.write_text("etcd auth enabled by actorserve (docs/security.md)\n")
            self.nats.start()
        except BaseException:
            self.etcd.stop()
            raise
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop NATS then etcd (see ServerProcess.stop); idempotent."""
        try:
            self.nats.stop(timeout)
        finally:
            self.etcd.stop(timeout)

    def write_endpoints(self, http_url: str | None = None) -> Path:
        """Write ``<state-dir>/endpoints.json`` for this stack; returns its path."""
        return write_endpoints(self.state_dir, self.nats_url, self.etcd_url, http_url, tls_dir=self.tls_dir)

    def __enter__(self) -> "EmbeddedStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> "EmbeddedStack":
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    def __repr__(self) -> str:
        return f"<EmbeddedStack nats={self.nats!r} etcd={self.etcd!r}>"


def write_endpoints(
    state_dir: str | os.PathLike[str],
    nats_url: str,
    etcd_url: str,
    http_url: str | None = None,
    *,
    tls_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Atomically write ``<state-dir>/endpoints.json`` with nats_url, etcd_url, http_url (and, with
    ``tls_dir``, ``tls: {"dir", "ca"}``: where the certificates are; control/ops/tls_stack.py).

    ``http_url`` may be None (written as null) when no gateway runs. The file is mode 0600: ``nats_url``
    carries the internal NATS user's password when NATS users are on. Returns the file's path.
    """
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / ENDPOINTS_FILE
    tmp = path.with_name(f".{ENDPOINTS_FILE}.{os.getpid()}.tmp")
    data: dict[str, Any] = {"nats_url": nats_url, "etcd_url": etcd_url, "http_url": http_url}
    if tls_dir is not None:
        from bus.tls import endpoints_tls
        data["tls"] = endpoints_tls(tls_dir)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_endpoints(state_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read ``<state-dir>/endpoints.json``.

    Returns a dict with at least the keys nats_url, etcd_url, http_url (missing ones as None).
    Raises FileNotFoundError if the file does not exist and ValueError if it is not a JSON object.
    """
    path = Path(state_dir) / ENDPOINTS_FILE
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    for k in ("nats_url", "etcd_url", "http_url"):
        data.setdefault(k, None)
    return data
