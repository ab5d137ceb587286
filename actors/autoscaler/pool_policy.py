"""Accelerator-pool scaling policy (pure: no I/O, no clock; ``now`` is passed in): workers per model version
and pool, on the version's own signals only — queue depth in tokens, KV utilisation, TTFT / ITL p90 against
its Slo, arrivals against the pool's measured ThroughputCurve — never on CPU-tier signals.

Per ``name/version/pool`` each tick, in this order (the first that applies wins):

1. from zero at once: no worker wanted yet and a request waits (cold_start_waiting, queue_len or arrivals):
   ``max(floor, 1, needed)``;
2. to zero: ``Limits.scale_to_zero`` and idle (nothing arriving, queued, waiting or served) for
   ``idle_to_zero_s`` (default 300 s); the floor applies only while the version is in use;
3. floors and ceilings at once (a version never at 0 only by opting in);
4. up, at most once per ``cooldown_up_s``: to ``needed = ceil(arrivals / (capacity x target_util))`` where
   capacity is one replica's ``curve.capacity_tokens_per_s(slo.itl_ms)``; and, when a signal says overload
   (TTFT or ITL p90 over the SLO, KV above ``kv_high``, the queue needing more than ``queue_drain_high_s`` to
   drain at the served rate), at least one more than the active workers and ``ceil(active x arrivals /
   served)`` (the served rate of a saturated pool is its capacity), at most ``max_up_factor`` x active;
   without a curve, capacity is the largest per-worker served rate seen while the queue had a backlog
   (0, so only the signal path acts, until one was seen); while the pool has sleeping workers (a tier between
   running and cold: not counted as replicas, woken before anything is spawned, decision 0042) the cool-down
   does not apply: a wake serves in about a second, a cold start in tens;
5. down by one, after every signal stayed low (queue drains within ``queue_drain_low_s``, KV below
   ``kv_low``, TTFT/ITL p90 below ``slo_low_fraction`` of the SLO, arrivals fit one replica fewer at the
   target utilisation) for ``down_window_s`` and ``cooldown_down_s`` since the last change. Zero traffic is
   low, so an idle version comes down to its floor (Dynamo's Planner did not, ai-dynamo/dynamo#6985).

``leaving`` workers (preemption notice or draining) count as gone: the policy keeps an *active* target and
asks for ``desired = active target + leaving`` (capped at the ceiling), so a replacement starts while the
leaving worker migrates its sequences, and ``desired`` drops back when it is gone; neither waits for a
cool-down. The workers its own scale-downs stop also drain, and are not replaced: it counts them
(``retiring``: removed by a decision, less the leaving ones gone since, at most the leaving workers or the
workers above the target, whichever is more). Only changes are returned, as ``Decision(loop="pool")`` with
inputs and reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

from control.policy.curves import ThroughputCurve
from actors.autoscaler.decisions import Decision
from actors.autoscaler.signals import Limits, PoolSignals, Slo
from control.policy.numbers import is_number

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class PoolConfig:
    """Thresholds and timing (seconds) of PoolPolicy; every field a number >= 0, fractions in (0, 1].

    ``target_util`` 0.8: plan on 80 % of the curve's capacity at the ITL SLO (20 % headroom for bursts and
    the minutes a cold start takes); ``kv_high`` 0.9: above it the engine starts preempting sequences;
    ``default_*_slo_ms``: used for a version whose manifest sets no ``autoscale`` SLO (TTFT 2 s; ITL 100 ms: a
    default float32 worker of the shipped 135M model on the 2-core dev CPU meets it up to batch 16, measured
    by ``actorserve profile``: 61 ms at batch 1, 99.9 ms at 16).
    """

    target_util: float = 0.8
    queue_drain_high_s: float = 2.0
    queue_drain_low_s: float = 0.25
    kv_high: float = 0.9
    kv_low: float = 0.6
    slo_low_fraction: float = 0.5
    cooldown_up_s: float = 30.0
    cooldown_down_s: float = 120.0
    down_window_s: float = 60.0
    idle_to_zero_s: float = 300.0
    max_up_factor: float = 2.0
    default_ttft_slo_ms: float = 2000.0
    default_itl_slo_ms: float = 100.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not is_number(v, minimum=0, finite=False):
                raise ValueError(f"PoolConfig.{f.name} must be a number >= 0, got {v!r}")
        for name in ("target_util", "kv_high", "kv_low", "slo_low_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"PoolConfig.{name} must be in (0, 1], got {getattr(self, name)!r}")
        if self.kv_low >= self.kv_high:
            raise ValueError(f"PoolConfig.kv_low ({self.kv_low}) must be < kv_high ({self.kv_high})")
        if self.queue_drain_low_s >= self.queue_drain_high_s:
            raise ValueError("PoolConfig.queue_drain_low_s must be < queue_drain_high_s")
        if self.max_up_factor < 1 or self.default_ttft_slo_ms <= 0 or self.default_itl_slo_ms <= 0:
            raise ValueError("PoolConfig.max_up_factor must be >= 1 and default_*_slo_ms > 0")

    @property
    def default_slo(self) -> Slo:
        return Slo(self.default_ttft_slo_ms, self.default_itl_slo_ms)


@dataclass
class _State:
    active: int | None = None  # active target (leaving workers not counted)
    desired: int | None = None  # last desired total handed out
    last_up: float = _NEG_INF
    last_change: float = _NEG_INF
    low_since: float | None = None
    idle_since: float | None = None
    cap_est: float = 0.0  # per-replica served tokens/s seen with a queue backlog (used without a curve)
    retiring: int = 0  # leaving workers that are this policy's scale-down victims (not replaced)
    last_leaving: int = 0


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.2f}".rstrip("0").rstrip(".")


def _drain_s(s: PoolSignals, cap: float) -> float | None:
    """Seconds the queue needs at the served rate (else the curve's); None when no rate is known."""
    rate = s.served_tokens_per_s if s.served_tokens_per_s > 0 else cap * s.active
    if s.queue_tokens <= 0:
        return 0.0
    return s.queue_tokens / rate if rate > 0 else None


class PoolPolicy:
    """See module docstring. ``decide`` is O(pools), deterministic for a given sequence of calls."""

    def __init__(self, cfg: PoolConfig | None = None) -> None:
        self.cfg = cfg or PoolConfig()
        self._state: dict[str, _State] = {}

    def seed(self, key: str, active: int, ts: float, leaving: int = 0) -> None:
        """Adopt an active target (e.g. a new leader's read-back of desired minus leaving) set at ``ts``."""
        self._state[key] = _State(active=int(active), desired=int(active) + int(leaving), last_up=ts,
                                  last_change=ts)

    def active_target(self, key: str) -> int | None:
        """The active target of ``name/version/pool`` (None before any decision or seed)."""
        st = self._state.get(key)
        return None if st is None else st.active

    def decide(self, now: float, signals: Mapping[str, PoolSignals], limits: Mapping[str, Limits],
               slos: Mapping[str, Slo], curves: Mapping[str, ThroughputCurve]) -> list[Decision]:
        """Decisions (changes only) for every ``name/version/pool`` in ``signals`` that has ``limits``; a
        missing Slo takes the config's default, a missing curve falls back to the queue/SLO signals.
        TypeError if a value is not PoolSignals (pools read no CPU-tier signal)."""
        out = []
        for key in sorted(signals):
            s = signals[key]
            if not isinstance(s, PoolSignals):
                raise TypeError(f"PoolPolicy takes PoolSignals, got {type(s).__name__} for {key!r}")
            if key in limits:
                d = self._decide_one(now, key, s, limits[key], slos.get(key) or self.cfg.default_slo,
                                     curves.get(key))
                if d is not None:
                    out.append(d)
        return out

    def _decide_one(self, now: float, key: str, s: PoolSignals, lim: Limits, slo: Slo,
                    curve: ThroughputCurve | None) -> Decision | None:
        st = self._state.setdefault(key, _State())
        prev = s.active + s.starting if st.active is None else st.active
        st.idle_since = (st.idle_since if st.idle_since is not None else now) if s.idle() else None
        cap = curve.capacity_tokens_per_s(slo.itl_ms) if curve is not None else st.cap_est
        over = self._overload(s, slo, cap)
        drain = _drain_s(s, cap)
        if curve is None and s.active > 0 and drain is not None and drain > self.cfg.queue_drain_high_s:
            st.cap_est = max(st.cap_est, s.served_tokens_per_s / s.active)  # saturated: served ~ capacity
        needed = math.ceil(s.arrival_tokens_per_s / (cap * self.cfg.target_util)) if cap > 0 else 0
        new, reason = self._zero(now, st, s, lim, prev, needed)
        if new is None:
            new, reason = self._bounds(lim, prev)
        if new is None:
            new, reason = self._up(now, st, s, lim, prev, needed, cap, over)
        if new is None:
            new, reason = self._down(now, st, s, lim, prev, cap, slo, over)
        return self._finish(now, st, s, lim, prev, new, reason,
                            {"slo_ttft_ms": slo.ttft_ms, "slo_itl_ms": slo.itl_ms, "capacity_tokens_per_s":
                             round(cap, 3), "needed": needed, "curve": curve is not None})

    def _overload(self, s: PoolSignals, slo: Slo, cap: float) -> list[str]:
        out = []
        if s.ttft_ms_p90 > slo.ttft_ms:
            out.append(f"ttft p90 {_fmt(s.ttft_ms_p90)} ms > {_fmt(slo.ttft_ms)} ms")
        if s.itl_ms_p90 > slo.itl_ms:
            out.append(f"itl p90 {_fmt(s.itl_ms_p90)} ms > {_fmt(slo.itl_ms)} ms")
        if s.kv_util > self.cfg.kv_high:
            out.append(f"kv {_fmt(s.kv_util)} > {_fmt(self.cfg.kv_high)}")
        drain = _drain_s(s, cap)
        if drain is not None and drain > self.cfg.queue_drain_high_s:
            out.append(f"queue {_fmt(s.queue_tokens)} tokens drains in {_fmt(drain)} s > "
                       f"{_fmt(self.cfg.queue_drain_high_s)} s")
        return out

    def _zero(self, now: float, st: _State, s: PoolSignals, lim: Limits, prev: int,
              needed: int) -> tuple[int | None, str]:
        waiting = s.cold_start_waiting > 0 or s.queue_len > 0 or s.arrival_tokens_per_s > 0
        if prev == 0 and waiting:
            return (min(lim.ceiling, max(lim.floor, 1, needed)),
                    f"scale from zero: {s.cold_start_waiting} waiting for a cold start, {s.queue_len} queued, "
                    f"arrivals {_fmt(s.arrival_tokens_per_s)} tok/s")
        idle_for = now - st.idle_since if st.idle_since is not None else 0.0
        if lim.scale_to_zero and prev > 0 and st.idle_since is not None and idle_for >= self.cfg.idle_to_zero_s:
            return 0, f"idle for {idle_for:.0f} s >= {_fmt(self.cfg.idle_to_zero_s)} s: scale to zero"
        return None, ""

    @staticmethod
    def _bounds(lim: Limits, prev: int) -> tuple[int | None, str]:
        if prev == 0 and (lim.scale_to_zero or lim.floor == 0):
            return 0, ""  # at zero by choice: stays there until a request comes (rule 1)
        if prev < lim.floor:
            return lim.floor, f"below floor {lim.floor}"
        if prev > lim.ceiling:
            return lim.ceiling, f"above ceiling {lim.ceiling}"
        return None, ""

    def _up(self, now: float, st: _State, s: PoolSignals, lim: Limits, prev: int, needed: int, cap: float,
            over: list[str]) -> tuple[int | None, str]:
        want, why = needed, (f"arrivals {_fmt(s.arrival_tokens_per_s)} tok/s need {needed} at "
                             f"{_fmt(cap)} tok/s each x {_fmt(self.cfg.target_util)}")
        if over:
            base = max(s.active, 1)
            by_signal = base + 1
            if s.served_tokens_per_s > 0 and s.arrival_tokens_per_s > s.served_tokens_per_s:
                by_signal = max(by_signal, math.ceil(base * s.arrival_tokens_per_s / s.served_tokens_per_s))
            by_signal = min(by_signal, max(base + 1, math.ceil(base * self.cfg.max_up_factor)))
            if by_signal > want:
                want, why = by_signal, "; ".join(over)
        new = min(want, lim.ceiling)
        # the cool-down waits out a cold start; a sleeping worker is serving about a second after its wake
        # (decision 0042), so while the pool has sleepers a further step up does not wait for the last one
        cooldown = self.cfg.cooldown_up_s if s.sleeping == 0 else 0.0
        if new <= prev or now - st.last_up < cooldown:
            return None, ""
        return new, why + (f"; {s.sleeping} sleeping worker(s) to wake" if s.sleeping else "")

    def _low(self, s: PoolSignals, slo: Slo, cap: float, r: int) -> bool:
        drain = _drain_s(s, cap)
        f = self.cfg.slo_low_fraction
        fits = cap <= 0 or s.arrival_tokens_per_s <= cap * self.cfg.target_util * (r - 1)
        return (s.queue_len == 0 or (drain is not None and drain < self.cfg.queue_drain_low_s)) and fits \
            and s.kv_util < self.cfg.kv_low and s.ttft_ms_p90 < slo.ttft_ms * f and s.itl_ms_p90 < slo.itl_ms * f

    def _down(self, now: float, st: _State, s: PoolSignals, lim: Limits, prev: int, cap: float, slo: Slo,
              over: list[str]) -> tuple[int | None, str]:
        r = min(prev, s.active)
        if over or r < 1 or not self._low(s, slo, cap, r):
            st.low_since = None
            return None, ""
        if st.low_since is None:
            st.low_since = now
        low_for = now - st.low_since
        if low_for < self.cfg.down_window_s or now - st.last_change < self.cfg.cooldown_down_s \
                or r - 1 < max(lim.floor, 1):
            return None, ""
        return r - 1, (f"all low for {low_for:.0f} s: arrivals {_fmt(s.arrival_tokens_per_s)} tok/s, queue "
                       f"{s.queue_len}, kv {_fmt(s.kv_util)}, ttft p90 {_fmt(s.ttft_ms_p90)} ms, itl p90 "
                       f"{_fmt(s.itl_ms_p90)} ms")

    @staticmethod
    def _with_replacements(st: _State, s: PoolSignals, lim: Limits, prev: int, active: int) -> int:
        """Desired total: the active target plus one replacement per leaving worker that is not one of this
        policy's own scale-down victims (those drain as ``leaving`` too: ``retiring`` counts them, less
        those gone, at most the leaving workers or those above the target, whichever is more)."""
        st.retiring += max(0, prev - active)
        gone = max(0, st.last_leaving - s.leaving)
        st.retiring = min(max(0, st.retiring - gone), max(s.leaving, s.replicas - active))
        st.last_leaving = s.leaving
        return min(active + max(0, s.leaving - st.retiring), lim.ceiling) if active > 0 else 0

    def _finish(self, now: float, st: _State, s: PoolSignals, lim: Limits, prev: int, new: int | None,
                reason: str, extra: dict) -> Decision | None:
        active = prev if new is None else new
        desired = self._with_replacements(st, s, lim, prev, active)
        last = st.desired if st.desired is not None else s.replicas + s.starting
        if active != prev:
            st.last_change, st.low_since = now, None
            st.last_up = now if active > prev else st.last_up
        st.active = active
        if desired == last:
            return None
        st.desired = desired
        if active == prev:
            reason = (f"{s.leaving} leaving worker(s) replaced" if desired > last else "leaving worker(s) gone")
        inputs = {f: getattr(s, f) for f in ("replicas", "starting", "leaving", "queue_tokens", "queue_len",
                                             "kv_util", "ttft_ms_p90", "itl_ms_p90", "arrival_tokens_per_s",
                                             "served_tokens_per_s", "cold_start_waiting", "sleeping")}
        inputs.update(extra, previous_active=prev, active_target=active, floor=lim.floor, ceiling=lim.ceiling,
                      scale_to_zero=lim.scale_to_zero)
        return Decision(now, "pool", s.target, s.replicas, desired, f"{s.target} {reason}", inputs)
