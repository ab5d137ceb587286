"""``actorserve actor rollout``: the rollout controller (automatic canary analysis, issue #6 item 5).

Listens to the completion records (``as.int.done.<name>.*``) of the models whose routing table
(``/actorserve/models/{name}/routing``) is in state ``canary``, and only those: with no rollout running it hears
no record, where it once decoded every request's (0.2 ms of CPU a request, issue [25]; the analysis ignores
samples from before a rollout started, so it never read the others). It keeps a sliding window of samples per
model version and for every such model runs :func:`actors.rollout.policy.analyse` every ``--interval-s`` (0.5 s):
a healthy canary's weight is stepped through ``table.steps`` and finally promoted, a canary worse than stable
beyond the thresholds is rolled back. Each edit is a compare-and-swap write of the routing key (etcd
mod_revision), made with control/state/routing.py's ``set_weight`` / ``promote`` / ``rollback``
(``by="controller"``, the decision's reasons), so an operator's concurrent edit is never overwritten: a lost race
re-reads and re-decides on the next tick.

Which models are in rollout is read every ``--interval-s`` by every replica (the active one in its analysis
round): the records of a rollout's first ``--interval-s`` at most are not heard (the analysis waits for
``min_samples`` on each side anyway).

Replicas: every replica listens (its windows stay warm), only the holder of the leased election key
``/actorserve/controllers/rollout`` writes; standbys campaign every 0.25 s and take over within the
lease TTL (2 s) after the leader dies. A sample's time is when this controller received the record
(immune to clock skew between hosts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import Any

from actors.serve import ActorContext, serve
from bus import subjects
from bus.base import Msg
from bus.messages import CompletionRecord
from control.state import names
from control.state.election import lead
from actors.rollout.policy import (Decision, PolicyConfig, Sample, VersionWindow, analyse,
                                    sample_from_record)
from control.state.routing import RoutingTable, promote, rollback, set_weight
from actors.aio import cancel_tasks

log = logging.getLogger("actorserve.rollout")

ELECTION_KIND = "rollout"
MAX_RETENTION_S = 3600.0  # samples are never kept longer than this, whatever a table's window says


class RolloutController:
    """Windows of completion samples plus the analysis loop. ``start()`` / ``stop()``.

    ``registry``: a control.state.registry.Registry; ``bus``: a bus.base.Bus. With ``elect=False`` the
    controller acts without an election (tests of one replica)."""

    def __init__(self, bus, registry, *, interval_s: float = 0.5, controller_id: str | None = None,
                 elect: bool = True, lease_ttl: int = 2, max_samples_per_version: int = 50_000) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.bus, self.registry = bus, registry
        self.interval_s = float(interval_s)
        self.controller_id = controller_id or f"rollout-{socket.gethostname()}-{os.getpid()}"
        self.elect = elect
        self.lease_ttl = int(lease_ttl)
        self.max_samples = int(max_samples_per_version)
        self.windows: dict[tuple[str, str], VersionWindow] = {}
        self.is_leader = False
        self.decisions_written = 0
        self.last_decisions: dict[str, Decision] = {}  # model -> latest analysis result (any action)
        self._retention_s = PolicyConfig().window_s
        self._subs: dict[str, Any] = {}  # model name -> its completion-record subscription (in rollout)
        self._task: asyncio.Task | None = None
        self._follow_task: asyncio.Task | None = None
        self._lease = None
        self._bad_analysis_logged: set[str] = set()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start campaigning / analysing and following which models are in rollout (their completion records
        are subscribed to while they are)."""
        self._task = asyncio.create_task(self._run(), name="rollout-controller")
        self._follow_task = asyncio.create_task(self._follow(), name="rollout-follow")

    async def stop(self) -> None:
        """Stop analysing, resign leadership (a standby takes over at once), unsubscribe."""
        await cancel_tasks([self._task, self._follow_task])
        await self.listen(set())

    async def listen(self, models: set[str]) -> None:
        """Be subscribed to the completion records of exactly ``models`` (names): subscribe the new ones,
        unsubscribe the others (their windows age out by :meth:`_prune`). A failed subscribe is retried on
        the next call. Raises nothing but cancellation."""
        for name in [m for m in self._subs if m not in models]:
            sub = self._subs.pop(name)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        for name in sorted(models - set(self._subs)):
            try:
                self._subs[name] = await self.bus.subscribe(subjects.done_of_model(name), self._on_done)
            except Exception as exc:  # the bus is away: the next round tries again
                log.warning("could not subscribe to the completion records of %s: %r", name, exc)

    async def _follow(self) -> None:
        """While standing by, every ``interval_s``: which models are in rollout (the active replica learns it
        in :meth:`tick`), so a standby's windows are warm when it takes over."""
        while True:
            if not self.is_leader:
                try:
                    await self._scan()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # etcd away: keep the subscriptions, try again
                    log.debug("rollout standby could not read the routing tables: %r", exc)
            await asyncio.sleep(self.interval_s)

    async def _scan(self) -> list[str]:
        """The models whose routing table is in state ``canary`` (etcd read); sets the retention to the longest
        analysis window among them and subscribes to exactly their completion records."""
        prefix = names.models_prefix()
        stored = await self.registry.get_prefix_json(prefix)
        in_rollout = []
        retention = PolicyConfig().window_s
        for key, value in stored.items():
            parts = key[len(prefix):].split("/")
            if len(parts) == 2 and parts[1] == "routing" and isinstance(value, dict) and value.get("state") == "canary":
                in_rollout.append(parts[0])
                with contextlib.suppress(ValueError, TypeError):
                    retention = max(retention, float(value.get("analysis", {}).get("window_s", 0)))
        self._retention_s = retention
        await self.listen(set(in_rollout))
        return in_rollout

    async def __aenter__(self) -> "RolloutController":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- samples --------------------------------------------------------------------------------

    async def _on_done(self, msg: Msg) -> None:
        parts = msg.subject.split(".")  # as.int.done.<name>.<version>
        if len(parts) != 5:
            return
        try:
            rec = CompletionRecord.decode(msg.data)
        except ValueError as exc:
            log.debug("bad completion record on %s: %s", msg.subject, exc)
            return
        self.add_sample(parts[3], parts[4], sample_from_record(rec, received_at=time.time()), received=True)

    def add_sample(self, name: str, version: str, sample: Sample, *, received: bool = False) -> None:
        """Record one sample of ``name@version`` (``received``: stamp it with the receive time)."""
        if received:
            sample = Sample(time.time(), sample.status, sample.ttft_ms, sample.itl_ms)
        w = self.windows.get((name, version))
        if w is None:
            w = self.windows[(name, version)] = VersionWindow(self.max_samples)
        w.add(sample)

    def _prune(self, now: float) -> None:
        horizon = now - min(self._retention_s, MAX_RETENTION_S)
        for key in list(self.windows):
            w = self.windows[key]
            w.prune(horizon)
            if not len(w):
                del self.windows[key]

    # -- analysis -------------------------------------------------------------------------------

    async def _run(self) -> None:
        await lead(self.registry, names.controller_key(ELECTION_KIND), self.controller_id, elect=self.elect,
                   ttl=self.lease_ttl, interval_s=lambda: self.interval_s, tick=self.tick, on_lead=self._on_lead,
                   on_stand_down=self._stand_down, what="rollout controller")

    async def _on_lead(self, lease: Any) -> None:
        self._lease, self.is_leader = lease, True

    def _stand_down(self) -> None:
        self.is_leader, self._lease = False, None

    def config_for(self, name: str, table: RoutingTable) -> PolicyConfig:
        """The table's analysis settings over the defaults (defaults, logged once, when invalid)."""
        try:
            cfg = PolicyConfig.from_analysis(table.analysis, strict=False)
            self._bad_analysis_logged.discard(name)
            return cfg
        except ValueError as exc:
            if name not in self._bad_analysis_logged:
                log.error("model %s: invalid analysis settings (%s); using the defaults", name, exc)
                self._bad_analysis_logged.add(name)
            return PolicyConfig()

    async def tick(self, now: float | None = None) -> list[tuple[str, Decision]]:
        """One analysis round over every model in rollout; returns the decisions written to etcd."""
        now = time.time() if now is None else now
        in_rollout = await self._scan()
        self._prune(now)
        written = []
        for name in in_rollout:
            d = await self._decide(name, now)
            if d is not None:
                written.append((name, d))
        return written

    async def _decide(self, name: str, now: float) -> Decision | None:
        key = names.routing_key(name)
        data, rev = await self.registry.get_json_rev(key)
        try:
            table = RoutingTable.from_dict(data)
        except (ValueError, TypeError) as exc:
            log.error("model %s: unreadable routing table: %s", name, exc)
            return None
        if not table.rollout_active or table.stable is None:
            return None
        cfg = self.config_for(name, table)
        if not cfg.auto:
            return None
        empty: tuple[Sample, ...] = ()
        st = self.windows.get((name, table.stable))
        ca = self.windows.get((name, table.canary))
        d = analyse(table, st.samples if st else empty, ca.samples if ca else empty, cfg, now)
        self.last_decisions[name] = d
        if d.action == "wait":
            return None
        if d.action == "step":
            new = set_weight(table, d.weight, by="controller", reasons=d.reasons, now=now)
        elif d.action == "promote":
            new = promote(table, by="controller", reasons=d.reasons, now=now)
        else:
            new = rollback(table, by="controller", reasons=d.reasons, now=now)
        if not await self.registry.put_json_if_rev(key, new.to_dict(), rev):
            log.info("model %s: routing table changed while deciding (%s); re-deciding next round", name, d.action)
            return None
        self.decisions_written += 1
        log.info("model %s: %s (canary %s, weight %g%%): %s", name, d.action, table.canary, d.weight,
                 "; ".join(d.reasons))
        return d


# --- the actor ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Rollout controller options (common --nats/--etcd/--state-dir are added by the CLI)."""
    parser.add_argument("--interval-s", type=float, default=0.5, metavar="S",
                        help="seconds between two analysis rounds (default: 0.5)")
    parser.add_argument("--controller-id", default=None, help="id shown in the election key (default: host-pid)")
    parser.add_argument("--lease-ttl", type=int, default=2, metavar="S",
                        help="TTL of the election lease, 1..5 s (default: 2)")


async def main(args: argparse.Namespace) -> None:
    """Run the controller until cancelled; on stop, resign so a standby takes over at once."""
    await serve(args, "rollout-controller", build)


async def build(ctx: ActorContext) -> None:
    """Start the controller on the context's bus and registry (stopped, and its lease revoked, on stop)."""
    args = ctx.args
    ctl = RolloutController(await ctx.connect_bus(), ctx.registry, interval_s=args.interval_s,
                            controller_id=args.controller_id, lease_ttl=args.lease_ttl)
    await ctl.start()
    ctx.on_stop(ctl.stop, what="rollout controller")
    log.info("rollout controller %s started (campaigning for %s)", ctl.controller_id,
             names.controller_key(ELECTION_KIND))
