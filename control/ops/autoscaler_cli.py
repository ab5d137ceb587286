"""``actorserve autoscaler status [--json] [--last N]``: what the autoscaler wants and why.

Reads etcd only: the active autoscaler (``/actorserve/controllers/autoscaler``), the desired counts
(``/actorserve/desired/...``) against what runs (validators and gateways: their leased metrics endpoints
``/actorserve/metrics/{kind}/``; workers: their leased records per version and pool), and the last ``N``
decisions of ``/actorserve/autoscaler/decisions`` with their reasons and inputs. Exit 0; 3 when etcd does not
answer (control/ops/cli_errors.py).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
from typing import Any, Mapping

from actors.runtime import common_arguments, resolve_endpoints
from control.ops.argtypes import positive_int
from control.ops.cli_errors import StackUnreachable, is_unreachable, report_unreachable

CPU_KINDS = ("validator", "gateway")


def add_autoscaler_command(sub: Any) -> None:
    """Add the ``autoscaler`` verb (subcommand ``status``) to the CLI's subparsers ``sub``."""
    a = sub.add_parser("autoscaler", help="the autoscaler: desired vs actual counts and its decisions (etcd)",
                       description="Show the active autoscaler, desired replica counts against the running ones, "
                       "and its latest decisions with their reasons and inputs.")
    asub = a.add_subparsers(dest="autoscaler_command", metavar="SUBCOMMAND", required=True)
    p = asub.add_parser("status", help="desired vs actual counts and the last decisions",
                        description="Desired vs actual replica counts and the last decisions (etcd).")
    common_arguments(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--last", type=positive_int, default=10, metavar="N", help="decisions shown (default 10)")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    """Gather the report from etcd and print it (table, or JSON with ``--json``)."""
    from control.state.registry import Registry

    etcd_url = "?"
    try:
        _, etcd_url = resolve_endpoints(args, need_nats=False)

        async def go() -> dict[str, Any]:
            async with Registry.connect(etcd_url) as reg:
                return await gather(reg)
        raw = asyncio.run(go())
    except StackUnreachable:
        raise
    except Exception as e:  # etcd unreachable: one line, exit 3
        if not is_unreachable(e):
            raise
        return report_unreachable("etcd", etcd_url, e)
    report = build_report(raw, args.last)
    print(json.dumps(report, indent=1, sort_keys=True) if args.json else format_report(report))
    return 0


async def gather(reg) -> dict[str, Any]:
    """The raw etcd listings the report is built from."""
    from control.state import names

    return {"leader": await reg.get_json(names.controller_key("autoscaler")),
            "desired": await reg.get_prefix_json(names.desired_prefix()),
            "workers": await reg.get_prefix_json(names.all_workers_prefix()),
            "metrics": await reg.get_prefix_json(names.all_metrics_prefix()),
            "decisions": await reg.get_json(names.autoscaler_decisions_key())}


def build_report(raw: Mapping[str, Any], last: int = 10) -> dict[str, Any]:
    """``{"active", "targets": {target: {"desired", "actual", "reason", "ts"}}, "decisions": [...]}`` from
    :func:`gather`'s listings (pure). ``actual``: live metrics endpoints per CPU-tier kind, leased worker
    records per ``worker/<name>/<version>/<pool>`` (a record without a pool counts as ``default``)."""
    from control.state import names

    actual: dict[str, int] = {k: 0 for k in CPU_KINDS}
    mp = names.all_metrics_prefix()
    for key in raw.get("metrics") or {}:
        kind = key[len(mp):].split("/")[0]
        if kind in actual:
            actual[kind] += 1
    wp = names.all_workers_prefix()
    for key, value in (raw.get("workers") or {}).items():
        parts = key[len(wp):].split("/")
        if len(parts) == 3:
            pool = value.get("pool") if isinstance(value, dict) and isinstance(value.get("pool"), str) else "default"
            target = f"worker/{parts[0]}/{parts[1]}/{pool}"
            actual[target] = actual.get(target, 0) + 1
    targets: dict[str, dict[str, Any]] = {t: {"desired": None, "actual": n, "reason": "", "ts": None}
                                          for t, n in actual.items()}
    dp = names.desired_prefix()
    for key, value in (raw.get("desired") or {}).items():
        if not isinstance(value, dict):
            continue
        t = key[len(dp):]
        row = targets.setdefault(t, {"desired": None, "actual": 0, "reason": "", "ts": None})
        row.update(desired=value.get("count"), reason=value.get("reason", ""), ts=value.get("ts"), by=value.get("by"))
    decisions = (raw.get("decisions") or {}).get("decisions") or []
    leader = raw.get("leader") if isinstance(raw.get("leader"), dict) else None
    return {"active": leader, "targets": dict(sorted(targets.items())),
            "decisions": [d for d in decisions if isinstance(d, dict)][-last:]}


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%H:%M:%S")


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable report: the active replica, a target table, then the decisions (newest last)."""
    active = report.get("active")
    lines = [f"active autoscaler: {active.get('id')} (pid {active.get('pid')}, since {_when(active.get('since'))})"
             if active else "active autoscaler: none (no replica holds the election key)", "",
             f"{'TARGET':44} {'DESIRED':>7} {'ACTUAL':>6}  LAST REASON"]
    for target, row in report.get("targets", {}).items():
        desired = "-" if row.get("desired") is None else str(row["desired"])
        lines.append(f"{target:44} {desired:>7} {row.get('actual', 0):>6}  {row.get('reason') or ''}")
    decisions = report.get("decisions") or []
    lines += ["", f"last {len(decisions)} decisions:" if decisions else "no decisions yet"]
    for d in decisions:
        inputs = ", ".join(f"{k}={v}" for k, v in sorted((d.get("inputs") or {}).items()))
        lines.append(f"  {_when(d.get('ts'))} [{d.get('loop')}] {d.get('target')} {d.get('current')} -> "
                     f"{d.get('desired')}: {d.get('reason')}")
        if inputs:
            lines.append(f"      inputs: {inputs}")
    return "\n".join(lines)

