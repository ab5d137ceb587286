"""``actorserve usage`` (the cost report) and ``actorserve models price`` (prices in the registry).

    actorserve usage [--tenant T] [--json]
    actorserve models price NAME@VERSION --prompt-per-1m USD --completion-per-1m USD
    actorserve models price NAME@VERSION --clear

``usage`` reads what the gateways read: tenant records (budgets) from etcd, usage and cost per model
version (KV ``as_usage``, key ``u.<tenant>``) and the spend records (KV ``as_quota``, key
``spend.<tenant>``) from NATS JetStream; endpoints like every verb (``--nats``/``--etcd``, the
environment, ``<state-dir>/endpoints.json``). ``models price`` edits the manifest's ``pricing`` by
compare-and-swap; the gateways see it within about a second (docs/budgets.md). Exit status: 0 done,
1 unknown model or tenant, 2 refused (bad value, naming the field), 3 stack unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from actors.runtime import common_arguments, resolve_endpoints
from control.ops.cli_errors import is_unreachable, report_unreachable, run_on_registry

PROG = "actorserve"


def _usd(value: str) -> float:
    """argparse type: a non-negative number of USD."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of USD") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} must be a finite number >= 0")
    return v


# -- models price ------------------------------------------------------------------------------------

def add_price_arguments(p: argparse.ArgumentParser) -> None:
    """``--prompt-per-1m`` / ``--completion-per-1m`` (``models register`` and ``models price``)."""
    p.add_argument("--prompt-per-1m", type=_usd, default=None, metavar="USD",
                   help="price of 1M prompt tokens, charged to tenants' budgets (default: free)")
    p.add_argument("--completion-per-1m", type=_usd, default=None, metavar="USD",
                   help="price of 1M completion tokens (default: free)")


def pricing_of_args(args: argparse.Namespace) -> dict[str, float] | None:
    """The manifest ``pricing`` the price options ask for (None: none given). ValueError naming the
    option when only one of the pair is given."""
    pp, cp = getattr(args, "prompt_per_1m", None), getattr(args, "completion_per_1m", None)
    if pp is None and cp is None:
        return None
    if pp is None or cp is None:
        raise ValueError("pricing: --prompt-per-1m and --completion-per-1m come together (0 for free)")
    return {"prompt_per_1m": pp, "completion_per_1m": cp}


def pricing_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``{"pricing": ...}`` for a manifest when the price options are given, else ``{}``."""
    pricing = pricing_of_args(args)
    return {} if pricing is None else {"pricing": pricing}


def add_price_command(msub: Any) -> None:
    """Add ``models price`` to the ``models`` subparsers ``msub``."""
    p = msub.add_parser("price", help="set or clear the prices of a model version (budgets, cost report)",
                        description="Set the USD prices per 1M prompt and completion tokens of NAME@VERSION "
                        "(manifest field pricing), or clear them (free). Live: no restart.")
    common_arguments(p)
    p.add_argument("ref", metavar="NAME@VERSION")
    add_price_arguments(p)
    p.add_argument("--clear", action="store_true", help="remove the prices (the version becomes free)")
    p.set_defaults(func=cmd_models_price)


def cmd_models_price(args: argparse.Namespace) -> int:
    """``actorserve models price``."""
    from control.state import names
    from control.state.manifest import ModelManifest

    try:
        ref = names.parse_model_ref(args.ref)
        if ref.version is None or ref.adapter is not None:
            raise ValueError(f"{args.ref!r}: name the version, NAME@VERSION")
        given = pricing_of_args(args)
        if args.clear and given is not None:
            raise ValueError("pricing: --clear takes no prices (give prices or --clear, not both)")
        pricing = None if args.clear else given
        if pricing is None and not args.clear:
            raise ValueError("pricing: give --prompt-per-1m and --completion-per-1m, or --clear")
    except ValueError as e:
        return _fail(f"models price: {e}", 2)
    key = names.model_version_key(ref.name, ref.version)

    async def go(reg) -> int:
        for _ in range(20):  # compare-and-swap on the manifest
            old, rev = await reg.get_json_rev(key)
            if not isinstance(old, dict):
                return _fail(f"models price: {ref} is not registered", 1)
            new = {k: v for k, v in old.items() if k != "pricing"}
            if pricing is not None:
                new["pricing"] = pricing
            try:
                ModelManifest.from_dict(new)
            except ValueError as e:
                return _fail(f"models price: {e}", 2)
            if await reg.put_json_if_rev(key, new, rev):
                print(f"{ref}: " + ("free (no pricing)" if pricing is None else
                                    f"{pricing['prompt_per_1m']:g} USD per 1M prompt tokens, "
                                    f"{pricing['completion_per_1m']:g} USD per 1M completion tokens"))
                return 0
        return _fail(f"models price: {ref} kept changing under us; try again", 1)

    return _on_etcd(args, go)


# -- usage -------------------------------------------------------------------------------------------

def add_usage_command(sub: Any) -> None:
    """Add the ``usage`` verb to the CLI's subparsers ``sub``."""
    p = sub.add_parser("usage", help="per-tenant usage, cost and budgets (operators)",
                       description="Tokens, cost per model version and the budget (spent, reserved, remaining "
                       "in the current period) of every tenant, or of --tenant.")
    common_arguments(p)
    p.add_argument("--tenant", default=None, metavar="T", help="only this tenant")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_usage)


