"""The autoscaler's signal windows (pure: no I/O, no clock -- every ``now`` is passed in, monotonic s).

The actor (actors/autoscaler/service.py) feeds these books with what it hears and reads, and each tick builds
the policies' inputs from them:

* :class:`LoadBook`: the latest ``ActorLoad`` of every actor (``as.int.load.>``) -> one ``CpuKindSignals`` per
  CPU-tier kind over the replicas that reported within ``stale_s`` (lag and wait: the worst replica's,
  pending and handled/s: summed, CPU: the mean, as signals.CpuKindSignals documents), and the active
  scheduler's version figures;
* :class:`CreditBook`: the latest worker heartbeat (``as.int.credits.>``) of every worker: KV use, draining,
  and the completion tokens it served over a window (its pool's ``served_tokens_per_s``);
* :class:`LatencyBook`: TTFT and ITL of the completion records (``as.int.done.>``) per version -> p90 over
  ``latency_window_s``;
* :func:`pool_signals`: one ``PoolSignals`` per (version, pool) from the worker records of etcd, the
  preemption notices (those workers are ``leaving``), the books and the desired counts written earlier.

A version's scheduler figures (queue, arrivals, cold-start waits) belong to the version, not to one pool: with
workers on several pools each pool gets the share of its active workers (all of it to the version's default
pool while none is active); with a pool mix (``mixes``: workers per pool by cost per SLO-met token, mix.py)
each pool of the mix gets the mix's share instead, so a pool the mix wants and that has no worker yet sees
demand and scales from zero. Token figures count generated tokens (the unit of
ThroughputCurve.capacity_tokens_per_s): the scheduler reports them so (actors/scheduler/load.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

from actors.autoscaler.signals import CPU_KINDS, CpuKindSignals, PoolSignals, pool_signal_key
from bus.messages import ActorLoad, Credits
from control.policy.numbers import is_number


@dataclass(frozen=True)
class CollectConfig:
    """Windows of the books (s). ValueError for a non-positive one."""

    stale_s: float = 3.0  # a load report or heartbeat older than this is from an actor that is gone
    served_window_s: float = 5.0  # a worker's served tokens/s over this window
    latency_window_s: float = 30.0  # TTFT / ITL p90 over the completions of this window
    starting_s: float = 180.0  # a desired count above the live one counts as "starting" this long after its write

    def __post_init__(self) -> None:
        for name in ("stale_s", "served_window_s", "latency_window_s", "starting_s"):
            v = getattr(self, name)
            if not is_number(v) or v <= 0:
                raise ValueError(f"CollectConfig.{name} must be a number > 0, got {v!r}")


def p90(values: Iterable[float]) -> float:
    """Nearest-rank 90th percentile; 0.0 for none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return float(ordered[min(len(ordered), max(1, math.ceil(0.9 * len(ordered)))) - 1])


class LoadBook:
    """The latest ActorLoad of each (kind, actor id) with the time it arrived."""

    def __init__(self, cfg: CollectConfig | None = None) -> None:
        self.cfg = cfg or CollectConfig()
        self._latest: dict[tuple[str, str], tuple[float, ActorLoad]] = {}

    def add(self, now: float, load: ActorLoad) -> None:
        """Record one report (a newer one replaces the actor's previous)."""
        self._latest[(load.kind, load.actor_id)] = (now, load)

    def fresh(self, now: float, kind: str) -> list[ActorLoad]:
        """The reports of ``kind`` received within ``stale_s`` (one per live actor), by actor id."""
        return [load for (k, aid), (t, load) in sorted(self._latest.items())
                if k == kind and now - t <= self.cfg.stale_s]

    def prune(self, now: float) -> None:
        """Forget actors silent for more than 10 x ``stale_s``."""
        self._latest = {k: v for k, v in self._latest.items() if now - v[0] <= 10 * self.cfg.stale_s}

    def cpu_signals(self, now: float, kinds: Iterable[str] = CPU_KINDS) -> dict[str, CpuKindSignals]:
        """One CpuKindSignals per kind (``replicas`` 0 when none reported lately)."""
        out = {}
        for kind in kinds:
            loads = self.fresh(now, kind)
            n = len(loads)
            out[kind] = CpuKindSignals(
                kind, n, loop_lag_ms_p95=max((x.loop_lag_ms_p95 for x in loads), default=0.0),
                pending=float(sum(x.pending for x in loads)),
                wait_ms_p90=max((x.wait_ms_p90 for x in loads), default=0.0),
                cpu_util=sum(x.cpu_util for x in loads) / n if n else 0.0,
                handled_per_s=sum(x.handled / x.window_s for x in loads if x.window_s > 0))
        return out

    def scheduler(self, now: float, name: str, version: str) -> ActorLoad | None:
        """The freshest scheduler report for ``name@version`` (the active scheduler's), None if none lately."""
        loads = [x for x in self.fresh(now, "scheduler") if (x.name, x.version) == (name, version)]
        return max(loads, key=lambda x: x.ts, default=None)


