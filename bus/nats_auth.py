"""NATS users of the embedded nats-server: the internal (operator) user, one user per internal role
(control/ops/nats_roles.py: the actors connect as these), one user per tenant API key.

The internal user ``actorserve`` may do anything; its URL is in the 0600 ``endpoints.json`` for operators,
CLI tools and tests, and no actor started by the supervisor gets it (each gets its role's URL).

Isolation (issue #5 item 7): a tenant's NATS user may publish only to the public API subjects
(``as.api.v1.chat|completions|cancel|responses`` and ``as.api.v1.responses.get|input_items|delete|cancel``)
and subscribe only to its own inbox prefix ``_INBOX.<tenant>.>`` (docs/architecture.md), so it can neither read another tenant's token streams nor reach internal subjects.
The user name is the key id, the password the API key itself, stored as a bcrypt hash in the key's
tenant record (``nats_hash``; control/state/tenants.py). The gateway still authenticates the API key sent in
the request's ``Authorization`` header and checks that the reply subject lies under that tenant's inbox
prefix, so a tenant cannot charge or answer into another tenant's inbox either.

Config syntax: the nats-server config format accepts JSON values (docs.nats.io, "Configuration
File Format"); permissions as in "Authorization" (publish/subscribe allow lists).
"""

from __future__ import annotations

import json
import os
import logging
import secrets
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from bus import subjects

log = logging.getLogger(__name__)

INTERNAL_USER = "actorserve"
INTERNAL_PASSWORD_FILE = "nats-internal-password"
TENANT_PUBLISH = (subjects.API_CHAT, subjects.API_COMPLETIONS, subjects.API_CANCEL, subjects.API_RESPONSES,
                  *subjects.API_RESPONSES_OPS,  # the stored-response operations (get, input_items, delete, cancel)
                  *subjects.API_FILES_OPS, *subjects.API_BATCHES_OPS)  # OpenAI Files and Batch (docs/batch.md)


def tenant_permissions(tenant_id: str) -> dict[str, Any]:
    """Publish/subscribe allow lists of a tenant's NATS users."""
    return {"publish": {"allow": list(TENANT_PUBLISH)},
            "subscribe": {"allow": [subjects.tenant_inbox_prefix(tenant_id) + ".>"]}}


def tenant_users(tenants: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """NATS user entries for every active key with a ``nats_hash`` of every tenant record
    (``{tenant_id: record}`` as stored at /actorserve/tenants/{id}), sorted by user name."""
    users = []
    for tid, rec in sorted(tenants.items()):
        for kid, key in sorted((rec.get("keys") or {}).items()):
            if key.get("nats_hash") and key.get("hash") and not key.get("revoked"):
                users.append({"user": kid, "password": key["nats_hash"], "permissions": tenant_permissions(tid)})
    return users


def authorization_block(internal_password: str, users: list[dict[str, Any]],
                        role_users: list[dict[str, Any]] = ()) -> str:
    """The ``authorization { users = [...] }`` section: the internal (operator) user (everything), the
    internal roles' users (control/ops/nats_roles.py ``role_users``) and the tenant ``users``."""
    internal = {"user": INTERNAL_USER, "password": internal_password,
                "permissions": {"publish": {"allow": [subjects.EVERYTHING]},
                                "subscribe": {"allow": [subjects.EVERYTHING]}}}
    return "authorization " + json.dumps({"users": [internal, *role_users, *users]}, indent=1) + "\n"


def internal_password(state_dir: str | Path) -> str:
    """The internal user's password, created (mode 0600) under the state dir on first use."""
    path = Path(state_dir) / INTERNAL_PASSWORD_FILE
    if path.exists():
        return path.read_text().strip()
    pw = secrets.token_urlsafe(24)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(pw + "\n")
    os.replace(tmp, path)
    return pw


OPERATOR_TOKEN_FILE = "operator-token"  # <state-dir>/operator-token (mode 0600): the operator's bearer token
OPERATOR_TOKEN_ENV = "ACTORSERVE_OPERATOR_TOKEN"  # how a gateway receives it (environment, never argv)


def operator_token(state_dir: str | Path) -> str:
    """The stack's operator token (``GET /metrics`` on the gateways needs ``Authorization: Bearer`` it):
    read from ``<state-dir>/operator-token``, created there (random, 32 bytes URL-safe, mode 0600) on
    first use and kept across restarts so scrapers keep working. Raises OSError if the state dir is not
    writable."""
    path = Path(state_dir) / OPERATOR_TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def redact_url(url: str) -> str:
    """``url`` (or a comma-separated list) with any password replaced by ``***``
    (``nats://user:***@host:port``), for printing."""
    if "," in url:
        return ",".join(redact_url(u) for u in url.split(","))
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}"


def with_credentials(url: str, user: str, password: str) -> str:
    """``nats://user:password@host:port`` from ``nats://host:port`` (password is URL-safe)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{user}:{password}@{rest}"


class TenantUserSync:
    """Keeps the embedded nats-server's tenant users equal to the tenant records in etcd.

    ``read_tenants``: a blocking callable returning ``{tenant_id: record}``; ``apply``: a callable
    taking the user list (EmbeddedNats.set_tenant_users: rewrites the config and reloads the server when
    it changed). Polls every ``interval_s`` seconds in a daemon thread, so a revoked key loses its NATS
    user (and its connections: nats-server re-checks clients on reload) within about one interval.
    """

    def __init__(self, read_tenants: Callable[[], Mapping[str, Any]], apply: Callable[[list], None],
                 interval_s: float = 0.5) -> None:
        self.read_tenants, self.apply, self.interval_s = read_tenants, apply, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync_once(self) -> None:
        """Read the tenants and apply their users once (errors are logged, not raised)."""
        try:
            self.apply(tenant_users(self.read_tenants()))
        except Exception as exc:  # etcd away: keep the current users
            log.warning("NATS tenant users not refreshed: %s", exc)

    def start(self) -> "TenantUserSync":
        """Sync now, then every ``interval_s`` in the background."""
        self.sync_once()
        self._thread = threading.Thread(target=self._loop, name="nats-tenant-users", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sync_once()

    def stop(self) -> None:
        """Stop polling (bounded join)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
