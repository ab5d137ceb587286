"""Actuation under ``actorserve up``: the supervisor carries out the desired replica counts in etcd
(``/actorserve/desired/...``, control/state/names.py ``desired_key``), written by the autoscaler actor
(actors/autoscaler/) or by an operator. User page: docs/autoscaling.md.

Reconciled by :class:`ScalingReconciler` on every round of the registry watch
(control/ops/supervisor_versions.py, every ``registry_poll_s`` seconds, one etcd connection), once the
stack was ready:

- validators: ``desired_key("validator")`` -> that many ``validator-<n>`` processes;
- workers of each running model version, per pool: ``desired_key("worker", name, version, pool)`` -> that
  many workers started with ``--pool POOL``; the version's total is the sum over its pools. Names stay
  as today (``worker-<n>`` for the version ``up`` registered, ``worker-<name>-<version>-<n>`` for
  others); a new replica takes the lowest free index;
- gateways: never (an HTTP gateway binds a fixed port): under ``up`` their count stays ``--gateways``,
  a ``desired_key("gateway")`` record is ignored (logged once).

An absent key keeps today's count; :meth:`control.ops.supervisor.Supervisor.start` clears the prefix
(the records describe one run's processes).

Scale-up spawns like a restart. A replica counts as ready once etcd shows it with its pid: a worker's
leased record (``/actorserve/workers/...``, taken after its model loaded), any other kind's leased
metrics record (``/actorserve/metrics/<kind>/...``). Spawn -> ready seconds (the cold start) go to the
supervisor's events and :attr:`ScalingReconciler.log`.

Scale-down stops the victims with SIGTERM of their process group: replicas not ready yet first, then the
newest (highest index). A worker drains (it migrates or finishes its running sequences), a validator
finishes what it holds; the replica is marked ``stopped_by="autoscaler"`` before the signal, so the
restart monitor leaves it stopped and ``pids.json`` lists it under ``stopped`` (``"by": "autoscaler"``);
still running ``stop_timeout_s`` later it gets SIGKILL. The last ready worker of a version is never
stopped unless the version's desired total is 0 (scale to zero), nor the last ready validator unless its
count is 0.

Preemption under ``up`` (no cloud takes the machine away): when a worker's preemption notice
(``preemption_notice_key``, ``actorserve workers preempt``) is due, the supervisor SIGTERMs that worker
(stopped_by ``"preempted"``: not restarted, name not reused). Until then it counts as up, so the
autoscaler's replacement (``desired = target + leaving``) is started next to it.

Safety bounds, whatever a record says: at most :data:`MAX_REPLICAS` per kind / version pool, and no
scale-up of a worker while ``max_workers`` workers are up in all (the machine's cores under ``up``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from control.ops.stack_config import StackConfig
from control.ops.supervisor_processes import ActorProcess, ProcessTable, signal_actor
from control.ops.supervisor_sleep import SleepTier

log = logging.getLogger("actorserve.supervisor")

#: the most replicas of one CPU-tier kind, or of one version on one pool, the supervisor will run
MAX_REPLICAS = 32
#: CPU-tier kinds whose desired count the supervisor carries out (gateways bind fixed ports: not scaled)
SCALED_KINDS = ("validator",)
#: ``stopped_by`` of the replicas the supervisor stops itself (draining, then kept stopped) -> event wording
LEAVING = {"autoscaler": "scaled down", "preempted": "preempted"}


@dataclass(frozen=True)
class Desired:
    """One desired-count record ``{"count": int >= 0, "ts": epoch s, "reason": str, "by": str}``
    (only ``count`` is required)."""

    count: int
    reason: str = ""
    by: str = ""
    ts: float = 0.0
    sleep: dict | None = None  # the autoscaler's sleeping-tier plan (actors/autoscaler/sleep_tier.py), if any

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"count must be an integer >= 0, not {self.count!r}")

    @classmethod
    def from_json(cls, value: Any) -> "Desired":
        """Parse a record; ValueError when it is not an object with a valid ``count``."""
        if not isinstance(value, Mapping):
            raise ValueError(f"not a JSON object: {value!r}")
        ts = value.get("ts", 0.0)
        sleep = value.get("sleep")
        return cls(value.get("count"), str(value.get("reason", "")), str(value.get("by", "")),
                   float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else 0.0,
                   sleep if isinstance(sleep, Mapping) else None)

    def why(self) -> str:
        """``reason (by X)`` for the events."""
        return (self.reason or "no reason given") + (f" (by {self.by})" if self.by else "")


@dataclass(frozen=True)
class DesiredCounts:
    """The parsed desired prefix: ``kinds`` (CPU-tier kind -> record), ``workers`` ((``name@version``,
    pool) -> record) and ``errors`` (key -> why it was skipped)."""

    kinds: dict[str, Desired] = field(default_factory=dict)
    workers: dict[tuple[str, str], Desired] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def parse_desired(records: Mapping[str, Any], prefix: str) -> DesiredCounts:
    """Sort the records read under ``prefix`` (``desired_prefix()``) by key shape: ``<prefix><kind>``
    or ``<prefix>worker/<name>/<version>/<pool>``; anything else, or a bad record, lands in ``errors``."""
    out = DesiredCounts()
    for key, value in records.items():
        parts = key[len(prefix):].split("/") if key.startswith(prefix) else []
        try:
            d = Desired.from_json(value)
        except (ValueError, TypeError) as e:
            out.errors[key] = str(e)
            continue
        if len(parts) == 1 and parts[0] and parts[0] != "worker":
            out.kinds[parts[0]] = d
        elif len(parts) == 4 and parts[0] == "worker" and all(parts[1:]):
            out.workers[(f"{parts[1]}@{parts[2]}", parts[3])] = d
        else:
            out.errors[key] = "unknown key shape (want <kind> or worker/<name>/<version>/<pool>)"
    return out


@dataclass(frozen=True)
class Replica:
    """What a scale-down choice needs of one replica: its name, index (``-<n>`` suffix) and readiness."""

    name: str
    index: int
    ready: bool


def choose_victims(replicas: Sequence[Replica], count: int, keep_ready: int) -> list[str]:
    """Names of at most ``count`` replicas to stop: those not ready yet first (they hold no work), then
    the newest (highest index) first; never so many ready ones that fewer than ``keep_ready`` stay."""
    ready_left = sum(r.ready for r in replicas)
    out: list[str] = []
    for r in sorted(replicas, key=lambda r: (r.ready, -r.index)):
        if len(out) >= count:
            break
        if r.ready:
            if ready_left <= keep_ready:
                break
            ready_left -= 1
        out.append(r.name)
    return out


def next_free_index(used: Iterable[int]) -> int:
    """The lowest index >= 0 not in ``used``."""
    taken = set(used)
    n = 0
    while n in taken:
        n += 1
    return n


def replica_index(name: str, prefix: str) -> int | None:
    """``n`` of a name ``<prefix><n>`` (e.g. ``worker-3`` with prefix ``worker-``), else None."""
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def replica_ready(a: ActorProcess, records: Mapping[str, Any], workers_prefix: str, metrics_prefix: str) -> bool:
    """True when etcd ``records`` show ``a``'s current process: a worker's leased record
    ``<workers_prefix><name>/<version>/<a.name>``, any other kind's metrics record under
    ``<metrics_prefix><kind>/``, with ``"pid"`` equal to its pid (an older incarnation does not count)."""
    if a.pid is None:
        return False
    if a.kind == "worker" and a.model:
        name, _, version = a.model.partition("@")
        rec = records.get(f"{workers_prefix}{name}/{version}/{a.name}")
        return isinstance(rec, Mapping) and rec.get("pid") == a.pid
    mine = f"{metrics_prefix}{a.kind}/"
    return any(k.startswith(mine) and isinstance(v, Mapping) and v.get("pid") == a.pid for k, v in records.items())


def is_ready(a: ActorProcess) -> bool:
    """True when ``a``'s current process runs and was seen ready."""
    return a.running and a.ready_at is not None


