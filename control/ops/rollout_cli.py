"""``actorserve rollout ...``: canary rollouts as compare-and-swap edits of a model's routing table.

    actorserve rollout start NAME --canary VERSION [--stable VERSION] [--weight 5] [--sticky request|tenant]
                             [--steps 5,25,50,100] [--manual] [--window-s S] [--min-samples N]
                             [--step-interval-s S] [--max-error-rate-delta F] [--max-ttft-p95-ratio F]
                             [--max-itl-p95-ratio F] [--ttft-slack-ms MS] [--itl-slack-ms MS]
    actorserve rollout set-weight NAME PERCENT
    actorserve rollout promote NAME
    actorserve rollout rollback NAME
    actorserve rollout status NAME [--json]

Every edit reads ``/actorserve/models/{name}/routing`` with its mod_revision, applies one of
control/state/routing.py's edits (``by="cli"``) and writes it back only if nobody (another operator, the
rollout controller) wrote in between; otherwise it re-reads and re-applies (which may then refuse, e.g.
"no rollout is running" after the controller rolled back). Errors: a message on stderr, exit 2 (refused)
or 1 (etcd unreachable).
etcd is found like every other verb (``--etcd``, ``$ACTORSERVE_ETCD``, ``<state-dir>/endpoints.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from typing import Any, Callable

from actors.runtime import resolve_endpoints
from control.ops.argtypes import subcommand_adder
from control.ops.cli_errors import StackUnreachable, is_unreachable, report_unreachable  # noqa: F401

CAS_ATTEMPTS = 5

# CLI option -> analysis key (actors/rollout/policy.py PolicyConfig), with its argparse type
ANALYSIS_OPTIONS: tuple[tuple[str, str, Callable[[str], Any], str], ...] = (
    ("--window-s", "window_s", float, "sliding window of samples, seconds (default 30)"),
    ("--min-samples", "min_samples", int, "requests per side before comparing (default 20)"),
    ("--step-interval-s", "step_interval_s", float, "minimum seconds between weight steps (default 10)"),
    ("--max-error-rate-delta", "max_error_rate_delta", float,
     "canary error rate minus stable's, absolute 0..1 (default 0.05)"),
    ("--max-ttft-p95-ratio", "max_ttft_p95_ratio", float, "canary/stable TTFT p95 (default 1.5)"),
    ("--max-itl-p95-ratio", "max_itl_p95_ratio", float, "canary/stable ITL p95 (default 1.5)"),
    ("--ttft-slack-ms", "ttft_slack_ms", float, "absolute TTFT slack, ms (default 50)"),
    ("--itl-slack-ms", "itl_slack_ms", float, "absolute ITL slack, ms (default 20)"),
)


class RolloutError(Exception):
    """A refused rollout command (the message is shown to the operator)."""


def parse_steps(value: str) -> list[float]:
    """argparse type of ``--steps``: comma-separated ascending percentages ending at 100."""
    from control.state.routing import _check_steps

    try:
        return list(_check_steps([float(s) for s in value.split(",") if s.strip()]))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "steps" in str(e) else f"{value!r}: {e}") from None


def parse_weight(value: str) -> float:
    """argparse type of a canary weight: a percentage 0..100."""
    try:
        w = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not 0 <= w <= 100:
        raise argparse.ArgumentTypeError(f"{value!r} must be a percentage from 0 to 100")
    return w


def analysis_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``analysis`` dict of ``rollout start``: only the options given (the rest stay defaults).
    ValueError when a value is out of range (checked by actors.rollout.policy.PolicyConfig)."""
    from actors.rollout.policy import PolicyConfig

    analysis = {key: getattr(args, key) for _, key, _, _ in ANALYSIS_OPTIONS if getattr(args, key, None) is not None}
    if getattr(args, "manual", False):
        analysis["auto"] = False
    PolicyConfig.from_analysis(analysis)  # validate
    return analysis