async def collect(etcd_url: str, nats_url: str, tenant: str | None = None, now: float | None = None) -> list[dict]:
    """The cost report of every tenant (or of ``tenant``): ``[{"tenant", "data": usage rows, "cost":
    {"total_usd", "budget"}}]``, the shape of ``GET /v1/usage`` per tenant."""
    from bus import streams
    from bus.nats_bus import NatsBus
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin, TenantError
    from gateway import budgets as rules
    from gateway.usage import usage_rows

    async with Registry.connect(etcd_url) as reg:
        adm = TenantAdmin(reg)
        if tenant is not None:
            try:
                tenants = [await adm.get(tenant)]
            except TenantError as e:
                raise LookupError(str(e)) from None
        else:
            tenants = await adm.list()
    bus = await NatsBus.connect(nats_url, name="actorserve-usage-cli")
    try:
        js = bus.js()
        usage_kv, spend_kv = await js.bucket(streams.USAGE), await js.bucket(streams.QUOTAS)
        now = time.time() if now is None else now
        out = []
        for t in tenants:
            u = await usage_kv.get(f"u.{t.id}")
            rows = usage_rows(u.value if u is not None else None)
            budget = None
            if t.budget is not None:
                e = await spend_kv.get(rules.spend_key(t.id))
                budget = rules.view(e.value if e is not None else None, t.budget.micro_usd, t.budget.period, now)
            out.append({"tenant": t.id, "data": rows,
                        "cost": {"total_usd": sum(r["cost_usd"] for r in rows), "budget": budget}})
        return out
    finally:
        await bus.close()


def cmd_usage(args: argparse.Namespace) -> int:
    """``actorserve usage``."""
    nats_url, etcd_url = resolve_endpoints(args)
    try:
        report = asyncio.run(collect(etcd_url, nats_url, args.tenant))
    except LookupError as e:
        return _fail(f"usage: {e}", 1)
    except Exception as e:
        from bus.base import BusError
        from bus.nats_auth import redact_url

        if isinstance(e, BusError):
            return report_unreachable("NATS", redact_url(nats_url), e)
        if is_unreachable(e):
            return report_unreachable("etcd or NATS", f"{etcd_url}, {redact_url(nats_url)}", e)
        raise
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print_report(report)
    return 0


def print_report(report: list[dict]) -> None:
    """The report as two tables: usage and cost per tenant and version, then budgets."""
    rows = [("TENANT", "MODEL", "REQUESTS", "PROMPT", "COMPLETION", "COST_USD")]
    for t in report:
        for r in t["data"]:
            rows.append((t["tenant"], r["model"], str(r["requests"]), str(r["prompt_tokens"]),
                         str(r["completion_tokens"]), f"{r['cost_usd']:.6f}"))
    _table(rows)
    budgets = [(t["tenant"], t["cost"]["budget"]) for t in report if t["cost"]["budget"] is not None]
    if budgets:
        print()
        rows = [("TENANT", "PERIOD", "BUDGET_USD", "SPENT_USD", "RESERVED_USD", "REMAINING_USD", "IN_FLIGHT")]
        for tid, bv in budgets:
            rows.append((tid, f"{bv['period']} ({bv['period_id']})", f"{bv['budget_usd']:.6f}",
                         f"{bv['spent_usd']:.6f}", f"{bv['reserved_usd']:.6f}", f"{bv['remaining_usd']:.6f}",
                         str(bv["in_flight"])))
        _table(rows)


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def _on_etcd(args: argparse.Namespace, func) -> int:
    """Run ``await func(registry)`` on the stack's etcd (control/ops/cli_errors.py ``run_on_registry``: etcd
    unreachable -> one line, exit 3)."""
    return run_on_registry(lambda reg, _args: func(reg), args, errors=())
