"""``actorserve tenants ...``: tenant and API key management (etcd through control.state.tenants).

    actorserve tenants create NAME [--allow-models M1,M2]
    actorserve tenants list [--json]
    actorserve tenants show NAME [--json]
    actorserve tenants keys add NAME
    actorserve tenants keys revoke KEY_ID
    actorserve tenants set-quota NAME [--rpm N] [--tpm N] [--concurrency N] [--daily-tokens N]
    actorserve tenants allow-models NAME M1,M2
    actorserve tenants priority NAME interactive|batch
    actorserve tenants set-weight NAME W
    actorserve tenants budget NAME --usd X [--period day|month|total] | --clear
    actorserve tenants cache-group NAME GROUP | --clear

etcd is found like every other verb (``--etcd``, ``$ACTORSERVE_ETCD``, ``<state-dir>/endpoints.json``).
A new key is printed once (stdout, alone on its line for ``create``/``keys add``) and never again.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from actors.runtime import common_arguments
from control.ops.argtypes import subcommand_adder
from control.ops.cli_errors import StackUnreachable, is_unreachable, report_unreachable, run_on_registry  # noqa: F401


def _quota_value(value: str) -> int:
    """argparse type: a non-negative integer, or ``none``/``unlimited`` (returned as -1 = clear)."""
    if value.strip().lower() in ("none", "unlimited", "null"):
        return -1
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer (or 'none')") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 0 (or 'none')")
    return n


def _model_list(value: str) -> list[str]:
    return [m.strip() for m in value.split(",") if m.strip()]


def add_tenant_commands(sub: Any) -> None:
    """Add the ``tenants`` verb and its subcommands to the CLI's subparsers ``sub``."""
    t = sub.add_parser("tenants", help="manage tenants, API keys, quotas and model access (etcd)")
    ts = t.add_subparsers(dest="tenants_command", metavar="SUBCOMMAND", required=True)

    cmd = subcommand_adder(ts, _run)

    p = cmd("create", "create a tenant and print its first API key (shown once)", _create)
    p.add_argument("name")
    p.add_argument("--allow-models", type=_model_list, default=[], metavar="M1,M2",
                   help="model names the tenant may use (default: none)")
    p = cmd("list", "list tenants", _list)
    p.add_argument("--json", action="store_true")
    p = cmd("show", "show one tenant (key hashes are never printed)", _show)
    p.add_argument("name")
    p.add_argument("--json", action="store_true")

    k = ts.add_parser("keys", help="add or revoke API keys")
    ks = k.add_subparsers(dest="keys_command", metavar="SUBCOMMAND", required=True)
    p = ks.add_parser("add", help="add an API key to a tenant and print it (shown once)")
    common_arguments(p)
    p.add_argument("name")
    p.set_defaults(func=lambda args: _run(_keys_add, args))
    p = ks.add_parser("revoke", help="revoke an API key by its id (effective on every gateway within 1 s)")
    common_arguments(p)
    p.add_argument("key_id")
    p.set_defaults(func=lambda args: _run(_keys_revoke, args))

    p = cmd("set-quota", "set quotas (N >= 0, or 'none' for unlimited)", _set_quota)
    p.add_argument("name")
    p.add_argument("--rpm", type=_quota_value, default=None, metavar="N", help="requests per minute (sliding)")
    p.add_argument("--tpm", type=_quota_value, default=None, metavar="N", help="tokens per minute (sliding)")
    p.add_argument("--concurrency", type=_quota_value, default=None, metavar="N", help="requests in flight")
    p.add_argument("--daily-tokens", type=_quota_value, default=None, metavar="N", help="tokens per UTC day")
    p = cmd("allow-models", "replace the tenant's model allow-list (comma-separated names; '' = none)",
            _allow_models)
    p.add_argument("name")
    p.add_argument("models", type=_model_list)
    p = cmd("priority", "set the tenant's priority class", _priority)
    p.add_argument("name")
    p.add_argument("priority", choices=("interactive", "batch"))
    p = cmd("set-weight", "set the tenant's fair-share weight", _set_weight)
    p.add_argument("name")
    p.add_argument("weight", type=float)
    p = cmd("budget", "set or clear the tenant's spend budget (USD per period; docs/budgets.md)", _budget)
    p.add_argument("name")
    p.add_argument("--usd", type=float, default=None, metavar="X", help="budget in USD per period")
    p.add_argument("--period", choices=("day", "month", "total"), default="month",
                   help="UTC day, UTC month, or no reset (default: month)")
    p.add_argument("--clear", action="store_true", help="remove the budget (no limit)")
    p = cmd("cache-group", "share the prefix cache with the other tenants of GROUP, or --clear (docs/tenants.md)",
            _cache_group)
    p.add_argument("name")
    p.add_argument("group", nargs="?", default=None)
    p.add_argument("--clear", action="store_true", help="the tenant's prefix cache is its own again (default)")


