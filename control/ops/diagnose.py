"""Pure policy of ``actorserve diagnose``: figures of each tier in, a verdict out (no I/O).

:func:`diagnose` takes a :class:`Snapshot` (what ``control/ops/diagnose_cli.py`` scraped from every actor's
``/metrics`` over a window, plus the CPU use of each actor process) and returns a :class:`Diagnosis`:

- the **latency breakdown**: mean seconds and share of the request's total time spent in each stage,
  ``gateway`` (gateway receipt to first token, less validation, queue and prefill: auth, the hop to a
  validator and back, first-chunk transport), ``validation``, ``queue`` (scheduler queue and dispatch),
  ``prefill`` and ``decode``;
- the **verdict**: which tier saturates (``worker`` = the accelerator, ``validator``, ``gateway``,
  ``scheduler``) or ``none``, every saturated tier in order, and the evidence;
- the **actions**, in the order to try them, each with its reason.

The CPU tiers (gateway, validator) are single Python event loops: one saturates at about one core of CPU
or when its loop wakes up late. The worker tier (the accelerator) saturates when its batch slots or its KV
cache are full while requests wait for it. Thresholds are the named constants below.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Tier names (the verdict's ``bottleneck``).
WORKER, VALIDATOR, GATEWAY, SCHEDULER, NONE = "worker", "validator", "gateway", "scheduler", "none"
#: Latency stages of the breakdown, in request order.
STAGES = ("gateway", "validation", "queue", "prefill", "decode")

CPU_SATURATED_CORES = 0.85
"""A gateway, validator or scheduler is one Python process whose work runs under one GIL: it cannot use much
more than one core, so at 85 % of a core it is saturated (the rest goes to the OS and to sampling noise)."""

CPU_LOW_CORES = 0.5
"""Below half a core a CPU-tier actor has headroom: the "low CPU tier" of an accelerator-bound deployment."""

LOOP_LAG_HIGH_S = 0.2
"""Event-loop lag at which an actor is overloaded. The probe sleeps 100 ms; an idle loop wakes within a few
ms. 200 ms late means every message the actor handles waits that long for the loop (its queue backs up),
well above the jitter a busy but healthy host gives (tens of ms)."""

KV_NEAR_FULL = 0.9
"""KV cache usage (fraction of blocks) at which a worker can admit no more sequences: a new sequence needs
blocks for its prompt, and the engine keeps a reserve for running sequences to grow."""

SLOTS_FULL_FRACTION = 0.9
"""A worker whose running batch is at 90 % of the largest batch it has run has no free slot to speak of
(the largest batch it has run stands in for ``--max-num-seqs``, which is not exported)."""

WORKER_IDLE_FRACTION = 0.5
"""A worker using under half of its batch slots (and KV below :data:`KV_NEAR_FULL`) has room: when requests
queue anyway, the scheduler's dispatch, not the accelerator, is what holds them. Between half and full the
benefit of the doubt goes to the worker: sequences finishing flicker the instant gauges, and a queue that
builds while workers are busy is the accelerator's queue."""

QUEUE_DOMINANT_SHARE = 0.3
"""Share of the request's time spent in the scheduler queue above which queue wait "dominates": the
requests wait longer for a worker than any other single stage normally takes."""

VALIDATION_DOMINANT_SHARE = 0.3
"""Share of the request's time spent in validation (templating, tokenization, waiting for a validator
thread) above which the validator tier is the bottleneck even before its CPU or loop lag shows it."""

VALIDATION_SLOW_S = 0.05
"""...but only when validation also takes this long on average (50 ms): tokenizing a prompt takes about a
millisecond, so a large share of a tiny total is not a problem."""

GATEWAY_DOMINANT_SHARE = 0.3
"""Share of the request's time outside validation, queue, prefill and decode (gateway work and hops)
above which the gateway tier is the bottleneck, when it also exceeds :data:`GATEWAY_SLOW_S`."""

GATEWAY_SLOW_S = 0.05
"""Minimum mean gateway overhead (50 ms) for :data:`GATEWAY_DOMINANT_SHARE` to count."""


@dataclass(frozen=True)
class ActorFigures:
    """One actor process: ``cpu_cores`` = CPU seconds per second over the window (1.0 = one core busy),
    ``loop_lag_s`` = its ``actorserve_event_loop_lag_seconds`` (None when not known)."""

    kind: str
    id: str
    cpu_cores: float | None = None
    loop_lag_s: float | None = None


