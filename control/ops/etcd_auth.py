"""etcd users and RBAC roles per internal role (docs/security.md), and turning etcd auth on.

With TLS on, etcd runs with ``--client-cert-auth``: it takes the user of a call from the CN of the
client's certificate (control/ops/certs.py: CN = :func:`control.ops.certs.etcd_user`). Each internal role
gets an etcd user of that name (no password: certificate only) and an etcd role of the same name whose
permissions are the key prefixes (control/state/names.py) the role's actors read or write — found by
reading each actor's registry calls:

=========  =====================================================================================
role       permissions (R: read, RW: read and write; every range is a prefix)
=========  =====================================================================================
gateway    R models/ (manifests, routing; watched), R tenants/ (watched), R workers/, R desired/, R autoscaler/,
           R notices/, R hosts/ (operator dashboard), RW metrics/gateway/
validator  R models/, RW metrics/validator/
scheduler  R tenants/, R workers/ (watched), RW schedulers/ (its election), R hosts/ (load asks),
           RW metrics/scheduler/
worker     R models/, RW workers/ (its leased registration), RW hosts/ (a multi-version host's record),
           R notices/preemption/, RW metrics/worker/
jobs       R models/, R workers/ (its model resolver, like the gateway's), R tenants/ (spend budgets),
           RW metrics/jobs/
control    RW models/ (routing tables of rollouts), R workers/, R tenants/, RW controllers/ (election),
           RW pools/, RW desired/, RW autoscaler/ (decision history), R profiles/, R notices/ (autoscaler),
           RW metrics/rollout/, RW metrics/autoscaler/
root       everything (etcd's ``root`` role): the supervisor, ``actorserve`` CLI verbs, migrations
=========  =====================================================================================

(all under ``/actorserve/``). :func:`role_permissions` is that table, pure; :func:`enable_rbac` installs
it (idempotently: existing roles get their permissions replaced, existing users are kept) and enables
auth, over the etcd gRPC Auth API with the root certificate. aetcd has no auth API of its own; the
stubs of ``aetcd.rpc`` are used directly.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

from aetcd import rpc

from bus.tls import ROOT_ROLE, TlsFiles
from control.ops.nats_roles import KIND_ROLES, ROLES
from control.state import names

__all__ = ["role_permissions", "enable_rbac", "enable_rbac_sync", "READ", "READWRITE", "ROOT_ROLE", "etcd_user",
           "client_roles", "main_etcd_auth"]

READ, READWRITE = "read", "readwrite"


def client_roles() -> tuple[str, ...]:
    """The roles that get a client certificate: the NATS roles (control/ops/nats_roles.py) and ``root``."""
    return (*ROLES, ROOT_ROLE)


def etcd_user(role: str) -> str:
    """etcd user name of ``role`` (the CN of its client certificate): ``root`` for the operator, else
    ``actorserve-<role>`` (the same name as its NATS user, bus.subjects.role_user)."""
    if role == ROOT_ROLE:
        return ROOT_ROLE
    from bus.subjects import role_user
    return role_user(role)


def _metrics(role: str) -> list[tuple[str, str]]:
    kinds = sorted(k for k, r in KIND_ROLES.items() if r == role)
    return [(READWRITE, f"{names.all_metrics_prefix()}{k}/") for k in kinds]


def role_permissions() -> dict[str, list[tuple[str, str]]]:
    """``{role: [(READ | READWRITE, key prefix), ...]}`` for every internal role (module docstring)."""
    models, tenants, workers = names.models_prefix(), names.tenants_prefix(), names.all_workers_prefix()
    table = {
        "gateway": [(READ, models), (READ, tenants), (READ, workers),
                    (READ, names.desired_prefix()), (READ, names.autoscaler_prefix()),
                    (READ, names.notices_prefix()), (READ, names.hosts_prefix())],  # dashboard (gateway/dashboard_feed.py)
        "validator": [(READ, models)],
        "scheduler": [(READ, tenants), (READ, workers), (READWRITE, names.schedulers_prefix()),
                      (READ, names.hosts_prefix()),  # hosts: where to ask for a version resident nowhere
                      (READWRITE, names.sleep_prefix())],  # wake a sleeping worker when only sleepers are left
        "worker": [(READ, models), (READWRITE, workers), (READ, names.notices_prefix()),  # + its preemption notice
                   (READ, names.sleep_prefix()),  # its sleep / wake commands (actors/worker/sleep.py)
                   (READWRITE, names.hosts_prefix())],  # a multi-version host's record (actors/worker/host.py)
        "jobs": [(READ, models), (READ, workers), (READ, tenants)],  # tenants: budgets of job requests
        "control": [(READWRITE, models), (READ, workers), (READ, tenants),
                    (READWRITE, names.controllers_prefix()), (READWRITE, names.pools_prefix()),
                    (READWRITE, names.desired_prefix()), (READWRITE, names.autoscaler_prefix()),
                    (READ, names.profiles_prefix()), (READ, names.notices_prefix())],
    }
    missing = set(ROLES) - table.keys()
    if missing:
        raise RuntimeError(f"no etcd permissions defined for roles {sorted(missing)}")
    return {role: perms + _metrics(role) for role, perms in table.items()}


def _range_end(prefix: bytes) -> bytes:
    """etcd's prefix range end: the prefix with its last byte incremented."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