def _run(func, args: argparse.Namespace) -> int:
    from control.state.tenants import TenantAdmin, TenantError

    return run_on_registry(func, args, errors=(TenantError, ValueError), wrap=TenantAdmin)


_HASH_FIELDS = ("hash", "nats_hash")  # never printed: the API-key hash and the NATS user's bcrypt hash


def _summary(t) -> dict[str, Any]:
    return {"id": t.id, "priority": t.priority, "weight": t.weight, "quotas": t.quotas,
            "allowed_models": list(t.allowed_models), "budget": t.budget.to_record() if t.budget else None,
            "cache_group": t.cache_group or None,
            "keys": {kid: {k: v for k, v in e.items() if k not in _HASH_FIELDS} for kid, e in t.keys.items()}}


async def _create(adm, args) -> int:
    t, key_id, key = await adm.create(args.name, allowed_models=args.allow_models)
    print(f"created tenant {t.id}; API key {key_id} (shown once, store it now):", file=sys.stderr)
    print(key)
    return 0


async def _list(adm, args) -> int:
    ts = await adm.list()
    if args.json:
        print(json.dumps([_summary(t) for t in ts], indent=2))
        return 0
    print(f"{'TENANT':<20} {'PRIORITY':<12} {'WEIGHT':<7} {'KEYS':<5} {'RPM':<8} {'TPM':<10} {'CONC':<5} MODELS")
    for t in ts:
        q = {k: ("-" if v is None else str(v)) for k, v in t.quotas.items()}
        print(f"{t.id:<20} {t.priority:<12} {t.weight:<7g} {len(t.active_key_hashes()):<5} {q['rpm']:<8} "
              f"{q['tpm']:<10} {q['concurrency']:<5} {','.join(t.allowed_models) or '(none)'}")
    return 0


async def _show(adm, args) -> int:
    s = _summary(await adm.get(args.name))
    print(json.dumps(s, indent=2) if args.json else "\n".join(f"{k}: {json.dumps(v)}" for k, v in s.items()))
    return 0


async def _keys_add(adm, args) -> int:
    key_id, key = await adm.add_key(args.name)
    print(f"added key {key_id} to {args.name} (shown once, store it now):", file=sys.stderr)
    print(key)
    return 0


async def _keys_revoke(adm, args) -> int:
    tid = await adm.revoke_key(args.key_id)
    print(f"revoked key {args.key_id} of tenant {tid}")
    return 0


async def _set_quota(adm, args) -> int:
    t = await adm.set_quota(args.name, rpm=args.rpm, tpm=args.tpm, concurrency=args.concurrency,
                            daily_tokens=args.daily_tokens)
    print(f"{t.id} quotas: " + ", ".join(f"{k}={'unlimited' if v is None else v}" for k, v in t.quotas.items()))
    return 0


async def _allow_models(adm, args) -> int:
    t = await adm.allow_models(args.name, args.models)
    print(f"{t.id} may use: {', '.join(t.allowed_models) or '(no model)'}")
    return 0


async def _priority(adm, args) -> int:
    t = await adm.set_priority(args.name, args.priority)
    print(f"{t.id} priority: {t.priority}")
    return 0


async def _set_weight(adm, args) -> int:
    t = await adm.set_weight(args.name, args.weight)
    print(f"{t.id} weight: {t.weight:g}")
    return 0


async def _cache_group(adm, args) -> int:
    from control.state.tenants import TenantError

    if args.clear == (args.group is not None):
        raise TenantError("cache-group: give GROUP or --clear")
    t = await adm.set_cache_group(args.name, None if args.clear else args.group)
    print(f"{t.id} prefix cache: " + (f"shared in group {t.cache_group}" if t.cache_group else "its own"))
    return 0


async def _budget(adm, args) -> int:
    from control.state.tenants import TenantError

    if args.clear == (args.usd is not None):
        raise TenantError("budget: give --usd X (with --period) or --clear")
    t = await adm.set_budget(args.name, None if args.clear else args.usd, args.period)
    b = t.budget
    print(f"{t.id} budget: " + ("none" if b is None else f"{b.usd:g} USD per {b.period}"))
    return 0