class _Served:
    """Amounts over a sliding window (tokens), for one worker."""

    def __init__(self) -> None:
        self.items: deque[tuple[float, float]] = deque()

    def add(self, now: float, amount: float, window_s: float) -> None:
        if amount > 0:
            self.items.append((now, amount))
        while self.items and self.items[0][0] < now - window_s:
            self.items.popleft()

    def rate(self, now: float, window_s: float) -> float:
        return sum(a for t, a in self.items if t >= now - window_s) / window_s


@dataclass
class WorkerCredit:
    """What the last heartbeat of one worker said (``at``: arrival, monotonic s)."""

    at: float
    name: str
    version: str
    kv_util: float  # used KV blocks / all (0..1)
    draining: bool


class CreditBook:
    """The latest heartbeat of each worker and the completion tokens it served over ``served_window_s``."""

    def __init__(self, cfg: CollectConfig | None = None) -> None:
        self.cfg = cfg or CollectConfig()
        self.latest: dict[str, WorkerCredit] = {}
        self._served: dict[str, _Served] = {}

    def add(self, now: float, c: Credits) -> None:
        """Record one heartbeat (its ``served`` map: ``{tenant: [prompt, completion]}`` since the previous)."""
        used = 1.0 - c.free_blocks / c.total_blocks if c.total_blocks > 0 else 0.0
        self.latest[c.worker_id] = WorkerCredit(now, c.name, c.version, min(1.0, max(0.0, used)), bool(c.draining))
        completion = 0.0
        for counts in (c.served or {}).values():
            try:
                completion += max(0, int(counts[1]))
            except (TypeError, ValueError, IndexError, KeyError):
                continue
        self._served.setdefault(c.worker_id, _Served()).add(now, completion, self.cfg.served_window_s)

    def fresh(self, now: float, worker_id: str) -> WorkerCredit | None:
        """The worker's last heartbeat if it is within ``stale_s``."""
        c = self.latest.get(worker_id)
        return c if c is not None and now - c.at <= self.cfg.stale_s else None

    def served_per_s(self, now: float, worker_id: str) -> float:
        """Completion tokens per s the worker served over the window."""
        s = self._served.get(worker_id)
        return s.rate(now, self.cfg.served_window_s) if s is not None else 0.0

    def draining(self, now: float) -> set[str]:
        """Workers whose last fresh heartbeat says draining."""
        return {w for w in self.latest if (c := self.fresh(now, w)) is not None and c.draining}

    def prune(self, now: float) -> None:
        """Forget workers silent for more than 10 x ``stale_s``."""
        gone = [w for w, c in self.latest.items() if now - c.at > 10 * self.cfg.stale_s]
        for w in gone:
            self.latest.pop(w, None)
            self._served.pop(w, None)


class LatencyBook:
    """TTFT and ITL samples (ms) of the completed requests of each version within ``latency_window_s``."""

    def __init__(self, cfg: CollectConfig | None = None, max_samples: int = 20_000) -> None:
        self.cfg = cfg or CollectConfig()
        self.max_samples = max_samples
        self._samples: dict[tuple[str, str], deque[tuple[float, float | None, float | None]]] = {}

    def add(self, now: float, name: str, version: str, ttft_ms: float | None, itl_ms: float | None) -> None:
        """One completed request's TTFT and ITL (either may be None: not measurable)."""
        q = self._samples.setdefault((name, version), deque(maxlen=self.max_samples))
        q.append((now, ttft_ms, itl_ms))
        while q and q[0][0] < now - self.cfg.latency_window_s:
            q.popleft()

    def p90(self, now: float, name: str, version: str) -> tuple[float, float]:
        """(TTFT p90, ITL p90) in ms over the window; 0.0 where there is no sample."""
        q = self._samples.get((name, version), ())
        recent = [s for s in q if s[0] >= now - self.cfg.latency_window_s]
        return (p90(s[1] for s in recent if s[1] is not None), p90(s[2] for s in recent if s[2] is not None))


@dataclass(frozen=True)
class WorkerRecord:
    """A registered worker (its leased etcd record under ``/actorserve/workers/{name}/{version}/{id}``)."""

    worker_id: str
    name: str
    version: str
    pool: str
    sleeping: bool = False  # its record says it sleeps (actors/worker/sleep.py): not a running replica
    host: str = ""  # the multi-model host it runs on (actors/worker/host.py), "" for a worker process of its own
    asleep_since: float = 0.0  # epoch s its sleep began (its record's sleep.since) while it sleeps
    wake_s: float = 0.0  # its last wake, command -> serving (s; 0: never woken)