async def _ignore_exists(aw: Any) -> None:
    try:
        await aw
    except rpc.AioRpcError as e:
        if "already exists" not in (e.details() or ""):
            raise


async def enable_rbac(etcd_url: str, root_tls: TlsFiles, *, timeout: float = 10.0) -> bool:
    """Create the users and roles of :func:`role_permissions` plus ``root`` on the etcd cluster at
    ``etcd_url`` (https; ``root_tls``: the CA and the root client certificate) and enable auth.
    Returns False when auth was already on (nothing changed), True when this call enabled it.
    Raises aetcd / gRPC errors when etcd refuses (e.g. the certificate is not root's)."""
    from control.state.registry import Registry

    reg = await Registry.open(etcd_url, timeout=timeout, tls=root_tls)
    try:
        stub, md, t = rpc.AuthStub(reg.client.channel), reg.client.metadata, timeout
        status = await stub.AuthStatus(rpc.AuthStatusRequest(), timeout=t, metadata=md)
        if status.enabled:
            return False
        for role, perms in role_permissions().items():
            await _ignore_exists(stub.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=t, metadata=md))
            current = await stub.RoleGet(rpc.AuthRoleGetRequest(role=role), timeout=t, metadata=md)
            for p in current.perm:  # replace, do not accumulate, across versions of the table
                await stub.RoleRevokePermission(rpc.AuthRoleRevokePermissionRequest(
                    role=role, key=p.key, range_end=p.range_end), timeout=t, metadata=md)
            for kind, prefix in perms:
                key = prefix.encode()
                perm = rpc.Permission(permType=rpc.Permission.READ if kind == READ else rpc.Permission.READWRITE,
                                      key=key, range_end=_range_end(key))
                await stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=role, perm=perm),
                                               timeout=t, metadata=md)
            user = etcd_user(role)
            await _ignore_exists(stub.UserAdd(rpc.AuthUserAddRequest(
                name=user, options=rpc.UserAddOptions(no_password=True)), timeout=t, metadata=md))
            await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role=role), timeout=t, metadata=md)
        await _ignore_exists(stub.RoleAdd(rpc.AuthRoleAddRequest(name=ROOT_ROLE), timeout=t, metadata=md))
        await _ignore_exists(stub.UserAdd(rpc.AuthUserAddRequest(
            name=ROOT_ROLE, options=rpc.UserAddOptions(no_password=True)), timeout=t, metadata=md))
        await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ROOT_ROLE, role=ROOT_ROLE), timeout=t, metadata=md)
        await stub.AuthEnable(rpc.AuthEnableRequest(), timeout=t, metadata=md)
        return True
    finally:
        await reg.close()


def enable_rbac_sync(etcd_url: str, root_tls: TlsFiles, *, timeout: float = 10.0) -> bool:
    """:func:`enable_rbac` from synchronous code (runs it on a fresh event loop in a thread, so it also
    works where a loop is already running). Same result and errors."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["ok"] = asyncio.run(enable_rbac(etcd_url, root_tls, timeout=timeout))
        except BaseException as e:  # re-raised in the caller's thread
            out["err"] = e

    t = threading.Thread(target=run, name="etcd-rbac", daemon=True)
    t.start()
    t.join(timeout * 4)
    if "err" in out:
        raise out["err"]
    if "ok" not in out:
        raise TimeoutError(f"enabling etcd auth did not finish in {timeout * 4:.0f} s")
    return bool(out["ok"])


def main_etcd_auth(args: argparse.Namespace) -> int:
    """Run ``actorserve etcd-auth``: 0 when auth is on afterwards, 2 for bad input, 3 when etcd refuses or
    cannot be reached."""
    from control.state.etcd_client import parse_etcd_urls

    try:
        if not parse_etcd_urls(args.etcd).tls:
            raise ValueError("--etcd must be https:// (etcd auth by client certificate needs TLS)")
        files = TlsFiles.in_dir(args.tls_dir, ROOT_ROLE)
        for f in (files.ca, files.cert, files.key):
            if not Path(f).is_file():
                raise ValueError(f"{f} is missing: run `actorserve certs --out {args.tls_dir}` first")
    except ValueError as e:
        print(f"actorserve etcd-auth: {e}", file=sys.stderr)
        return 2
    try:
        changed = enable_rbac_sync(args.etcd, files)
    except Exception as e:  # gRPC / aetcd errors, timeouts: one line
        print(f"actorserve etcd-auth: etcd at {args.etcd} refused or did not answer: {e}", file=sys.stderr)
        return 3
    print("etcd auth enabled (per-role users and roles created)" if changed else "etcd auth was already enabled")
    return 0