def add_rollout_commands(sub: Any) -> None:
    """Add the ``rollout`` verb and its subcommands to the CLI's subparsers ``sub``."""
    r = sub.add_parser("rollout", help="canary rollouts: start, set-weight, promote, rollback, status (etcd)",
                       description="Canary rollouts are compare-and-swap edits of the model's routing table; the "
                       "rollout controller (`actorserve actor rollout`) steps, promotes or rolls back on its own.")
    rs = r.add_subparsers(dest="rollout_command", metavar="SUBCOMMAND", required=True)

    cmd = subcommand_adder(rs, run, describe=True, model_name=True)

    p = cmd("start", "send a share of the model's traffic to a canary version", _start)
    p.add_argument("--canary", required=True, metavar="VERSION", help="version under rollout (must be active)")
    p.add_argument("--stable", default=None, metavar="VERSION",
                   help="version keeping the rest (default: the routing table's stable, else the highest "
                   "active version other than the canary)")
    p.add_argument("--weight", type=parse_weight, default=None, metavar="PERCENT",
                   help="canary share in percent (default: the first step)")
    p.add_argument("--sticky", choices=("request", "tenant"), default="request",
                   help="split per request (default) or keep each tenant on one side")
    p.add_argument("--steps", type=parse_steps, default=None, metavar="W1,W2,...,100",
                   help="weights the controller walks through while healthy (default 5,25,50,100)")
    p.add_argument("--manual", action="store_true", help="no automatic analysis: the controller leaves it alone")
    g = p.add_argument_group("analysis thresholds (rollout controller; see docs/rollouts.md)")
    for opt, key, typ, help_ in ANALYSIS_OPTIONS:
        g.add_argument(opt, dest=key, type=typ, default=None, metavar="X", help=help_)
    p = cmd("set-weight", "move a running rollout's canary weight", _set_weight)
    p.add_argument("weight", type=parse_weight, metavar="PERCENT")
    cmd("promote", "make the canary the stable version (all traffic)", _promote)
    cmd("rollback", "all traffic back to the last good stable version", _rollback)
    p = cmd("status", "show the routing table, the analysis settings and the decision log", _status)
    p.add_argument("--json", action="store_true", help="print the routing record as JSON")


def run(func, args: argparse.Namespace) -> int:
    """Run one subcommand against etcd; refused edits and bad input print to stderr and return 2."""
    from control.state.registry import Registry

    etcd_url = "?"
    try:
        _, etcd_url = resolve_endpoints(args, need_nats=False)

        async def go() -> int:
            async with Registry.connect(etcd_url) as reg:
                return await func(reg, args)
        return asyncio.run(go())
    except (RolloutError, ValueError) as e:
        print(f"actorserve: {e}", file=sys.stderr)
        return 2
    except StackUnreachable:
        raise
    except Exception as e:  # etcd unreachable (TimeoutError, aetcd ClientError, OSError): one line, exit 3
        if not is_unreachable(e):
            raise
        return report_unreachable("etcd", etcd_url, e)  # as every verb: 3 = stack unreachable, 2 = refused


async def _active_versions(reg, name: str) -> dict[str, dict[str, Any]]:
    return {v: m for v, m in (await reg.list_model_versions(name)).items() if m.get("status", "active") == "active"}


async def cas_edit(reg, name: str, edit: Callable[[Any], Any]) -> Any:
    """Read the routing table of ``name``, apply ``edit`` (RoutingTable -> RoutingTable) and write it back
    only if unchanged meanwhile; retried on a lost race. Returns the written table."""
    from control.state.names import routing_key
    from control.state.routing import RoutingTable

    key = routing_key(name)
    for _ in range(CAS_ATTEMPTS):
        data, rev = await reg.get_json_rev(key)
        new = edit(RoutingTable.from_dict(data))
        if await reg.put_json_if_rev(key, new.to_dict(), rev):
            return new
        await asyncio.sleep(0.05)
    raise RolloutError(f"the routing table of {name} kept changing; try again")


async def _start(reg, args) -> int:
    from control.state.names import validate_name
    from control.state.routing import DEFAULT_STEPS, start_rollout
    from gateway.models import version_order

    validate_name("model name", args.name)
    validate_name("canary version", args.canary)
    versions = await reg.list_model_versions(args.name)
    if not versions:
        raise RolloutError(f"model {args.name} has no registered versions")
    active = await _active_versions(reg, args.name)

    def check_active(v: str, what: str) -> None:
        if v not in versions:
            raise RolloutError(f"{what} version {args.name}@{v} is not registered "
                               f"(registered: {', '.join(sorted(versions, key=version_order))})")
        if v not in active:
            raise RolloutError(f"{what} version {args.name}@{v} is {versions[v].get('status')}, not active")

    check_active(args.canary, "canary")
    analysis = analysis_from_args(args)
    steps = args.steps or list(DEFAULT_STEPS)
    weight = args.weight if args.weight is not None else steps[0]

    def edit(table):
        stable = args.stable
        if stable is None:
            if table.stable in active and table.stable != args.canary:
                stable = table.stable
            else:
                others = sorted((v for v in active if v != args.canary), key=version_order)
                if not others:
                    raise RolloutError(f"no active version of {args.name} other than {args.canary} to compare with")
                stable = others[-1]
        check_active(stable, "stable")
        return start_rollout(table, stable=stable, canary=args.canary, weight=weight, sticky=args.sticky,
                             steps=steps, analysis=analysis, by="cli")

    t = await cas_edit(reg, args.name, edit)
    print(f"rollout of {args.name}@{t.canary} started: {t.weight:g}% of traffic (stable {args.name}@{t.stable}, "
          f"sticky {t.sticky}, steps {', '.join(f'{s:g}' for s in t.steps)}"
          f"{', manual' if analysis.get('auto') is False else ''})")
    return 0


