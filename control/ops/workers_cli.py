"""``actorserve workers ...``: live workers and spot preemption notices (etcd).

    actorserve workers list [--json]
    actorserve workers preempt WORKER_ID [--in-s 120] [--reason TEXT]

``preempt`` writes ``preemption_notice_key(WORKER_ID)`` = ``{"deadline": now + in_s, "reason"}``, what a
cloud's spot interruption warning turns into: the worker stops taking work and moves its running
sequences to other workers of its version (actors/worker/migration.py); what is still there at the
deadline ends with a retryable 503. The worker must be live (exit 1 otherwise). etcd is found like every
other verb (``--etcd``, ``$ACTORSERVE_ETCD``, ``<state-dir>/endpoints.json``); unreachable: exit 3.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from actors.runtime import common_arguments
from control.ops.cli_errors import run_on_registry


def _positive(value: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be >= 0")
    return v


def add_workers_commands(sub: Any) -> None:
    """Add the ``workers`` verb and its subcommands to the CLI's subparsers ``sub``."""
    w = sub.add_parser("workers", help="list workers; send a spot preemption notice to one (etcd)")
    ws = w.add_subparsers(dest="workers_command", metavar="SUBCOMMAND", required=True)
    p = ws.add_parser("list", help="live workers: model, pool, device, pid, preemption notice")
    common_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda args: _run(_list, args))
    p = ws.add_parser("preempt", help="tell a worker it will be preempted: it moves its running sequences "
                      "to other workers of its version and takes no more work")
    common_arguments(p)
    p.add_argument("worker_id")
    p.add_argument("--in-s", type=_positive, default=120.0, metavar="S",
                   help="seconds until the machine goes away (default 120, a cloud's 2-minute warning)")
    p.add_argument("--reason", default="operator preemption notice", help="recorded with the notice")
    p.set_defaults(func=lambda args: _run(_preempt, args))


def _run(func, args: argparse.Namespace) -> int:
    return run_on_registry(func, args)


async def live_workers(reg) -> list[dict[str, Any]]:
    """Every live worker: ``{"worker_id", "model", **its etcd record, "notice": record or None}``, sorted."""
    from control.state.names import all_workers_prefix, notices_prefix

    prefix, notices = all_workers_prefix(), await reg.get_prefix_json(notices_prefix())
    rows = []
    for key, info in (await reg.get_prefix_json(prefix)).items():
        name, version, wid = key[len(prefix):].split("/", 2)
        rows.append({**(info if isinstance(info, dict) else {}), "worker_id": wid, "model": f"{name}@{version}",
                     "notice": notices.get(f"{notices_prefix()}{wid}")})
    return sorted(rows, key=lambda r: (r["model"], r["worker_id"]))


async def _list(reg, args) -> int:
    rows = await live_workers(reg)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'WORKER':<32} {'MODEL':<28} {'POOL':<10} {'DEVICE':<8} {'PID':<8} NOTICE")
    now = time.time()
    for r in rows:
        n = r["notice"]
        notice = f"deadline in {n['deadline'] - now:.0f} s ({n.get('reason', '')})" if isinstance(n, dict) \
            and isinstance(n.get("deadline"), (int, float)) else "-"
        print(f"{r['worker_id']:<32} {r['model']:<28} {str(r.get('pool', '-')):<10} {str(r.get('device', '-')):<8} "
              f"{str(r.get('pid', '-')):<8} {notice}")
    if not rows:
        print("  (no live worker)")
    return 0


async def _preempt(reg, args) -> int:
    from control.state.names import preemption_notice_key

    key = preemption_notice_key(args.worker_id)  # ValueError for a malformed id: exit 1
    if args.worker_id not in {r["worker_id"] for r in await live_workers(reg)}:
        print(f"actorserve: no live worker {args.worker_id!r} (see `actorserve workers list`)", file=sys.stderr)
        return 1
    deadline = time.time() + args.in_s
    await reg.put_json(key, {"deadline": deadline, "reason": args.reason})
    print(f"preemption notice for {args.worker_id}: deadline in {args.in_s:g} s")
    return 0
