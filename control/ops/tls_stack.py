"""TLS for the stack ``actorserve up --tls`` runs (docs/security.md): certificates in ``<state-dir>/tls/``,
each child's TLS environment, and the context the supervisor's own HTTPS probes use.

* :func:`prepare_tls` makes the certificates (control/ops/certs.py; missing ones only) and points this
  process (the supervisor: etcd root) at the root client certificate through ``ACTORSERVE_TLS_*``;
* :func:`child_tls_env` is what an actor of a kind gets: the CA and its role's client certificate (its
  etcd user), and for a gateway also the HTTPS server certificate (``ACTORSERVE_HTTPS_CERT``/``_KEY``);
* the ``tls`` entry of ``endpoints.json`` and its reverse (used by CLI verbs that find the stack there: they
  act as ``root``) are :func:`bus.tls.endpoints_tls` and :func:`bus.tls.apply_endpoints_tls`.
"""

from __future__ import annotations

import os
import socket
import ssl
from pathlib import Path

from bus.tls import ENV_TLS_CA, TlsFiles

TLS_DIR_NAME = "tls"
ENV_HTTPS_CERT = "ACTORSERVE_HTTPS_CERT"  # gateway/actor.py reads these two
ENV_HTTPS_KEY = "ACTORSERVE_HTTPS_KEY"

__all__ = ["prepare_tls", "child_tls_env", "probe_context", "TLS_DIR_NAME"]


def _san_hosts(host: str) -> list[str]:
    """Extra SANs for gateways bound to ``host``: itself, or this machine's name for a wildcard bind."""
    if host in ("127.0.0.1", "localhost", "::1", ""):
        return []
    if host in ("0.0.0.0", "::"):
        return [socket.gethostname()]
    return [host]


def prepare_tls(state_dir: str | os.PathLike[str], host: str = "127.0.0.1") -> Path:
    """Ensure ``<state_dir>/tls/`` holds every certificate (SANs: loopback and ``host``), set this
    process's ``ACTORSERVE_TLS_*`` to the CA and the root client certificate, return the directory.
    Raises ValueError / OSError from control.ops.certs.ensure_certs."""
    from control.ops.certs import ROOT_ROLE, ensure_certs

    d = Path(state_dir) / TLS_DIR_NAME
    ensure_certs(d, _san_hosts(host))
    os.environ.update(TlsFiles.in_dir(d, ROOT_ROLE).env())
    return d


def child_tls_env(tls_dir: str | os.PathLike[str], kind: str | None) -> dict[str, str]:
    """Environment of an actor of ``kind`` (actors/kinds.py) in a TLS stack: ``ACTORSERVE_TLS_CA``,
    ``_CERT``, ``_KEY`` of its role (control/ops/nats_roles.py KIND_ROLES; root for other kinds), and
    for a gateway ``ACTORSERVE_HTTPS_CERT``/``_KEY`` (the ``gateway-server`` certificate)."""
    from control.ops.certs import ROOT_ROLE
    from control.ops.nats_roles import KIND_ROLES

    d = Path(tls_dir)
    env = TlsFiles.in_dir(d, KIND_ROLES.get(kind or "", ROOT_ROLE)).env()
    if kind == "gateway":
        env[ENV_HTTPS_CERT] = str(d / "gateway-server.pem")
        env[ENV_HTTPS_KEY] = str(d / "gateway-server-key.pem")
    return env


def probe_context(url: str) -> ssl.SSLContext | None:
    """For an ``https`` URL the client context of a local probe (``/readyz``): verifies against
    ``ACTORSERVE_TLS_CA`` (the system store when unset); None for http."""
    if not url.startswith("https://"):
        return None
    return ssl.create_default_context(cafile=os.environ.get(ENV_TLS_CA) or None)
