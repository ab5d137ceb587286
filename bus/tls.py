"""TLS settings every process shares: where the CA, its own certificate and its key are (file paths),
and the ``ssl`` / gRPC objects built from them. Standard library only (used by bus/, control/ and
gateway/ alike).

Configuration (docs/security.md): three environment variables, each a file path —

* ``ACTORSERVE_TLS_CA``: the CA certificate (PEM) that verifies the servers (NATS, etcd) and, on a
  server, the clients;
* ``ACTORSERVE_TLS_CERT`` / ``ACTORSERVE_TLS_KEY``: this process's client certificate and key (PEM;
  the certificate's CN names its etcd user). Both or neither.

No variable set means no TLS (plain ``nats://`` and ``http://`` as on loopback). The files themselves
hold the secrets; only their paths travel (environment, argv, endpoints.json).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ENV_TLS_CA = "ACTORSERVE_TLS_CA"
ENV_TLS_CERT = "ACTORSERVE_TLS_CERT"
ENV_TLS_KEY = "ACTORSERVE_TLS_KEY"

ROOT_ROLE = "root"  # the etcd / NATS user of the supervisor and of the CLI verbs (control/ops/etcd_auth.py)

__all__ = ["TlsFiles", "ENV_TLS_CA", "ENV_TLS_CERT", "ENV_TLS_KEY", "ROOT_ROLE", "endpoints_tls", "apply_endpoints_tls"]


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a CA certificate (``ca``), a certificate (``cert``) and its private key (``key``), all PEM;
    any may be None, but ``cert`` and ``key`` come together. Raises ValueError otherwise (naming the
    field); files are read only when a context is built (OSError / ssl.SSLError then)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"tls {name} must be a non-empty file path, got {v!r}")
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"tls cert and key come together ({ENV_TLS_CERT} and {ENV_TLS_KEY})")
        if self.ca is None and self.cert is None:
            raise ValueError(f"tls needs at least a CA ({ENV_TLS_CA}) or a certificate")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "TlsFiles | None":
        """The files named by ``ACTORSERVE_TLS_CA`` / ``_CERT`` / ``_KEY`` in ``env`` (default
        ``os.environ``); None when none is set. Raises ValueError for a half-set pair."""
        env = os.environ if env is None else env
        ca, cert, key = (env.get(k) or None for k in (ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY))
        if ca is None and cert is None and key is None:
            return None
        return cls(ca=ca, cert=cert, key=key)

    @classmethod
    def in_dir(cls, directory: str | os.PathLike[str], role: str) -> "TlsFiles":
        """The files ``actorserve certs`` wrote into ``directory`` for ``role`` (``ca.pem``,
        ``<role>.pem``, ``<role>-key.pem``)."""
        d = Path(directory)
        return cls(ca=str(d / "ca.pem"), cert=str(d / f"{role}.pem"), key=str(d / f"{role}-key.pem"))

    def env(self) -> dict[str, str]:
        """The environment variables that name these files (for a child process)."""
        out = {}
        for var, v in ((ENV_TLS_CA, self.ca), (ENV_TLS_CERT, self.cert), (ENV_TLS_KEY, self.key)):
            if v is not None:
                out[var] = str(v)
        return out

    def client_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for a client: verifies the server against ``ca`` (the system store when
        no CA is set) and the host name, presents ``cert``/``key`` when set. TLS 1.2 at least."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def server_context(self, *, require_client_cert: bool = False) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for a server presenting ``cert``/``key``; with ``require_client_cert``
        clients must present a certificate signed by ``ca``. Raises ValueError without a cert."""
        if self.cert is None:
            raise ValueError("a TLS server needs a certificate and key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if require_client_cert:
            if self.ca is None:
                raise ValueError("requiring client certificates needs a CA")
            ctx.load_verify_locations(cafile=self.ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def grpc_credentials_args(self) -> dict[str, bytes | None]:
        """Keyword arguments of ``grpc.ssl_channel_credentials``: ``root_certificates``, ``private_key``,
        ``certificate_chain`` (file contents, None where unset). Raises OSError if a file is unreadable."""
        def read(p: str | None) -> bytes | None:
            return None if p is None else Path(p).read_bytes()
        return {"root_certificates": read(self.ca), "private_key": read(self.key),
                "certificate_chain": read(self.cert)}


def endpoints_tls(tls_dir: str | os.PathLike[str] | None) -> dict[str, str] | None:
    """The ``tls`` entry of endpoints.json: ``{"dir": ..., "ca": ...}`` (paths only), None without TLS."""
    if tls_dir is None:
        return None
    d = Path(tls_dir).resolve()
    return {"dir": str(d), "ca": str(d / "ca.pem")}


def apply_endpoints_tls(entry: Any, env: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
    """Point ``env`` (default ``os.environ``) at the root certificate of an endpoints.json ``tls`` entry
    unless ``ACTORSERVE_TLS_CERT`` is already set; True when it did. Ignores a malformed entry."""
    env = os.environ if env is None else env
    if not isinstance(entry, Mapping) or not isinstance(entry.get("dir"), str) or env.get(ENV_TLS_CERT):
        return False
    env.update(TlsFiles.in_dir(entry["dir"], ROOT_ROLE).env())
    return True
