"""The CPU tiers in the simulator (validators, gateways): every request costs each kind ``cpu_s_per_request``
CPU seconds in all, of which ``ttft_cpu_s_per_request`` lie on the path to its first token; each kind's
replicas are scaled by the live ``CpuTierPolicy`` (actors/autoscaler/cpu_policy.py, imported, not copied).

An asyncio gateway or validator interleaves all the requests it holds (one slice per await), so a replica is
a processor-sharing server, not a FCFS queue. Per kind with c ready replicas (the queue group spreads
arrivals evenly, so each replica is an M/G/1-PS queue with lambda / c), arrivals lambda (req/s), CPU per
request s and critical-path work x (s): rho = lambda s / c, and below saturation

* mean sojourn of the critical-path work: T(x) = x / (1 - rho) — M/G/1-PS, Kleinrock, *Queueing Systems*
  Vol. 2 (1976), Sec. 4.4, insensitive to the service-time distribution;
* its p99: x (1 + N99), N the number of other requests sharing the replica (geometric, P(N >= n) = rho^n,
  the PS queue-length law, same source), N99 = ln(100) / ln(1 / rho) - 1 (>= 0). A short job (x <= s) sees
  N about constant over its work; the mean of x (1 + N) is x / (1 - rho), as above.

At or above saturation a backlog B grows by (lambda - c / s) dt and adds B s / c. The signals the live policy
reads: cpu_util = min(rho, 1) CPU s/s per process; pending = lambda x (sojourn of s - s) (Little); wait p90 and
loop lag p95 = the extra delay of the critical-path work at that quantile, x N_q (an asyncio loop lags by the
slices of the requests it interleaves); handled_per_s = min(lambda, c / s). Replicas start after ``start_s``;
each costs ``price_per_replica_h``.
"""

from __future__ import annotations

import math

from actors.autoscaler.cpu_policy import CpuTierConfig, CpuTierPolicy
from actors.autoscaler.signals import CpuKindSignals, Limits
from control.sim.api import CpuTier


class CpuTiers:
    """State and per-tick figures of the CPU tiers (module docstring)."""

    def __init__(self, tier: CpuTier, cfg: CpuTierConfig | None = None) -> None:
        self.tier = tier
        self.policy = CpuTierPolicy(cfg)
        self.kinds = sorted(tier.cpu_s_per_request)
        self.ready = {k: tier.floor for k in self.kinds}
        self.starting: dict[str, list[tuple[float, int]]] = {k: [] for k in self.kinds}
        self.backlog = {k: 0.0 for k in self.kinds}
        self.limits = {k: Limits(tier.floor, tier.ceiling) for k in self.kinds}
        self.last: dict[str, dict] = {}
        self.cost_usd = 0.0
        self.decisions = 0

    def step(self, now_s: float, dt: float, rps: float) -> tuple[float, float]:
        """Advance one tick at ``rps``; returns (mean delay ms, p99 delay ms) added to TTFT, summed over kinds."""
        mean_ms = p99_ms = 0.0
        for k in self.kinds:
            self.ready[k] += sum(n for at, n in self.starting[k] if at <= now_s)
            self.starting[k] = [(at, n) for at, n in self.starting[k] if at > now_s]
            s, c = self.tier.cpu_s_per_request[k], max(self.ready[k], 1)
            x = self.tier.ttft_cpu_s(k)
            rho = rps * s / c
            self.backlog[k] = max(0.0, self.backlog[k] + (rps - c / s) * dt)
            extra = self.backlog[k] * s / c
            r = min(rho, 0.999)
            sojourn, p99 = x / (1 - r) + extra, x * (1 + _sharers(r, 0.99)) + extra
            self.last[k] = {"rho": rho, "sojourn_ms": sojourn * 1e3, "p99_ms": p99 * 1e3,
                            "wait90_ms": (x * _sharers(r, 0.90) + extra) * 1e3,
                            "wait95_ms": (x * _sharers(r, 0.95) + extra) * 1e3,
                            "pending": rps * (s / (1 - r) - s + extra), "handled": min(rps, c / s)}
            mean_ms += sojourn * 1e3
            p99_ms += p99 * 1e3
            billed = self.ready[k] + sum(n for _, n in self.starting[k])
            self.cost_usd += billed * self.tier.price_per_replica_h * dt / 3600.0
        return mean_ms, p99_ms

    def decide(self, now_s: float) -> None:
        """Run the live CpuTierPolicy on the last tick's signals and start / stop replicas."""
        sig = {k: CpuKindSignals(k, self.ready[k], loop_lag_ms_p95=v["wait95_ms"], pending=v["pending"],
                                 wait_ms_p90=v["wait90_ms"], cpu_util=min(v["rho"], 1.0), handled_per_s=v["handled"])
               for k, v in self.last.items()}
        for d in self.policy.decide(now_s, sig, self.limits):
            self.decisions += 1
            have = self.ready[d.target] + sum(n for _, n in self.starting[d.target])
            if d.desired > have:
                self.starting[d.target].append((now_s + self.tier.start_s, d.desired - have))
            elif d.desired < have:
                self._remove(d.target, have - d.desired)

    def _remove(self, kind: str, n: int) -> None:
        """Cancel starting replicas first (latest first), then stop ready ones (never below the floor)."""
        starting = sorted(self.starting[kind])
        while n > 0 and starting:
            at, m = starting.pop()
            take = min(m, n)
            n -= take
            if m > take:
                starting.append((at, m - take))
        self.starting[kind] = starting
        self.ready[kind] = max(self.tier.floor, self.ready[kind] - n)

    def warm(self, rps: float) -> None:
        """The run's warm start: each kind's replicas at the live policy's CPU target for ``rps``
        (ceil(rps x cpu_s / cpu_target), within floor and ceiling), ready now, seeded into the policy."""
        for k in self.kinds:
            n = math.ceil(rps * self.tier.cpu_s_per_request[k] / self.policy.cfg.cpu_target)
            self.ready[k] = min(max(n, self.tier.floor), self.tier.ceiling)
            self.starting[k] = []
            self.policy.seed(k, self.ready[k], 0.0)

    def replicas(self) -> int:
        return sum(self.ready.values())


def _sharers(rho: float, q: float) -> float:
    """The ``q`` quantile of the number of other requests on a PS replica at load ``rho`` (geometric,
    P(N >= n) = rho^n): ln(1 / (1 - q)) / ln(1 / rho) - 1, at least 0 (0 when rho <= 0)."""
    if rho <= 0.0:
        return 0.0
    return max(0.0, math.log(1.0 / (1.0 - q)) / math.log(1.0 / rho) - 1.0)
