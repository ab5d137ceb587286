"""The autoscaler actor's shell (issue [13]): hears the signals, reads the cluster's state, runs the two pure
policies each tick and writes their decisions to etcd.

Heard on NATS (every replica, so a standby's windows are warm when it takes over): ``as.int.load.>`` (the
CPU-tier actors' and the schedulers' ``ActorLoad``), ``as.int.credits.*.*.*`` (worker heartbeats: KV use,
draining, tokens served) and ``as.int.done.*.*`` (completion records: TTFT / ITL). Read from etcd each tick
(the active replica only): the worker records (live workers per version and pool), the preemption notices
(those workers are ``leaving``: replaced while they migrate; a worker draining for a scale-down is not) and the
desired counts; every ``refresh_s``: the model versions (their
manifests' ``autoscale``: limits, SLOs, scale to zero), the pools and the measured throughput curves.

Each tick the active replica builds ``CpuKindSignals`` per CPU-tier kind and ``PoolSignals`` per version and
pool (actors/autoscaler/collect.py), calls ``CpuTierPolicy`` and ``PoolPolicy`` (each on its own signals only),
writes ``desired_key(...)`` = ``{"count", "ts", "reason", "by"}`` for every changed target and appends the
decisions to ``autoscaler_decisions_key()`` (newest last, at most 200). A version that two or more pools offer
(a pool record and the version's measured curve on it) gets a pool mix first (mix.plan_mix, cheapest per
SLO-met token for the demand its scheduler reports): each pool's share of the version's demand and its ceiling
follow the mix, so the pool policy grows the pools the mix picked and lets the others go. A replica that
becomes active seeds both policies from the desired counts stored by its predecessor, and waits ``warmup_s``
for fresh reports before deciding. The last signals it built are kept in :attr:`Autoscaler.snapshot` (and on
``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from actors.autoscaler.collect import (CollectConfig, CreditBook, Desired, LatencyBook, LoadBook, pool_signals,
                                       worker_records)
from actors.autoscaler.cpu_policy import CpuTierConfig, CpuTierPolicy
from control.policy.curves import ThroughputCurve
from actors.autoscaler.decisions import Decision, DecisionLog
from actors.autoscaler.forecast import ArrivalForecaster, ForecastConfig, forecast_signals
from actors.autoscaler.lend_carry import LendCarrier
from actors.autoscaler.pool_policy import PoolConfig, PoolPolicy
from actors.autoscaler.sleep_carry import SleepCarrier
from actors.autoscaler.sleep_tier import SleeperInfo, SleepPlan, SleepTierConfig, SleepTierPolicy
from actors.autoscaler.signals import (Limits, Slo, check_autoscale, limits_from_autoscale, pool_signal_key,
                                      slo_from_autoscale)
from bus import subjects
from bus.base import Msg
from bus.messages import ActorLoad, CompletionRecord, Credits
from control.policy.latency import itl_ms, ttft_ms
from control.state import names
from control.state.election import lead
from actors.aio import cancel_tasks

log = logging.getLogger("actorserve.autoscaler")

ELECTION_KIND = "autoscaler"


@dataclass
class AutoscalerConfig:
    """What the autoscaler scales and how (ValueError on bad values). ``cpu_limits``: floor / ceiling per
    CPU-tier kind (a kind absent here is never scaled); ``worker_limits``: per version on its default pool,
    unless its manifest's ``autoscale`` says otherwise; ``pool``: the pool a version with no worker scales on."""

    cpu_limits: dict[str, Limits] = field(default_factory=lambda: {"validator": Limits(1, 2), "gateway": Limits(1, 1)})
    worker_limits: Limits = field(default_factory=lambda: Limits(1, 2))
    tick_s: float = 1.0
    pool: str = "local"
    refresh_s: float = 5.0  # models, pools and curves are re-read this often (s)
    warmup_s: float = 3.0  # a new leader decides after this long (fresh reports of every live actor)
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    pools: PoolConfig = field(default_factory=PoolConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    sleep: SleepTierConfig = field(default_factory=SleepTierConfig)  # the sleeping tier (sleep_tier.py)
    carry_sleep: bool = False  # write the sleep / wake records itself: no supervisor (Kubernetes; sleep_carry.py)
    # lend a sleeping version's host to a version short of replicas (multi-version hosts; lend_carry.py, [29])
    lend: bool = False
    # arrivals planned one cold start ahead (actors/autoscaler/forecast.py, issue [29]); off live by default: the
    # 2-core stack's workers start in ~3 s, and `actorserve simulate` runs it on (docs/autoscaling.md)
    forecast: ForecastConfig = field(default_factory=lambda: ForecastConfig(enabled=False))
    controller_id: str = ""
    elect: bool = True
    lease_ttl: int = 2

    def __post_init__(self) -> None:
        if not self.tick_s > 0 or not self.refresh_s > 0 or self.warmup_s < 0:
            raise ValueError("tick_s and refresh_s must be > 0, warmup_s >= 0")
        names.validate_name("pool name", self.pool)
        for kind, lim in self.cpu_limits.items():
            if kind not in ("validator", "gateway") or not isinstance(lim, Limits):
                raise ValueError(f"cpu_limits: {kind!r} is not a CPU-tier kind (validator, gateway) with Limits")
        if not 1 <= self.lease_ttl <= 5:
            raise ValueError("lease_ttl must be 1..5 s")
        self.controller_id = self.controller_id or f"autoscaler-{socket.gethostname()}-{os.getpid()}"


@dataclass
class ClusterState:
    """What one tick read from etcd."""

    workers: list = field(default_factory=list)  # collect.WorkerRecord
    notices: set[str] = field(default_factory=set)  # worker ids with a preemption notice
    desired: dict[str, Desired] = field(default_factory=dict)  # target key ("validator", "n/v/p") -> count
    versions: dict[tuple[str, str], dict] = field(default_factory=dict)  # active versions -> manifest
    curves: dict[str, ThroughputCurve] = field(default_factory=dict)  # "n/v/p" -> curve
    pools: dict[str, dict] = field(default_factory=dict)  # pool name -> record


def desired_key_of(target: str) -> str:
    """The etcd key of a Decision.target (``validator`` / ``gateway`` / ``worker/<n>/<v>/<p>``)."""
    parts = target.split("/")
    return names.desired_key(parts[0], *parts[1:])


def parse_desired(listing: Mapping[str, Any]) -> dict[str, Desired]:
    """``{"validator": Desired, "name/version/pool": Desired, ...}`` from a listing of the desired prefix."""
    prefix, out = names.desired_prefix(), {}
    for key, value in listing.items():
        rest = key[len(prefix):].split("/")
        count = value.get("count") if isinstance(value, dict) else None
        if isinstance(count, bool) or not isinstance(count, int):
            continue
        at = value.get("ts") if isinstance(value.get("ts"), (int, float)) else 0.0
        if len(rest) == 1:
            out[rest[0]] = Desired(value["count"], float(at))
        elif len(rest) == 4 and rest[0] == "worker":
            out["/".join(rest[1:])] = Desired(value["count"], float(at))
    return out


class Autoscaler:
    """Signal windows, the election and the decision loop. ``start()`` / ``stop()``; ``tick()`` runs one round
    (tests call it directly with ``elect=False``)."""

    def __init__(self, bus, registry, cfg: AutoscalerConfig | None = None) -> None:
        self.bus, self.registry = bus, registry
        self.cfg = cfg or AutoscalerConfig()
        self.loads, self.credits = LoadBook(self.cfg.collect), CreditBook(self.cfg.collect)
        self.latencies = LatencyBook(self.cfg.collect)
        self.cpu_policy, self.pool_policy = CpuTierPolicy(self.cfg.cpu), PoolPolicy(self.cfg.pools)
        self.sleep_policy = SleepTierPolicy(self.cfg.sleep)
        self.sleep_plans: dict[str, SleepPlan] = {}  # "n/v/p" -> the plan of the last tick
        self._sleep_written: dict[str, dict] = {}  # "n/v/p" -> the plan last written (reason aside)
        self.carrier = SleepCarrier()  # with carry_sleep: the sleep / wake records this replica writes
        self._warned: set[tuple] = set()  # (name, version, autoscale) whose invalid autoscale was logged
        self.lender = LendCarrier()  # with lend: the hosts it asks to load a version into a sleeper's room
        self.lend_asks_sent = 0  # host load asks sent (lend) and answered
        self.forecaster = ArrivalForecaster(self.cfg.forecast)
        self.log = DecisionLog()
        self.state = ClusterState()
        self.snapshot: dict[str, Any] = {}  # the signals, limits and desired counts of the last tick
        self.is_leader = False
        self.sleep_commands = 0  # sleep / wake records written (carry_sleep)
        self.leader_since = 0.0  # monotonic s
        self.decisions_written = 0
        self._refreshed = float("-inf")
        self.mixes: dict[tuple[str, str], dict[str, int]] = {}  # versions with a pool mix: pool -> workers
        self._subs: list = []
        self._task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to the signals and start campaigning / deciding."""
        self._subs = [await self.bus.subscribe(subjects.LOAD_ALL, self._on_load),
                      await self.bus.subscribe(subjects.credits_all(), self._on_credits),
                      await self.bus.subscribe(subjects.done_all(), self._on_done)]
        self._task = asyncio.create_task(self._run(), name="autoscaler")

    async def stop(self) -> None:
        """Stop deciding, resign (a standby takes over at once), unsubscribe."""
        await cancel_tasks([self._task])
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []

    # -- signals --------------------------------------------------------------------------------
    async def _on_load(self, msg: Msg) -> None:
        try:
            self.loads.add(time.monotonic(), ActorLoad.decode(msg.data))
        except ValueError as exc:
            log.debug("bad load report on %s: %s", msg.subject, exc)

    async def _on_credits(self, msg: Msg) -> None:
        try:
            self.credits.add(time.monotonic(), Credits.decode(msg.data))
        except (ValueError, TypeError) as exc:
            log.debug("bad credits on %s: %s", msg.subject, exc)

    async def _on_done(self, msg: Msg) -> None:
        try:
            rec = CompletionRecord.decode(msg.data)
        except ValueError:
            return
        if rec.status == "ok":
            self.latencies.add(time.monotonic(), rec.name, rec.version, ttft_ms(rec.timing),
                               itl_ms(rec.timing, rec.completion_tokens))

    # -- the loop -------------------------------------------------------------------------------
    async def _run(self) -> None:
        async def on_lead(_lease: Any) -> None:
            await self.become_leader()

        await lead(self.registry, names.controller_key(ELECTION_KIND), self.cfg.controller_id,
                   elect=self.cfg.elect, ttl=self.cfg.lease_ttl, interval_s=lambda: self.cfg.tick_s, tick=self.tick,
                   on_lead=on_lead, on_stand_down=self._stand_down, what="autoscaler")

    def _stand_down(self) -> None:
        self.is_leader = False

    async def become_leader(self) -> None:
        """Take over: the decision history and the desired counts of the predecessor seed the policies."""
        self.leader_since, self._refreshed = time.monotonic(), float("-inf")
        try:
            self.log = DecisionLog.from_json(await self.registry.get_json(names.autoscaler_decisions_key()))
            desired = parse_desired(await self.registry.get_prefix_json(names.desired_prefix()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # unreadable history or etcd away: a new history, policies start unseeded
            log.error("autoscaler: predecessor's state not read (%r); starting afresh", exc)
            self.log, desired = DecisionLog(), {}
        for key, d in desired.items():
            if key in self.cfg.cpu_limits:
                self.cpu_policy.seed(key, d.count, d.at)
            elif key.count("/") == 2:
                self.pool_policy.seed(key, d.count, d.at)
        self.is_leader = True  # only once seeded: a reader of is_leader sees the adopted counts
        log.info("autoscaler %s is active (%d desired counts adopted)", self.cfg.controller_id, len(desired))

    async def tick(self) -> list[Decision]:
        """One round: read the state, build the signals, decide, write the changes. Returns the decisions."""
        now, wall = time.monotonic(), time.time()
        await self._read_state(now)
        st = self.state
        # leaving = registered workers under a preemption notice, not every draining one: a worker the supervisor
        # stopped for a scale-down drains too, and replacing it would undo the scale-down (flapping)
        leaving = set(st.notices)
        # a kind nobody of which reported lately is left alone: no report is not the same as no replica (an
        # actor too old to report, NATS permissions), and a dead process is the supervisor's to restart
        cpu = {k: s for k, s in self.loads.cpu_signals(now, tuple(self.cfg.cpu_limits)).items() if s.replicas > 0}
        self.mixes = self._mixes(now)
        pools = pool_signals(now, wall, st.versions, self.cfg.pool, st.workers, leaving, self.loads, self.credits,
                             self.latencies, {k: d for k, d in st.desired.items() if k.count("/") == 2},
                             self.cfg.collect, self.mixes)
        pools = forecast_signals(self.forecaster, wall, pools)  # arrivals one cold start ahead (opt-in: [29])
        limits, slos = self._pool_limits(pools)
        curves = {k: c for k, c in st.curves.items() if k in pools}
        self.snapshot = {"ts": wall, "cpu": {k: dataclasses.asdict(s) for k, s in cpu.items()},
                         "pools": {k: dataclasses.asdict(s) for k, s in pools.items()},
                         "limits": {k: dataclasses.asdict(v) for k, v in {**self.cfg.cpu_limits, **limits}.items()},
                         "desired": {k: d.count for k, d in st.desired.items()}, "leaving": sorted(leaving),
                         "draining": sorted(self.credits.draining(now)),
                         "mixes": {f"{n}/{v}": dict(m) for (n, v), m in self.mixes.items()}}
        self.loads.prune(now)
        self.credits.prune(now)
        if now - self.leader_since < self.cfg.warmup_s:
            return []
        decisions = (self.cpu_policy.decide(wall, cpu, self.cfg.cpu_limits)
                     + self.pool_policy.decide(wall, pools, limits, slos, curves))
        self.sleep_plans = self._sleep_plans(wall, pools)
        self.snapshot["sleep"] = {k: p.to_json() for k, p in self.sleep_plans.items()}
        if decisions:
            await self._apply(decisions)
        await self._write_sleep_plans()
        if self.cfg.carry_sleep:
            await self._carry_sleep(wall, leaving)
        if self.cfg.lend:
            await self._carry_lends(wall, pools)
        return decisions

    async def _carry_lends(self, wall: float, pools: Mapping[str, Any]) -> None:
        """Ask hosts to load the versions short of replicas into other versions' sleeping room (lend_carry.py);
        a host that refuses or does not answer is logged, the ask retried after the carrier's retry_s."""
        from bus.host_messages import HostLoad, HostLoadAck

        desired = {k: d.count for k, d in self.state.desired.items() if k.count("/") == 2}
        queues: dict[str, int] = {}
        for s in pools.values():
            queues[f"{s.name}@{s.version}"] = queues.get(f"{s.name}@{s.version}", 0) + int(s.queue_len)
        asks = self.lender.asks(wall, self.state.workers, desired, queues)
        self.snapshot["lends"] = [a.to_json() for a in asks]
        self.snapshot["cold_wanted"] = dict(self.lender.cold)
        lent: list[Decision] = []
        for a in asks:
            try:
                msg = await self.bus.request(subjects.host_load(a.host_id),
                                             HostLoad(a.name, a.version, a.queue_len).encode(), timeout=2.0)
                ack = HostLoadAck.decode(msg.data)
            except Exception as exc:  # noqa: BLE001 - a host away: asked again after retry_s
                log.warning("autoscaler: lend of host %s to %s@%s not asked: %r", a.host_id, a.name, a.version, exc)
                continue
            self.lend_asks_sent += 1
            log.info("autoscaler: lend host %s (%s asleep there) to %s@%s: %s, %s", a.host_id, a.lent_from, a.name,
                     a.version, "accepted" if ack.accepted else "refused", ack.reason)
            if ack.accepted:
                lent.append(self._lend_decision(wall, a, desired, pools))
        if lent:
            self.log.extend(lent)
            await self.registry.put_json(names.autoscaler_decisions_key(), self.log.to_json())

    def _lend_decision(self, wall: float, a: Any, desired: Mapping[str, int], pools: Mapping[str, Any]) -> Decision:
        """The decision log's record of an accepted lend: the version's awake replicas and desired count."""
        keys = [k for k in desired if k.startswith(f"{a.name}/{a.version}/")]
        awake = sum(1 for w in self.state.workers if (w.name, w.version) == (a.name, a.version) and not w.sleeping)
        return Decision(wall, "lend", f"worker/{keys[0] if keys else f'{a.name}/{a.version}/{self.cfg.pool}'}",
                        awake, max(awake, sum(desired[k] for k in keys)),
                        f"lend host {a.host_id} ({a.lent_from} asleep there) to {a.name}@{a.version}: a load on a "
                        f"running host instead of a cold start", {"host": a.host_id, "lent_from": a.lent_from,
                                                                   "queue_len": a.queue_len})

    async def _carry_sleep(self, wall: float, leaving: set[str]) -> None:
        """Write the sleep / wake records of this tick (sleep_carry.py); an etcd error is logged, the command
        retried later."""
        desired = {k: d.count for k, d in self.state.desired.items() if k.count("/") == 2}
        for wid, want in self.carrier.commands(wall, self.state.workers, desired, self.sleep_plans, leaving):
            try:
                await self.registry.put_json(names.sleep_key(wid), {"want": want, "by": "autoscaler", "ts": wall})
                self.sleep_commands += 1
                log.info("autoscaler: %s %s (sleeping tier, no supervisor)", want, wid)
            except Exception as exc:  # noqa: BLE001 - etcd away: the carrier retries after its retry_s
                log.warning("autoscaler: could not write %s for %s: %r", want, wid, exc)

    def _sleep_plans(self, wall: float, pools: Mapping[str, Any]) -> dict[str, SleepPlan]:
        """The sleeping tier's plan of every pool (sleep_tier.py) from its active target and its sleepers: a
        sleeper shares its instance when an awake worker of another version runs on its host."""
        awake_hosts: dict[str, set] = {}
        for w in self.state.workers:
            if w.host and not w.sleeping:
                awake_hosts.setdefault(w.host, set()).add((w.name, w.version))
        out = {}
        for key, s in pools.items():
            sleepers = [SleeperInfo(w.worker_id, max(0.0, wall - w.asleep_since) if w.asleep_since else 0.0,
                                    w.wake_s, bool(awake_hosts.get(w.host, set()) - {(w.name, w.version)}))
                        for w in self.state.workers if w.sleeping and (w.name, w.version, w.pool) ==
                        (s.name, s.version, s.pool)]
            active = self.pool_policy.active_target(key)
            out[key] = self.sleep_policy.plan(key, wall, s.active if active is None else active, sleepers,
                                              awake=s.active)
        return out

    async def _write_sleep_plans(self) -> None:
        """Put each pool's changed sleep plan into its desired record (``"sleep"``; a pool with no record yet
        gets it with its next decision). The supervisor carries it out (control/ops/supervisor_sleep.py)."""
        for key, plan in self.sleep_plans.items():
            value = {k: v for k, v in plan.to_json().items() if k != "reason"}
            if self._sleep_written.get(key) == value or key not in self.state.desired:
                continue
            dkey = desired_key_of(f"worker/{key}")
            record = await self.registry.get_json(dkey)
            if isinstance(record, dict):
                record["sleep"] = plan.to_json()
                await self.registry.put_json(dkey, record)
                self._sleep_written[key] = value

    def _version_limits(self, name: str, version: str) -> tuple[Limits, Slo]:
        """The version's Limits and Slo: its manifest's ``autoscale`` over the defaults (defaults, logged, when
        it is invalid)."""
        autoscale = (self.state.versions.get((name, version)) or {}).get("autoscale")
        try:
            if autoscale is not None:  # a misspelt key or a wrong type: said, not ignored in silence
                check_autoscale(autoscale)
            return (limits_from_autoscale(autoscale, self.cfg.worker_limits),
                    slo_from_autoscale(autoscale, self.cfg.pools.default_slo))
        except ValueError as exc:  # said once per version and manifest, not every tick
            said = (name, version, repr(autoscale))
            if said not in self._warned:
                self._warned.add(said)
                log.warning("%s@%s: %s; using the defaults", name, version, exc)
            return self.cfg.worker_limits, self.cfg.pools.default_slo

    def _pool_limits(self, pools: Mapping[str, Any]) -> tuple[dict[str, Limits], dict[str, Slo]]:
        """Limits and SLOs per ``name/version/pool``: the version's on its default pool; on another pool floor 0
        and its record's ``max_workers`` (else the version's ceiling). With a pool mix each pool's ceiling is
        the mix's count (at least 1, the floor on the default pool), and a pool other than the default may go
        to zero when idle."""
        limits, slos = {}, {}
        for key, s in pools.items():
            lim, slo = self._version_limits(s.name, s.version)
            mix = self.mixes.get((s.name, s.version))
            if s.pool != self.cfg.pool:
                cap = (self.state.pools.get(s.pool) or {}).get("max_workers")
                lim = Limits(0, cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1 else lim.ceiling,
                             scale_to_zero=mix is not None)
            if mix is not None and s.pool in mix:
                lim = Limits(lim.floor, max(1, lim.floor, mix[s.pool]), lim.scale_to_zero)
            limits[key], slos[key] = lim, slo
        return limits, slos

    def _mixes(self, now: float) -> dict[tuple[str, str], dict[str, int]]:
        """Workers per pool by cost per SLO-met token (mix.plan_mix) for every version that two or more pools
        offer (a pool record and the version's measured curve on it), for the demand its scheduler reports."""
        from actors.autoscaler.mix import PoolOffer, plan_mix
        from control.state.pools import PoolRecord

        out = {}
        for name, version in self.state.versions:
            offers = []
            for pool, record in self.state.pools.items():
                curve = self.state.curves.get(pool_signal_key(name, version, pool))
                if curve is None:
                    continue
                try:
                    offers.append(PoolOffer.from_record(PoolRecord.from_json(pool, record), curve))
                except (ValueError, TypeError) as exc:
                    log.warning("pool %s: unusable record for the mix (%s)", pool, exc)
            if len(offers) < 2:
                continue
            sched = self.loads.scheduler(now, name, version)
            demand = sched.arrivals_tokens_per_s if sched else 0.0
            # the mix covers demand / target_util: PoolPolicy plans each pool at target_util of its capacity,
            # so a mix sized at 100 % would clip its ceiling and leave no headroom (the simulator agrees: [14])
            plan = plan_mix(demand / self.cfg.pools.target_util, offers, self._version_limits(name, version)[1])
            out[(name, version)] = dict(plan.workers)
        return out

    async def _apply(self, decisions: list[Decision]) -> None:
        """Write each decision's desired count, then the history (bounded)."""
        for d in decisions:
            value = {"count": d.desired, "ts": d.ts, "reason": d.reason, "by": self.cfg.controller_id}
            plan = self.sleep_plans.get(d.target.split("/", 1)[1]) if d.target.startswith("worker/") else None
            if plan is not None:
                value["sleep"] = plan.to_json()
                self._sleep_written[d.target.split("/", 1)[1]] = {k: v for k, v in value["sleep"].items()
                                                                  if k != "reason"}
            await self.registry.put_json(desired_key_of(d.target), value)
            key = d.target.split("/", 1)[1] if d.target.startswith("worker/") else d.target
            self.state.desired[key] = Desired(d.desired, d.ts)
            log.info("autoscaler: %s %d -> %d: %s", d.target, d.current, d.desired, d.reason)
        self.log.extend(decisions)
        await self.registry.put_json(names.autoscaler_decisions_key(), self.log.to_json())
        self.decisions_written += len(decisions)

    # -- etcd -----------------------------------------------------------------------------------
    async def _read_state(self, now: float) -> None:
        """Workers, notices and desired counts every tick; versions, pools and curves every ``refresh_s``."""
        reg, st = self.registry, self.state
        st.workers = worker_records(names.all_workers_prefix(),
                                    await reg.get_prefix_json(names.all_workers_prefix()), self.cfg.pool)
        st.notices = {k[len(names.notices_prefix()):] for k in await reg.get_prefix_json(names.notices_prefix())}
        st.desired = parse_desired(await reg.get_prefix_json(names.desired_prefix()))
        if now - self._refreshed < self.cfg.refresh_s:
            return
        st.versions = active_versions(names.models_prefix(), await reg.get_prefix_json(names.models_prefix()))
        pools = await reg.get_prefix_json(names.pools_prefix())
        st.pools = {k[len(names.pools_prefix()):]: v for k, v in pools.items() if isinstance(v, dict)}
        st.curves = parse_curves(names.profiles_prefix(), await reg.get_prefix_json(names.profiles_prefix()))
        self._refreshed = now


def active_versions(prefix: str, listing: Mapping[str, Any]) -> dict[tuple[str, str], dict]:
    """``{(name, version): manifest}`` of the versions whose status is ``active`` (models prefix listing)."""
    out = {}
    for key, value in listing.items():
        parts = key[len(prefix):].split("/")
        if len(parts) == 3 and parts[1] == "versions" and isinstance(value, dict) \
                and value.get("status", "active") == "active":
            out[(parts[0], parts[2])] = value
    return out


def parse_curves(prefix: str, listing: Mapping[str, Any]) -> dict[str, ThroughputCurve]:
    """``{"name/version/pool": ThroughputCurve}`` from a listing of the profiles prefix (bad ones skipped)."""
    out = {}
    for key, value in listing.items():
        parts = key[len(prefix):].split("/")
        if len(parts) != 3:
            continue
        try:
            out[pool_signal_key(*parts)] = ThroughputCurve.from_json(value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("unreadable throughput curve %s: %s", key, exc)
    return out