async def _set_weight(reg, args) -> int:
    from control.state.routing import set_weight

    t = await cas_edit(reg, args.name, lambda tb: set_weight(tb, args.weight, by="cli",
                                                             reasons=[f"operator set the weight to {args.weight:g}%"]))
    print(f"{args.name}: canary {t.canary} at {t.weight:g}%")
    return 0


async def _promote(reg, args) -> int:
    from control.state.routing import promote

    t = await cas_edit(reg, args.name, lambda tb: promote(tb, by="cli"))
    print(f"{args.name}@{t.stable} promoted: it is the stable version now (previous: {t.last_good})")
    return 0


async def _rollback(reg, args) -> int:
    from control.state.routing import rollback

    t = await cas_edit(reg, args.name, lambda tb: rollback(tb, by="cli"))
    print(f"{args.name}: rolled back; all traffic to {args.name}@{t.stable}" if t.stable else
          f"{args.name}: rolled back; all traffic to the highest active version")
    return 0


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def status_report(name: str, table: Any, active: list[str]) -> dict[str, Any]:
    """The ``rollout status --json`` document: the routing record plus effective analysis settings."""
    from actors.rollout.policy import PolicyConfig

    d = table.to_dict()
    try:
        effective = PolicyConfig.from_analysis(table.analysis, strict=False).to_dict()
    except ValueError as e:
        effective = {"error": str(e), **PolicyConfig().to_dict()}
    return {"name": name, **d, "effective_analysis": effective, "active_versions": active}


def format_status(report: dict[str, Any], now: float | None = None) -> str:
    """Human-readable ``rollout status``."""
    now = time.time() if now is None else now
    out = [f"model:    {report['name']}", f"state:    {report['state']}"]
    stable = report.get("stable") or (f"(highest active: {report['active_versions'][-1]})"
                                      if report.get("active_versions") else "-")
    out.append(f"stable:   {stable}")
    if report.get("canary"):
        out.append(f"canary:   {report['canary']} at {report['weight']:g}%")
    out.append(f"sticky:   {report['sticky']}")
    out.append(f"steps:    {', '.join(f'{s:g}' for s in report['steps'])}")
    if report.get("last_good"):
        out.append(f"last good: {report['last_good']}")
    a = report["effective_analysis"]
    if a.get("auto") is False:
        out.append("analysis: manual (the rollout controller leaves this rollout alone)")
    else:
        out.append(f"analysis: window {a['window_s']:g} s, min {a['min_samples']} requests per side, step every "
                   f">= {a['step_interval_s']:g} s; rollback if error rate > stable + {a['max_error_rate_delta']:g}, "
                   f"TTFT p95 > {a['max_ttft_p95_ratio']:g} x stable + {a['ttft_slack_ms']:g} ms, ITL p95 > "
                   f"{a['max_itl_p95_ratio']:g} x stable + {a['itl_slack_ms']:g} ms")
    if report.get("started_at"):
        out.append(f"started:  {_when(report['started_at'])} ({now - report['started_at']:.0f} s ago)")
    decisions = report.get("decisions") or []
    out.append(f"decisions (newest last, {len(decisions)}):" if decisions else "decisions: none")
    for d in decisions:
        w = d.get("weight")
        out.append(f"  {_when(d.get('ts'))}  {d.get('action', '?'):<8} by {d.get('by', '?'):<10} "
                   f"weight {w:g}%" if isinstance(w, (int, float)) else f"  {_when(d.get('ts'))}  {d.get('action')}")
        for r in d.get("reasons") or []:
            out.append(f"      - {r}")
    return "\n".join(out)


async def _status(reg, args) -> int:
    from control.state.names import validate_name
    from control.state.routing import RoutingTable
    from gateway.models import version_order

    validate_name("model name", args.name)
    data = await reg.get_routing(args.name)
    versions = await reg.list_model_versions(args.name)
    if data is None and not versions:
        raise RolloutError(f"model {args.name} has no registered versions and no routing table")
    active = sorted(await _active_versions(reg, args.name), key=version_order)
    report = status_report(args.name, RoutingTable.from_dict(data), active)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_status(report))
    return 0