_ACCEPTS: dict[tuple[str, str], bool] = {}


def kind_accepts(kind: str, option: str) -> bool:
    """True when ``actorserve actor KIND`` has ``option`` (e.g. the worker's ``--pool``): its module's
    ``add_arguments`` applied to a scratch parser (cached; False when the module does not import)."""
    key = (kind, option)
    if key not in _ACCEPTS:
        import argparse
        import importlib

        from actors.kinds import ACTOR_MODULES

        parser = argparse.ArgumentParser(add_help=False, conflict_handler="resolve")
        try:
            importlib.import_module(ACTOR_MODULES[kind]).add_arguments(parser)
            _ACCEPTS[key] = option in parser._option_string_actions
        except Exception as e:  # an actor that cannot even build its parser fails at start anyway
            log.warning("cannot read the options of `actorserve actor %s`: %r", kind, e)
            _ACCEPTS[key] = False
    return _ACCEPTS[key]


def autoscaler_limits_argv(cores: int, workers: int, gateways: int, validators: int = 1,
                           pool: str = "local", hosts: bool = False) -> list[str]:
    """The autoscaler actor's options under ``up``: floors = today's counts, ceilings from ``cores``
    (CPUs this process may run on): validators ``max(floor, cores)``, workers per version
    ``max(floor, cores)`` (never more worker processes than cores unless asked for), gateways pinned
    (floor = ceiling: fixed ports). ``hosts`` (``up --multi-model --lend``): the ``workers`` processes are
    multi-version hosts, so a version has 1 to ``workers`` replicas (one per host), goes to zero when idle,
    and the autoscaler sleeps, wakes and lends them itself (``--carry-sleep --lend``)."""
    if cores < 1 or workers < 0 or gateways < 1 or validators < 0:
        raise ValueError(f"bad counts: cores={cores} workers={workers} gateways={gateways} validators={validators}")
    cpu = ["--limits", f"validator={validators}:{max(validators, cores)},gateway={gateways}:{gateways}"]
    if hosts:
        return cpu + ["--worker-limits", f"1:{max(1, workers)}", "--scale-to-zero", "--carry-sleep", "--lend",
                      "--pool", pool]
    return cpu + ["--worker-limits", f"{workers}:{max(workers, cores)}", "--pool", pool]


