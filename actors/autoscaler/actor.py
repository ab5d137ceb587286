"""``actorserve actor autoscaler``: desired replica counts from live signals (issue [13]).

Two loops on their own signals (actors/autoscaler/service.py): the CPU tier (validators, gateways: event-loop
lag, queue-group backlog and wait, CPU per process) and the accelerator pools (workers per model version and
pool: queue tokens, KV use, TTFT / ITL against the SLO, arrivals against the measured throughput curve). Their
output is etcd's ``/actorserve/desired/...`` (carried out by ``actorserve up``'s supervisor) and the decision
history ``/actorserve/autoscaler/decisions`` (``actorserve autoscaler status``).

Replicas: every replica listens; only the holder of ``/actorserve/controllers/autoscaler`` (leased, TTL 2 s)
decides and writes; standbys campaign every 0.25 s and take over within the TTL.

Options: ``--limits validator=1:2,gateway=1:1`` (floor:ceiling per CPU-tier kind; a kind not named is not
scaled), ``--worker-limits 1:2`` (per version; the manifest's ``autoscale`` overrides), ``--tick-s 1.0``,
``--pool local`` (the pool a version without workers scales on), ``--policy-set cpu.FIELD=VALUE`` /
``pool.FIELD=VALUE`` (repeatable: a field of CpuTierConfig / PoolConfig, e.g. shorter cool-downs in tests).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from actors.autoscaler.signals import CPU_KINDS, Limits, set_fields
from actors.serve import ActorContext, serve

log = logging.getLogger("actorserve.autoscaler")


def parse_span(text: str) -> Limits:
    """``FLOOR:CEILING`` -> Limits (ValueError naming the problem)."""
    floor, sep, ceiling = text.partition(":")
    if not sep:
        raise ValueError(f"{text!r} is not FLOOR:CEILING")
    try:
        return Limits(int(floor), int(ceiling))
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None


def limits_arg(text: str) -> dict[str, Limits]:
    """argparse type of ``--limits``: ``KIND=FLOOR:CEILING[,KIND=FLOOR:CEILING]`` over the CPU-tier kinds."""
    out: dict[str, Limits] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, span = part.partition("=")
        if not sep or kind not in CPU_KINDS:
            raise argparse.ArgumentTypeError(f"{part!r}: expected KIND=FLOOR:CEILING with KIND one of "
                                             f"{', '.join(CPU_KINDS)}")
        try:
            out[kind] = parse_span(span)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{kind}: {exc}") from None
    return out


def worker_limits_arg(text: str) -> Limits:
    """argparse type of ``--worker-limits FLOOR:CEILING``."""
    try:
        return parse_span(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def policy_set_arg(text: str) -> tuple[str, str, str]:
    """argparse type of ``--policy-set cpu.FIELD=VALUE`` / ``pool.FIELD=VALUE`` / ``sleep.FIELD=VALUE`` (the
    sleeping tier, actors/autoscaler/sleep_tier.py): (loop, field, value), the
    field checked to exist (ArgumentTypeError naming it). The values are checked all together by
    :func:`policy_configs` (one alone may break a rule that the set keeps, e.g. low < target <= high)."""
    import dataclasses

    target, sep, value = text.partition("=")
    loop, dot, name = target.partition(".")
    if not sep or not dot or loop not in ("cpu", "pool", "sleep"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cpu.FIELD=VALUE, pool.FIELD=VALUE or sleep.FIELD=VALUE")
    known = sorted(f.name for f in dataclasses.fields(_default_config(loop)))
    if name not in known:
        raise argparse.ArgumentTypeError(f"{type(_default_config(loop)).__name__} has no field {name!r} "
                                         f"(fields: {', '.join(known)})")
    return loop, name, value


def _default_config(loop: str) -> Any:
    from actors.autoscaler.cpu_policy import CpuTierConfig
    from actors.autoscaler.pool_policy import PoolConfig
    from actors.autoscaler.sleep_tier import SleepTierConfig

    return CpuTierConfig() if loop == "cpu" else SleepTierConfig() if loop == "sleep" else PoolConfig()


def policy_configs(assignments: list[tuple[str, str, str]]) -> dict[str, Any]:
    """``{"cpu": CpuTierConfig, "pool": PoolConfig, "sleep": SleepTierConfig}`` with every ``--policy-set`` applied
    (ValueError when the
    fields together break a rule, e.g. low < target <= high)."""
    out = {}
    for loop in ("cpu", "pool", "sleep"):
        out[loop] = set_fields(_default_config(loop), {n: v for lp, n, v in assignments if lp == loop})
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Autoscaler options (common --nats/--etcd/--state-dir are added by the CLI)."""
    parser.add_argument("--limits", type=limits_arg, default=limits_arg("validator=1:2,gateway=1:1"),
                        metavar="KIND=F:C,...", help="floor:ceiling per CPU-tier kind (default: validator=1:2,"
                        "gateway=1:1); a kind not named is not scaled")
    parser.add_argument("--worker-limits", type=worker_limits_arg, default=Limits(1, 2), metavar="F:C",
                        help="floor:ceiling of workers per model version (default 1:2; the manifest's "
                        "autoscale min_workers / max_workers / scale_to_zero override)")
    parser.add_argument("--tick-s", type=float, default=1.0, metavar="S", help="seconds between two decision rounds")
    parser.add_argument("--pool", default="local", help="pool a version without workers scales on (default local)")
    parser.add_argument("--policy-set", type=policy_set_arg, action="append", default=[], metavar="LOOP.FIELD=V",
                        help="set a policy field: cpu.FIELD (CpuTierConfig), pool.FIELD (PoolConfig) or sleep.FIELD "
                        "(SleepTierConfig: the sleeping tier, docs/autoscaling.md); repeatable")
    parser.add_argument("--carry-sleep", action="store_true",
                        help="write the workers' sleep and wake records itself (the sleeping tier where no "
                        "supervisor runs: Kubernetes with KEDA, docs/deployment.md)")
    parser.add_argument("--lend", action="store_true",
                        help="on multi-version worker hosts: a version short of replicas is loaded on a host where "
                        "another version sleeps, instead of waiting for a cold start (docs/autoscaling.md, "
                        "'Lending across models')")
    parser.add_argument("--scale-to-zero", action="store_true",
                        help="a version whose manifest is silent may go to zero replicas when idle (the pool "
                        "policy's idle_to_zero_s; the manifest's autoscale.scale_to_zero overrides)")
    parser.add_argument("--controller-id", default=None, help="id shown in the election key (default: host-pid)")
    parser.add_argument("--lease-ttl", type=int, default=2, metavar="S", help="election lease TTL, 1..5 s (default 2)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                        help="address /metrics binds (default 127.0.0.1; 0.0.0.0 in a pod, so that Prometheus "
                        "scrapes the desired counts KEDA follows: docs/deployment.md)")


async def main(args: argparse.Namespace) -> None:
    """Run the autoscaler until cancelled; on stop, resign so a standby takes over at once."""
    await serve(args, "autoscaler", build)


def config_from_args(args: argparse.Namespace):
    """The AutoscalerConfig of parsed options; SystemExit(2) with the message when they do not fit together."""
    from actors.autoscaler.service import AutoscalerConfig

    try:
        configs = policy_configs(list(args.policy_set or []))
        worker_limits = args.worker_limits
        if getattr(args, "scale_to_zero", False):
            worker_limits = Limits(worker_limits.floor, worker_limits.ceiling, scale_to_zero=True)
        return AutoscalerConfig(cpu_limits=dict(args.limits), worker_limits=worker_limits, tick_s=args.tick_s,
                                pool=args.pool, cpu=configs["cpu"], pools=configs["pool"], sleep=configs["sleep"],
                                carry_sleep=bool(getattr(args, "carry_sleep", False)),
                                lend=bool(getattr(args, "lend", False)),
                                controller_id=args.controller_id or "", lease_ttl=args.lease_ttl)
    except ValueError as exc:
        import sys
        print(f"actorserve autoscaler: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


async def build(ctx: ActorContext) -> None:
    """Start the autoscaler on the context's bus and registry (stopped, and its lease revoked, on stop)."""
    from actors.autoscaler.service import Autoscaler

    cfg = config_from_args(ctx.args)
    scaler = Autoscaler(await ctx.connect_bus(), ctx.registry, cfg)
    await scaler.start()
    ctx.on_stop(scaler.stop, what="autoscaler")
    _export(scaler)
    log.info("autoscaler %s started (limits %s, workers %d:%d, pool %s)", cfg.controller_id,
             {k: f"{v.floor}:{v.ceiling}" for k, v in cfg.cpu_limits.items()}, cfg.worker_limits.floor,
             cfg.worker_limits.ceiling, cfg.pool)


def _export(scaler) -> None:
    """``/metrics``: ``actorserve_autoscaler_leader`` (1 on the active replica), ``actorserve_autoscaler_desired_
    replicas{target,tier,model,version,pool}`` (the leader's desired counts, actors/autoscaler/export.py: what KEDA
    follows on Kubernetes), ``actorserve_autoscaler_observed_replicas{target}`` (the last tick's),
    ``actorserve_autoscaler_decisions_total`` (decisions written by this process)."""
    from actors.metrics import observable_counter, observable_gauge

    def replicas() -> list:
        snap = scaler.snapshot
        cpu = [(s["replicas"], {"target": k}) for k, s in snap.get("cpu", {}).items()]
        return cpu + [(s["replicas"], {"target": f"worker/{k}"}) for k, s in snap.get("pools", {}).items()]

    observable_gauge("actorserve_autoscaler_leader", "1 while this autoscaler replica is the active one.", "1",
                     lambda: [(1.0 if scaler.is_leader else 0.0, {})])
    from actors.autoscaler import export

    export.register(scaler)  # actorserve_autoscaler_desired_replicas: the leader only (actors/autoscaler/export.py)
    observable_gauge("actorserve_autoscaler_observed_replicas", "Live replicas per target seen by the last tick.",
                     "1", replicas)
    observable_gauge("actorserve_autoscaler_sleeping_replicas", "Sleeping workers per pool seen by the last tick "
                     "(KV cache freed, process kept; not in observed_replicas; docs/autoscaling.md).", "1",
                     lambda: [(s.get("sleeping", 0), {"target": f"worker/{k}"})
                              for k, s in scaler.snapshot.get("pools", {}).items()])
    observable_counter("actorserve_autoscaler_sleep_commands", "Sleep and wake records this autoscaler wrote "
                       "(--carry-sleep).", "1", lambda: [(scaler.sleep_commands, {})])
    observable_counter("actorserve_autoscaler_lends", "Host load asks this autoscaler sent to lend a sleeping "
                       "version's host to a version short of replicas (--lend; docs/autoscaling.md).", "1",
                       lambda: [(scaler.lend_asks_sent, {})])
    observable_counter("actorserve_autoscaler_decisions", "Scaling decisions written by this autoscaler.", "1",
                       lambda: [(scaler.decisions_written, {})])