@dataclass(frozen=True)
class WorkerFigures:
    """One worker's gauges: running / waiting requests, KV usage (0..1), mean batch, largest batch, tokens/s."""

    id: str
    model: str = ""
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    batch_size: float = 0.0
    max_batch_size: float = 0.0
    generation_tps: float = 0.0


@dataclass(frozen=True)
class Latency:
    """Mean seconds per request of the request-level histograms (over the window, or since start when
    ``source`` is ``cumulative``); ``requests`` = completed requests those means cover."""

    requests: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    queue: float = 0.0
    prefill: float = 0.0
    decode: float = 0.0
    source: str = "window"


@dataclass(frozen=True)
class Snapshot:
    """Everything :func:`diagnose` looks at; ``scheduler_queue`` = requests waiting in the active
    schedulers' queues (summed over models)."""

    window_s: float
    actors: tuple[ActorFigures, ...] = ()
    workers: tuple[WorkerFigures, ...] = ()
    scheduler_queue: float = 0.0
    latency: Latency | None = None


@dataclass
class Action:
    """One thing to do, the tier it acts on, and why."""

    action: str
    reason: str
    tier: str


@dataclass
class Diagnosis:
    """The verdict: ``bottleneck`` (first saturated tier or ``none``), every ``saturated`` tier in order,
    a one-line ``summary``, the latency ``breakdown`` (stage -> {"mean_s", "share"}), the ``dominant_stage``,
    the ``evidence`` per tier and the ordered ``actions``."""

    bottleneck: str
    saturated: list[str]
    summary: str
    breakdown: dict[str, dict[str, float]]
    dominant_stage: str | None
    evidence: dict[str, list[str]] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def breakdown(lat: Latency | None) -> dict[str, dict[str, float]]:
    """Stage -> ``{"mean_s", "share"}`` of the request's total time (gateway overhead + e2e), from the
    histogram means. ``gateway`` = TTFT - (validation + queue + prefill), ``validation`` = e2e - (queue +
    prefill + decode), both clamped at 0. Empty without completed requests."""
    if lat is None or lat.requests <= 0:
        return {}
    validation = max(0.0, lat.e2e - lat.queue - lat.prefill - lat.decode)
    gateway = max(0.0, lat.ttft - validation - lat.queue - lat.prefill) if lat.ttft > 0 else 0.0
    means = {"gateway": gateway, "validation": validation, "queue": lat.queue, "prefill": lat.prefill,
             "decode": lat.decode}
    total = sum(means.values())
    return {k: {"mean_s": v, "share": (v / total) if total > 0 else 0.0} for k, v in means.items()}


def _slot_use(w: WorkerFigures) -> float:
    """Fraction of a worker's batch slots in use: the larger of its running requests and its mean batch over
    the last stats interval (the instant gauge flickers as sequences finish), over its largest batch."""
    return max(w.running, w.batch_size) / w.max_batch_size if w.max_batch_size > 0 else 0.0


def _share(bd: dict[str, dict[str, float]], stage: str) -> float:
    return bd.get(stage, {}).get("share", 0.0)


def _mean(bd: dict[str, dict[str, float]], stage: str) -> float:
    return bd.get(stage, {}).get("mean_s", 0.0)


def _of(snap: Snapshot, kind: str) -> list[ActorFigures]:
    return [a for a in snap.actors if a.kind == kind]