class ReplicaFactory(Protocol):
    """How the reconciler gets new replicas (``ActorFactory`` implements it)."""

    def worker(self, ref: str, n: int, pool: str) -> ActorProcess:
        """Worker ``n`` of version ``ref`` on ``pool`` (not started)."""

    def validator(self, n: int) -> ActorProcess:
        """Validator ``n`` (not started)."""

    def worker_prefix(self, ref: str) -> str:
        """Name prefix of version ``ref``'s workers."""


def started_counts(actors: Iterable[ActorProcess], model_ref: str, pool: str) -> dict[str, int]:
    """Desired key -> replicas (> 0) of the ``actors`` ``up`` starts itself: validators, the workers of
    ``model_ref`` per pool (``pool`` when a worker names none)."""
    from control.state.names import desired_key

    name, _, version = model_ref.partition("@")
    actors = list(actors)
    counts = {desired_key("validator"): sum(1 for a in actors if a.kind == "validator")}
    for a in actors:
        if a.kind == "worker" and a.model in (None, model_ref):
            key = desired_key("worker", name, version, a.pool or pool)
            counts[key] = counts.get(key, 0) + 1
    return {k: n for k, n in counts.items() if n > 0}


class ScalingReconciler:
    """The desired-count reconciliation of one supervisor (module docstring), over its ``procs``:
    ``running_versions`` (``name@version`` -> fingerprint, owned by the version reconciler) says which
    versions run; ``ready()`` whether the stack passed readiness (nothing is scaled before)."""

    def __init__(self, cfg: StackConfig, procs: ProcessTable, replicas: ReplicaFactory,
                 running_versions: Mapping[str, str], ready: Callable[[], bool]) -> None:
        self.cfg, self.procs, self.replicas = cfg, procs, replicas
        self.running_versions, self.ready = running_versions, ready
        self._log: list[dict[str, Any]] = []
        self._notes: dict[str, str] = {}  # desired key / target -> last warning logged about it
        self._killed: set[str] = set()  # scaled-down replicas SIGKILLed after stop_timeout_s
        self.sleep = SleepTier(cfg.sleep_horizon_s)  # scale-down sleeps workers, scale-up wakes them first

    @property
    def log(self) -> list[dict[str, Any]]:
        """Every scale action, oldest first: ``{"ts": epoch s, "action": "start" | "stop" | "ready" |
        "exited" | "killed", "name", "kind", "target", "reason", ...}`` (``"start"`` / ``"stop"``: ``"by"``,
        ``"decided_at"`` (the record's ``ts``); ``"ready"``: ``"cold_start_s"``, spawn -> ready;
        ``"exited"``: ``"status"``, ``"drain_s"``)."""
        with self.procs.lock:
            return [dict(e) for e in self._log]

    def _record(self, action: str, a: ActorProcess, target: str, reason: str, msg: str,
                level: int = logging.INFO, **extra: Any) -> None:
        """Append one :attr:`log` entry and the event ``msg``."""
        self._log.append({"ts": time.time(), "action": action, "name": a.name, "kind": a.kind,
                          "target": target, "reason": reason, **extra})
        self.procs.event(msg, level)

    def wants_ready_records(self) -> bool:
        """True while a live validator or worker has not been seen ready (the watch then reads the records)."""
        with self.procs.lock:
            return any(a.ready_at is None and a.running and a.kind in ("worker", *SCALED_KINDS)
                       for a in self.procs.actors)

    def round(self, desired_records: Mapping[str, Any], ready_records: Mapping[str, Any] | None,
                      now: float | None = None, notices: Mapping[str, Any] | None = None) -> bool:
        """One round: note replicas that became ready (``ready_records``: etcd records under the workers and
        metrics prefixes, None: not read), finish scale-downs, stop workers whose preemption notice
        (``notices``: the records under ``notices_prefix()``) is due, then (after readiness) carry out
        ``desired_records`` (the records under ``desired_prefix()``). Returns True when anything changed.
        Called by the registry watch; does nothing once :meth:`stop` began."""
        from control.state.names import desired_prefix

        now = time.time() if now is None else now
        counts = parse_desired(desired_records, desired_prefix())
        with self.procs.lock:
            if self.procs.stopping:
                return False
            if ready_records is not None:
                self._note_ready(ready_records, now)
            changed = self._reap_leaving(now)
            changed |= self._preempt_due(notices or {}, now)
            for (ref, pool), d in counts.workers.items():
                self.sleep.set_plan(ref, pool, d.sleep)  # the autoscaler's sleep plans (supervisor_sleep.py)
            changed |= self._retire_sleepers(now)
            if self.ready():
                self._note_skipped(counts)
                d = counts.kinds.get("validator")
                if d is not None:
                    changed |= self._scale_validators(d, now)
                changed |= self._scale_workers(counts.workers, now)
            if changed:
                self.procs.write_pids()
        return changed

    # -- readiness and finished scale-downs ------------------------------------------------------

    def _note_ready(self, records: Mapping[str, Any], now: float) -> None:
        """Set ``ready_at`` of every live replica ``records`` show ready (an event for scaled ones)."""
        from control.state.names import all_metrics_prefix, all_workers_prefix

        wp, mp = all_workers_prefix(), all_metrics_prefix()
        for a in self.procs.actors:
            if a.ready_at is None and a.running and replica_ready(a, records, wp, mp):
                a.ready_at = now
                cold = now - (a.spawned_at or now)
                if a.dynamic and a.kind in ("worker", *SCALED_KINDS):
                    self._record("ready", a, self._target_of(a), "", f"{a.name} ready {cold:.1f} s after its "
                                 f"start (cold start)", cold_start_s=round(cold, 3))
                else:
                    log.info("%s ready %.1f s after its start", a.name, cold)

    def _reap_leaving(self, now: float) -> bool:
        """Report scaled-down replicas that exited; SIGKILL those still running ``stop_timeout_s`` after
        their SIGTERM. True when one exited (``pids.json`` changes)."""
        changed = False
        for a in self.procs.actors:
            if a.stopped_by not in LEAVING or a.term_sent_at is None:
                continue
            if not a.running:
                rc = a.proc.returncode if a.proc is not None else None
                drain = now - a.term_sent_at
                a.term_sent_at = None
                self._killed.discard(a.name)
                self._record("exited", a, self._target_of(a), "", f"{a.name} stopped ({LEAVING[a.stopped_by]}) "
                             f"{drain:.1f} s after its SIGTERM, exit status {rc}", status=rc, drain_s=round(drain, 3))
                changed = True
            elif now - a.term_sent_at > self.cfg.stop_timeout_s and a.name not in self._killed:
                self._killed.add(a.name)
                signal_actor(a, signal.SIGKILL)
                self._record("killed", a, self._target_of(a), "", f"{a.name} still draining "
                             f"{self.cfg.stop_timeout_s:.0f} "
                             f"s after its scale-down: SIGKILL", logging.WARNING)
        return changed

    def _preempt_due(self, notices: Mapping[str, Any], now: float) -> bool:
        """Under ``up`` a preemption notice's deadline is when the (spot) machine would go: a running worker
        whose notice is due gets SIGTERM (it has moved its sequences by then, or ends them with a retryable
        503) and is marked ``stopped_by="preempted"``: not restarted, its name not reused. True if one was."""
        from control.state.names import notices_prefix

        changed = False
        for key, rec in notices.items():
            deadline = rec.get("deadline") if isinstance(rec, Mapping) else None
            if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or now < deadline:
                continue
            wid = key[len(notices_prefix()):]
            for a in self.procs.actors:
                if a.kind == "worker" and a.name == wid and a.running and a.stopped_by is None:
                    a.stopped_by, a.term_sent_at = "preempted", now
                    signal_actor(a, signal.SIGTERM)
                    self._record("preempted", a, self._target_of(a), str(rec.get("reason", "")),
                                 f"{a.name}: its preemption notice is due ({rec.get('reason', 'no reason')}): "
                                 f"stopping it (SIGTERM)")
                    changed = True
        return changed

    def _note_skipped(self, counts: DesiredCounts) -> None:
        """Log once each bad record and each record of a kind the supervisor does not scale."""
        notes = dict(counts.errors)
        for kind in counts.kinds:
            if kind not in SCALED_KINDS:
                notes[kind] = ("gateways bind fixed ports: their count stays --gateways under `up`"
                               if kind == "gateway" else "the supervisor does not scale this kind")
        for key, why in notes.items():
            if self._notes.get(key) != why:
                self._notes[key] = why
                log.warning("desired count %s ignored: %s", key, why)

    def _target_of(self, a: ActorProcess) -> str:
        """Decision target of ``a``: ``validator`` or ``worker/<name>/<version>/<pool>``."""
        if a.kind == "worker" and a.model:
            return "worker/" + a.model.replace("@", "/") + f"/{a.pool or self.cfg.pool}"
        return a.kind

    # -- carrying out the counts -----------------------------------------------------------------

    def _active(self, pred: Any) -> list[ActorProcess]:
        """The replicas matching ``pred`` the supervisor means to keep running (not stopped, not given up)."""
        return [a for a in self.procs.actors if pred(a) and a.stopped_by is None and not a.given_up]

    def _scale_validators(self, d: Desired, now: float) -> bool:
        current = self._active(lambda a: a.kind == "validator")
        want = min(d.count, MAX_REPLICAS)
        if want > len(current):
            for _ in range(want - len(current)):
                self._start_replica(self.replicas.validator(self._free_index("validator", "validator-")),
                                    "validator", len(current), want, d)
            return True
        if want < len(current):
            reps = [Replica(a.name, replica_index(a.name, "validator-") or 0, is_ready(a)) for a in current]
            for name in choose_victims(reps, len(current) - want, 1 if want > 0 else 0):
                self._stop_replica(self.procs.actor(name), "validator", len(current), want, d, now)
            return True
        return False

    def _scale_workers(self, workers: Mapping[tuple[str, str], Desired], now: float) -> bool:
        if self.cfg.multi_model:  # hosts are not counted per version: the autoscaler sleeps, wakes and lends them
            return False
        changed = False
        for ref in sorted({ref for ref, _ in workers}):
            if ref not in self.running_versions:
                continue
            keyed = {pool: d for (r, pool), d in workers.items() if r == ref}
            mine = self._active(lambda a, ref=ref: a.kind == "worker" and a.model == ref)
            total = sum(min(keyed[p].count, MAX_REPLICAS) if p in keyed else
                        sum(1 for a in mine if (a.pool or self.cfg.pool) == p)
                        for p in {*(a.pool or self.cfg.pool for a in mine), *keyed})
            for pool, d in sorted(keyed.items()):
                changed |= self._scale_pool(ref, pool, d, total, now)
        return changed

    def _scale_pool(self, ref: str, pool: str, d: Desired, version_total: int, now: float) -> bool:
        """Carry out one version pool's count; ``version_total`` is the version's desired total over pools.
        Sleepers (supervisor_sleep.py) are woken before anything is spawned and are not counted as current."""
        target = f"worker/{ref.replace('@', '/')}/{pool}"
        version = self._active(lambda a: a.kind == "worker" and a.model == ref and a.sleeping_since is None)
        current = [a for a in version if (a.pool or self.cfg.pool) == pool]
        want = min(d.count, MAX_REPLICAS)
        if want > len(current) and self._wake_sleepers(ref, pool, want - len(current), target, d):
            return True
        if want > len(current):
            room = self.cfg.max_workers - len(self._active(lambda a: a.kind == "worker" and a.sleeping_since is None))
            n = min(want - len(current), max(0, room))
            self._note(target, "" if n == want - len(current) else
                       f"{target}: {want - len(current) - n} worker(s) not started: {self.cfg.max_workers} workers "
                       f"in all is the most this machine runs (max_workers)")
            prefix = self.replicas.worker_prefix(ref)
            for _ in range(n):
                self._start_replica(self.replicas.worker(ref, self._free_index("worker", prefix, ref), pool),
                                    target, len(current), want, d)
            return n > 0
        if want < len(current):
            others_ready = sum(1 for a in version if a not in current and is_ready(a))
            keep = 0 if version_total == 0 else max(0, 1 - others_ready)
            prefix = self.replicas.worker_prefix(ref)
            reps = [Replica(a.name, replica_index(a.name, prefix) or 0, is_ready(a)) for a in current]
            victims = choose_victims(reps, len(current) - want, keep)
            self._note(target, "" if len(victims) == len(current) - want else
                       f"{target}: keeping {len(current) - want - len(victims)} worker(s) over the desired "
                       f"{want}: the last ready worker of {ref} is stopped only for a desired total of 0")
            asleep = len(self._active(lambda a: a.kind == "worker" and a.model == ref and a.sleeping_since is not None
                                      and (a.pool or self.cfg.pool) == pool))
            for name in victims:
                if self.sleep.prefers_sleep(ref, pool, asleep):
                    asleep += 1
                    self._sleep_replica(self.procs.actor(name), target, len(current), want, d, now)
                else:
                    self._stop_replica(self.procs.actor(name), target, len(current), want, d, now)
            return bool(victims)
        self._note(target, "")
        return False

    def _note(self, target: str, msg: str) -> None:
        """Log ``msg`` about ``target`` when it differs from the last one (a deferred action, once)."""
        if self._notes.get(target, "") != msg:
            self._notes[target] = msg
            if msg:
                log.warning("%s", msg)

    def _free_index(self, kind: str, prefix: str, ref: str | None = None) -> int:
        """Lowest index of ``<prefix><n>`` no replica holds (a scaled-down, exited one frees its index)."""
        used = [replica_index(a.name, prefix) for a in self.procs.actors
                if a.kind == kind and (ref is None or a.model == ref)
                and not (a.stopped_by == "autoscaler" and not a.running)]
        return next_free_index(n for n in used if n is not None)

    def _start_replica(self, a: ActorProcess, target: str, current: int, want: int, d: Desired) -> None:
        """Spawn the new replica ``a`` (replacing an exited, scaled-down entry of the same name)."""
        a.dynamic = True
        self.procs.actors = [b for b in self.procs.actors if b.name != a.name] + [a]
        try:
            self.procs.spawn(a)
        except OSError as e:
            log.error("could not start %s: %s", a.name, e)
            return
        self._record("start", a, target, d.reason, f"scale {target} {current} -> {want}: started {a.name} "
                     f"(pid {a.pid}; reason: {d.why()})", by=d.by, pool=a.pool, decided_at=d.ts)

    def _wake_sleepers(self, ref: str, pool: str, n: int, target: str, d: Desired) -> int:
        """Wake up to ``n`` sleeping workers of ``ref`` on ``pool`` (the most recently slept first); how many."""
        sleepers = sorted((a for a in self._active(lambda a: a.kind == "worker" and a.model == ref
                                                   and a.sleeping_since is not None and a.running)
                           if (a.pool or self.cfg.pool) == pool), key=lambda a: -(a.sleeping_since or 0.0))
        for a in sleepers[:n]:
            self.sleep.wake(a)
            self._record("wake", a, target, d.reason, f"scale {target}: waking {a.name} (reason: {d.why()})",
                         by=d.by, decided_at=d.ts)
        return len(sleepers[:n])

    def _sleep_replica(self, a: ActorProcess, target: str, current: int, want: int, d: Desired, now: float) -> None:
        """Put ``a`` to sleep (its KV cache freed, process and weights kept; supervisor_sleep.py)."""
        self.sleep.sleep(a, now)
        self._record("sleep", a, target, d.reason, f"scale {target} {current} -> {want}: {a.name} sleeps "
                     f"(reason: {d.why()}; it exits after {self.sleep.horizon_s:.0f} s asleep)", by=d.by,
                     decided_at=d.ts)

    def _retire_sleepers(self, now: float) -> bool:
        """Stop the sleepers asleep for the horizon (SIGTERM, as a scale-down). True when one was stopped."""
        expired = self.sleep.expired(self._active(lambda a: a.kind == "worker"), now, self.cfg.pool)
        for a in expired:
            d = Desired(0, reason=f"asleep {now - (a.sleeping_since or now):.0f} s (horizon "
                        f"{self.sleep.horizon_s:.0f} s, or the autoscaler's sleep plan)", by="supervisor")
            a.sleeping_since = None
            self._stop_replica(a, self._target_of(a), 0, 0, d, now)
        return bool(expired)

    def observe_sleep(self, records: Mapping[str, Any]) -> None:
        """Sleep records read from etcd: sleepers a scheduler woke count as awake again."""
        with self.procs.lock:
            for a in self.sleep.observe(records, self.procs.actors):
                self._record("wake", a, self._target_of(a), "woken by its scheduler", f"{a.name} was woken by its "
                             "scheduler (requests waited and only sleeping workers were left)")

    def take_commands(self) -> list[tuple[str, dict]]:
        """The sleep / wake commands to write to etcd (the registry watch writes them after each round)."""
        with self.procs.lock:
            return self.sleep.take_commands()

    def _stop_replica(self, a: ActorProcess, target: str, current: int, want: int, d: Desired, now: float) -> None:
        """SIGTERM ``a``'s group (it drains), marked stopped by the autoscaler first so nothing restarts it."""
        a.stopped_by = "autoscaler"
        if a.running:
            a.term_sent_at = now
            signal_actor(a, signal.SIGTERM)
        self._record("stop", a, target, d.reason, f"scale {target} {current} -> {want}: draining {a.name} "
                     f"(SIGTERM; reason: {d.why()})", by=d.by, was_ready=is_ready(a), decided_at=d.ts)


async def clear_desired(etcd_url: str) -> int:
    """Delete every record under ``desired_prefix()``, ``notices_prefix()`` and ``sleep_prefix()`` (a new ``up``
    run starts from today's counts, and a notice or sleep command of an earlier run's worker must not hit this
    run's worker of that name);
    returns how many there were."""
    from control.state.names import desired_prefix, notices_prefix, sleep_prefix
    from control.state.registry import Registry

    async with Registry.connect(etcd_url) as reg:
        return (await reg.delete_prefix(desired_prefix()) + await reg.delete_prefix(notices_prefix())
                + await reg.delete_prefix(sleep_prefix()))


async def seed_desired(etcd_url: str, counts: Mapping[str, int]) -> None:
    """Write ``{desired key: count}`` for the replicas ``up`` starts itself (``by: "up"``), so that the
    autoscaler counts them as starting until they register instead of taking them for missing (a "below
    floor" scale-up of a worker that is still loading)."""
    import time

    from control.state.registry import Registry

    async with Registry.connect(etcd_url) as reg:
        for key, count in counts.items():
            await reg.put_json(key, {"count": int(count), "ts": time.time(), "reason": "the counts up started",
                                     "by": "up"})
