"""Replica state of every pool during a simulation (pure, numpy): ready, starting (cold start, ready at a
time), leaving (preemption notice or scale-down drain, gone at a deadline), in-flight sequences, and the
migration queue of sequences moved off leaving replicas.

A replica that gets a preemption notice stops taking new work at once; its share of the pool's in-flight
sequences (in-flight x k / ready) joins the migration queue with the notice's deadline, is re-admitted
before any new request into free KV slots of any pool, and counts as dropped only when the deadline passes
first (SpotServe / our live workers migrate during the notice). A replica removed by a scale-down drains the
same way (its deadline: the notice length), counted apart. Every replica is billed from its start until it
is gone (starting and leaving included).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from control.sim.api import FleetInputs, split_pool_key


@dataclass
class Migration:
    deadline_s: float
    n: float
    preempted: bool


@dataclass
class FleetState:
    """Arrays are indexed like ``keys`` (pool keys, inputs.pool_keys())."""

    keys: list[str]
    ready: np.ndarray
    starting: list = field(default_factory=list)  # heap of (ready_at_s, seq, pool index, count)
    leaving: list = field(default_factory=list)  # heap of (gone_at_s, seq, pool index, count)
    in_flight: np.ndarray | None = None
    migrations: list[Migration] = field(default_factory=list)
    dropped_preempted: float = 0.0
    dropped_drained: float = 0.0
    preemptions: int = 0
    _seq: int = 0

    @classmethod
    def empty(cls, inputs: FleetInputs) -> "FleetState":
        keys = inputs.pool_keys()
        return cls(keys, np.zeros(len(keys), dtype=np.int64), in_flight=np.zeros(len(keys)))

    def counts(self, heap: list) -> np.ndarray:
        out = np.zeros(len(self.keys), dtype=np.int64)
        for _, _, p, n in heap:
            out[p] += n
        return out

    def total_accelerators(self, gpus: np.ndarray) -> int:
        return int(((self.ready + self.counts(self.starting) + self.counts(self.leaving)) * gpus).sum())

    def _push(self, heap: list, at: float, p: int, n: int) -> None:
        self._seq += 1
        heapq.heappush(heap, (at, self._seq, p, n))

    def start(self, p: int, n: int, ready_at_s: float) -> None:
        if n > 0:
            self._push(self.starting, ready_at_s, p, n)

    def cancel_starting(self, p: int, n: int) -> int:
        """Cancel up to ``n`` of pool ``p``'s starting replicas, the latest first; returns how many."""
        mine = sorted((e for e in self.starting if e[2] == p), reverse=True)
        done = 0
        for e in mine:
            if done >= n:
                break
            self.starting.remove(e)
            take = min(e[3], n - done)
            if e[3] > take:
                self.starting.append((e[0], e[1], p, e[3] - take))
            done += take
        heapq.heapify(self.starting)
        return done

    def leave(self, p: int, n: int, now_s: float, notice_s: float, preempted: bool) -> None:
        """``n`` ready replicas of pool ``p`` get a notice: their in-flight share migrates (module docstring)."""
        n = int(min(n, self.ready[p]))
        if n <= 0:
            return
        moved = self.in_flight[p] * n / self.ready[p]
        self.in_flight[p] -= moved
        self.ready[p] -= n
        self._push(self.leaving, now_s + notice_s, p, n)
        if moved > 0:
            self.migrations.append(Migration(now_s + notice_s, moved, preempted))
        if preempted:
            self.preemptions += n

    def advance(self, now_s: float) -> None:
        """Starting replicas whose cold start ended become ready; leaving ones past their deadline go;
        migrations past their deadline are dropped."""
        while self.starting and self.starting[0][0] <= now_s:
            _, _, p, n = heapq.heappop(self.starting)
            self.ready[p] += n
        while self.leaving and self.leaving[0][0] <= now_s:
            heapq.heappop(self.leaving)
        keep = []
        for m in self.migrations:
            if m.deadline_s <= now_s and m.n > 0:
                if m.preempted:
                    self.dropped_preempted += m.n
                else:
                    self.dropped_drained += m.n
            elif m.n > 0:
                keep.append(m)
        self.migrations = keep

    def migrating(self) -> float:
        return float(sum(m.n for m in self.migrations))


def spot_mask(keys: list[str]) -> np.ndarray:
    return np.array([split_pool_key(k)[1] == "spot" for k in keys])


class Preemptions:
    """Spot preemptions: independent (each ready spot replica, probability 1 - exp(-rate x dt / 3600) per
    tick) and the correlated event (``correlated_fraction`` of each spot pool's ready replicas at its start,
    notices spread evenly over ``correlated_over_s``)."""

    def __init__(self, inputs: FleetInputs, keys: list[str], rng: np.random.Generator) -> None:
        self.sp = inputs.spot
        self.rng = rng
        self.spot = spot_mask(keys)
        self.rate = np.array([self.sp.preemption_rate_per_h.get(split_pool_key(k)[0], 0.0) for k in keys])
        self.plan: np.ndarray | None = None
        self.left = 0

    def draw(self, now_s: float, dt: float, ready: np.ndarray) -> np.ndarray:
        """Replicas per pool to get a notice in this tick."""
        p = 1.0 - np.exp(-self.rate * dt / 3600.0)
        out = np.where(self.spot, self.rng.binomial(ready, p), 0)
        at = self.sp.correlated_at_s
        if self.plan is None and now_s >= at and now_s < at + dt:
            total = np.where(self.spot, np.round(ready * self.sp.correlated_fraction), 0).astype(np.int64)
            ticks = max(1, int(math.ceil(self.sp.correlated_over_s / dt)))
            self.plan, self.left = total, ticks
        if self.plan is not None and self.left > 0:
            share = np.ceil(self.plan / self.left).astype(np.int64)
            share = np.minimum(share, self.plan)
            self.plan = self.plan - share
            self.left -= 1
            out = out + share
        return np.minimum(out, ready)