def _max(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _cpu_tier(snap: Snapshot, kind: str) -> tuple[bool, list[str], float | None, float | None]:
    """(saturated by CPU or loop lag, evidence, max cpu, max lag) of one CPU tier."""
    actors = _of(snap, kind)
    cpu = _max([a.cpu_cores for a in actors])
    lag = _max([a.loop_lag_s for a in actors])
    ev: list[str] = []
    sat = False
    if cpu is not None and cpu >= CPU_SATURATED_CORES:
        sat = True
        ev.append(f"{kind} CPU {cpu * 100:.0f}% of a core (>= {CPU_SATURATED_CORES * 100:.0f}%)")
    if lag is not None and lag >= LOOP_LAG_HIGH_S:
        sat = True
        ev.append(f"{kind} event-loop lag {lag * 1e3:.0f} ms (>= {LOOP_LAG_HIGH_S * 1e3:.0f} ms)")
    return sat, ev, cpu, lag


def diagnose(snap: Snapshot) -> Diagnosis:
    """The verdict for one snapshot (pure). See the module docstring and the thresholds above."""
    bd = breakdown(snap.latency)
    dominant = max(bd, key=lambda k: bd[k]["share"]) if bd and any(v["share"] for v in bd.values()) else None
    evidence: dict[str, list[str]] = {}
    pressure: dict[str, float] = {}  # saturated tier -> the share of time it accounts for (orders them)

    # -- worker / accelerator ------------------------------------------------------------------------------
    kv = max((w.kv_usage for w in snap.workers), default=0.0)
    slots_full = [w for w in snap.workers if _slot_use(w) >= SLOTS_FULL_FRACTION]
    idle = bool(snap.workers) and all(_slot_use(w) < WORKER_IDLE_FRACTION and w.kv_usage < KV_NEAR_FULL
                                      for w in snap.workers)
    engine_waiting = sum(w.waiting for w in snap.workers)
    backlog = snap.scheduler_queue + engine_waiting
    queue_share = _share(bd, "queue")
    waiting = backlog > 0 or queue_share >= QUEUE_DOMINANT_SHARE
    if snap.workers and waiting and not idle:
        ev = []
        if kv >= KV_NEAR_FULL:
            ev.append(f"KV cache {kv * 100:.0f}% used (>= {KV_NEAR_FULL * 100:.0f}%)")
        ev.append("batch slots in use: " + ", ".join(
            f"{w.id} {max(w.running, w.batch_size):.1f}/{w.max_batch_size:.0f}" for w in snap.workers))
        if backlog > 0:
            ev.append(f"{backlog:.0f} request(s) waiting (scheduler {snap.scheduler_queue:.0f}, "
                      f"engines {engine_waiting:.0f})")
        if queue_share >= QUEUE_DOMINANT_SHARE:
            ev.append(f"queue wait is {queue_share * 100:.0f}% of request time (>= {QUEUE_DOMINANT_SHARE * 100:.0f}%)")
        evidence[WORKER] = ev
        pressure[WORKER] = queue_share + _share(bd, "prefill") * 0.5

    # -- validator / gateway (CPU tiers) ---------------------------------------------------------------------
    v_sat, v_ev, v_cpu, v_lag = _cpu_tier(snap, VALIDATOR)
    val_share, val_mean = _share(bd, "validation"), _mean(bd, "validation")
    if val_share >= VALIDATION_DOMINANT_SHARE and val_mean >= VALIDATION_SLOW_S:
        v_sat = True
        v_ev.append(f"validation is {val_share * 100:.0f}% of request time ({val_mean * 1e3:.0f} ms mean)")
    if v_sat:
        evidence[VALIDATOR] = v_ev
        pressure[VALIDATOR] = max(val_share, 0.5 if v_cpu and v_cpu >= CPU_SATURATED_CORES else 0.0,
                                  _share(bd, "gateway") * 0.5)
    g_sat, g_ev, g_cpu, g_lag = _cpu_tier(snap, GATEWAY)
    gw_share, gw_mean = _share(bd, "gateway"), _mean(bd, "gateway")
    if gw_share >= GATEWAY_DOMINANT_SHARE and gw_mean >= GATEWAY_SLOW_S and not v_sat:
        g_sat = True
        g_ev.append(f"gateway overhead is {gw_share * 100:.0f}% of request time ({gw_mean * 1e3:.0f} ms mean)")
    if g_sat:
        evidence[GATEWAY] = g_ev
        pressure[GATEWAY] = max(gw_share, 0.5 if g_cpu and g_cpu >= CPU_SATURATED_CORES else 0.0)

    # -- scheduler: requests wait although the workers have room ---------------------------------------------
    s_sat, s_ev, s_cpu, _ = _cpu_tier(snap, SCHEDULER)
    if idle and snap.scheduler_queue > 0 and queue_share >= QUEUE_DOMINANT_SHARE:
        s_sat = True
        s_ev.append(f"{snap.scheduler_queue:.0f} request(s) queued and queue wait {queue_share * 100:.0f}% of "
                    f"request time while the workers have room (KV {kv * 100:.0f}%)")
    if s_sat:
        evidence[SCHEDULER] = s_ev
        pressure[SCHEDULER] = queue_share

    # -- order: a starved accelerator behind a saturated CPU tier is not the bottleneck -----------------------
    saturated = sorted(pressure, key=lambda t: -pressure[t])
    bottleneck = saturated[0] if saturated else NONE
    actions: list[Action] = []
    for tier in saturated:
        actions += _actions(tier, snap, bd, kv, slots_full, evidence[tier])
    if not saturated:
        actions.append(_healthy_action(snap, bd, v_cpu, g_cpu))
    summary = _summary(bottleneck, bd, dominant, v_cpu, g_cpu)
    return Diagnosis(bottleneck, saturated, summary, bd, dominant, evidence, actions)


def _actions(tier: str, snap: Snapshot, bd: dict, kv: float, slots_full: list[WorkerFigures],
             ev: list[str]) -> list[Action]:
    why = "; ".join(ev)
    if tier == WORKER:
        out = [Action("shed or deprioritize batch traffic: send bulk work with priority=batch or as async jobs, "
                      "lower tenant quotas (actorserve tenants set-quota) so interactive requests stop queueing",
                      f"the accelerator is saturated and requests queue for it: {why}", WORKER)]
        raise_kv = Action("raise KV capacity: a larger --kv-cache-bytes on the workers (memory permitting)",
                          f"KV cache {kv * 100:.0f}% used", WORKER)
        raise_batch = Action("raise the batch size: a larger --max-num-seqs on the workers (KV permitting)",
                             "batch slots in use: " + ", ".join(
                                 f"{w.id} {max(w.running, w.batch_size):.1f}/{w.max_batch_size:.0f}"
                                 for w in snap.workers), WORKER)
        if kv >= KV_NEAR_FULL:
            out.append(raise_kv)
        if slots_full:
            out.append(raise_batch)
        if not slots_full and kv < KV_NEAR_FULL:  # busy but neither limit shows: either may help
            out += [raise_batch, raise_kv]
        out.append(Action("add workers (actorserve up --workers N, or start another `actorserve actor worker`)",
                          "more accelerators serve more sequences at once; the CPU tiers have headroom", WORKER))
        return out
    if tier == VALIDATOR:
        n = len(_of(snap, VALIDATOR))
        return [Action(f"add validators (now {n}): start another `actorserve actor validator`; they share the "
                       "`validators` queue group", f"the validator tier is saturated: {why}", VALIDATOR),
                Action("move validators off the cores the workers use, or to another host",
                       "validation is CPU work (templating, tokenization) competing with the engine", VALIDATOR)]
    if tier == GATEWAY:
        n = len(_of(snap, GATEWAY))
        return [Action(f"add gateways (now {n}): actorserve up --gateways N behind a load balancer",
                       f"the gateway tier is saturated: {why}", GATEWAY),
                Action("prefer non-streaming or the NATS API for bulk clients",
                       "every streamed token is an SSE write on the gateway's loop", GATEWAY)]
    return [Action("check the active scheduler: its log, CPU and the workers' registered slots "
                   "(actorserve status); fail it over if it is stuck",
                   f"requests wait although workers have room: {why}", SCHEDULER)]


def _healthy_action(snap: Snapshot, bd: dict, v_cpu: float | None, g_cpu: float | None) -> Action:
    if not bd:
        return Action("no action: no request completed in the window; run diagnose under load",
                      "nothing to measure", NONE)
    return Action("no action needed", "no tier is saturated: no backlog with full workers, CPU tiers below "
                  f"{CPU_SATURATED_CORES * 100:.0f}% of a core and loop lag below {LOOP_LAG_HIGH_S * 1e3:.0f} ms",
                  NONE)


def _summary(bottleneck: str, bd: dict, dominant: str | None, v_cpu: float | None, g_cpu: float | None) -> str:
    where = f"; most time in {dominant} ({bd[dominant]['share'] * 100:.0f}%)" if dominant else ""
    cpu = ", ".join(f"{k} CPU {c * 100:.0f}%" for k, c in (("gateway", g_cpu), ("validator", v_cpu)) if c is not None)
    cpu = f" ({cpu})" if cpu else ""
    if bottleneck == WORKER:
        low = all(c is None or c < CPU_LOW_CORES for c in (v_cpu, g_cpu))
        return (f"accelerator-bound: the workers are saturated{', CPU tier low' if low else ''}{cpu}{where}")
    if bottleneck == VALIDATOR:
        return f"validator-bound: the validators are saturated{cpu}{where}"
    if bottleneck == GATEWAY:
        return f"gateway-bound: the gateways are saturated{cpu}{where}"
    if bottleneck == SCHEDULER:
        return f"scheduler-bound: requests queue while workers have room{where}"
    return f"healthy: no tier saturates{cpu}{where}"