def worker_records(prefix: str, listing: Mapping[str, object], default_pool: str) -> list[WorkerRecord]:
    """WorkerRecords from a prefix listing of the workers' keys (``prefix``: ``/actorserve/workers/``); a record
    without a ``pool`` string is on ``default_pool``. Malformed keys are skipped."""
    out = []
    for key, value in listing.items():
        parts = key[len(prefix):].split("/") if key.startswith(prefix) else []
        if len(parts) != 3 or not all(parts):
            continue
        pool = value.get("pool") if isinstance(value, dict) else None
        sleep = value.get("sleep") if isinstance(value, dict) else None
        asleep = isinstance(sleep, dict) and sleep.get("state") == "sleeping"
        host = value.get("host") if isinstance(value, dict) else None
        since = sleep.get("since") if asleep else 0.0
        wake = sleep.get("wake_s") if isinstance(sleep, dict) else 0.0
        out.append(WorkerRecord(parts[2], parts[0], parts[1], pool if isinstance(pool, str) and pool else default_pool,
                                asleep, host if isinstance(host, str) else "",
                                float(since) if is_number(since, minimum=0) else 0.0,
                                float(wake) if is_number(wake, minimum=0) else 0.0))
    return sorted(out, key=lambda r: (r.name, r.version, r.pool, r.worker_id))


@dataclass(frozen=True)
class Desired:
    """A desired count read back from etcd (``at``: when it was written, epoch s)."""

    count: int
    at: float


def pool_signals(now: float, wall: float, versions: Iterable[tuple[str, str]], default_pool: str,
                 workers: Iterable[WorkerRecord], leaving_ids: set[str], loads: LoadBook, credits: CreditBook,
                 latencies: LatencyBook, desired: Mapping[str, Desired] | None = None,
                 cfg: CollectConfig | None = None,
                 mixes: Mapping[tuple[str, str], Mapping[str, int]] | None = None) -> dict[str, PoolSignals]:
    """PoolSignals keyed ``name/version/pool`` for every version of ``versions`` (the registered, not retired
    ones) on its default pool, on every pool where it has a registered worker and on every pool of its mix.
    ``now``: monotonic s (the books); ``wall``: epoch s (``desired`` write times); ``desired``: by the same keys;
    ``mixes``: ``{(name, version): {pool: workers}}`` for the versions with a pool mix."""
    cfg = cfg or CollectConfig()
    desired, mixes = desired or {}, mixes or {}
    by_pool: dict[tuple[str, str], dict[str, list[WorkerRecord]]] = {}
    asleep: dict[tuple[str, str, str], int] = {}  # sleeping workers per version pool: not replicas, a tier
    for w in workers:
        if w.sleeping:
            asleep[(w.name, w.version, w.pool)] = asleep.get((w.name, w.version, w.pool), 0) + 1
            continue
        by_pool.setdefault((w.name, w.version), {}).setdefault(w.pool, []).append(w)
    out: dict[str, PoolSignals] = {}
    for name, version in sorted(set(versions)):
        pools = by_pool.get((name, version), {})
        pools.setdefault(default_pool, [])
        mix = mixes.get((name, version)) or {}
        for pool in mix:
            pools.setdefault(pool, [])
        leaving = {p: sum(1 for w in ws if w.worker_id in leaving_ids) for p, ws in pools.items()}
        active_all = sum(len(ws) - leaving[p] for p, ws in pools.items())
        sched = loads.scheduler(now, name, version)
        ttft, itl = latencies.p90(now, name, version)
        for pool, ws in sorted(pools.items()):
            active = len(ws) - leaving[pool]
            if sum(mix.values()) > 0:
                share = mix.get(pool, 0) / sum(mix.values())
            else:
                share = active / active_all if active_all else (1.0 if pool == default_pool else 0.0)
            key = pool_signal_key(name, version, pool)
            want = desired.get(key)
            starting = (max(0, want.count - active) if want is not None and wall - want.at <= cfg.starting_s
                        else 0)
            kv = [c.kv_util for w in ws if (c := credits.fresh(now, w.worker_id)) is not None]
            out[key] = PoolSignals(
                name, version, pool, replicas=len(ws), starting=starting, leaving=leaving[pool],
                queue_tokens=(sched.queue_tokens * share) if sched else 0.0,
                queue_len=round(sched.queue_len * share) if sched else 0,
                kv_util=sum(kv) / len(kv) if kv else 0.0, ttft_ms_p90=ttft, itl_ms_p90=itl,
                arrival_tokens_per_s=(sched.arrivals_tokens_per_s * share) if sched else 0.0,
                served_tokens_per_s=sum(credits.served_per_s(now, w.worker_id) for w in ws),
                cold_start_waiting=round(sched.cold_start_waiting * share) if sched else 0,
                sleeping=asleep.get((name, version, pool), 0))
    return out
