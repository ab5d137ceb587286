"""CPU-tier scaling policy (pure: no I/O, no clock; ``now`` is passed in): validators and gateways, each kind
on its own signals only — event-loop lag p95, pending queue-group messages per replica and their wait p90,
CPU per process — never on accelerator signals (``decide`` refuses anything but ``CpuKindSignals``).

Per kind, each tick:

* below the floor / above the ceiling (Limits): straight to the bound, no cool-down;
* up when any signal is above its high threshold, at most once per ``cooldown_up_s``: to
  ``ceil(replicas * value / target)`` of the worst signal (Kubernetes HPA's rule,
  desired = ceil(current * metric / target)), at least +1, at most ``max_up_factor`` x replicas per step
  (HPA's scale-up policy; queue waits grow without bound under overload, so the ratio alone overshoots);
* down by one when every signal stayed below its low threshold for ``down_window_s`` and ``cooldown_down_s``
  passed since the last change, and the proportional signals (CPU, pending per replica) projected on one
  replica fewer stay at or below their targets;
* between the low and high thresholds nothing happens (hysteresis);
* event-loop lag counts only while the kind does work of its own (it handled messages and its CPU,
  pending or wait is at least at its low threshold): a loop that other processes starve on a shared
  machine lags with nothing to do, and another replica on the same cores would not help (measured on a
  2-core machine: an idle validator next to a busy worker, 30-55 ms of lag at 0.01 s/s of CPU).

Only changes are returned, as ``Decision(loop="cpu")`` with every input used and the reason. The policy keeps
the last desired count per kind, so a scale-up whose replicas are still starting is not requested again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

from actors.autoscaler.decisions import Decision
from actors.autoscaler.signals import CpuKindSignals, Limits
from control.policy.numbers import is_number

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class CpuTierConfig:
    """Thresholds (low < target < high per signal; pending is per replica) and timing (seconds).

    Defaults: loop lag 50 ms high (a loop stalled 50 ms adds 50 ms to every request it holds; toobusy-js
    and Node guidance flag 50-70 ms), queue wait p90 200 ms high (a tenth of a 2-s TTFT SLO spent before
    validation), CPU 0.8 s/s high with a 0.6 target (HPA's usual 60-80 % utilisation targets).
    """

    lag_low_ms: float = 5.0
    lag_target_ms: float = 20.0
    lag_high_ms: float = 50.0
    wait_low_ms: float = 20.0
    wait_target_ms: float = 100.0
    wait_high_ms: float = 200.0
    pending_low: float = 0.5
    pending_target: float = 2.0
    pending_high: float = 4.0
    cpu_low: float = 0.3
    cpu_target: float = 0.6
    cpu_high: float = 0.8
    cooldown_up_s: float = 10.0
    cooldown_down_s: float = 60.0
    down_window_s: float = 30.0
    max_up_factor: float = 2.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not is_number(v, minimum=0, finite=False):
                raise ValueError(f"CpuTierConfig.{f.name} must be a number >= 0, got {v!r}")
        for sig in ("lag", "wait", "pending", "cpu"):
            low, target, high = (threshold(self, sig, p) for p in ("low", "target", "high"))
            if not low < target <= high:
                names = [_field(sig, p) for p in ("low", "target", "high")]
                raise ValueError(f"CpuTierConfig.{names[1]} must satisfy {names[0]} < {names[1]} <= {names[2]}, "
                                 f"got {low:g} / {target:g} / {high:g}")
        if self.max_up_factor < 1.0:
            raise ValueError(f"CpuTierConfig.max_up_factor must be >= 1, got {self.max_up_factor!r}")


def _field(sig: str, level: str) -> str:
    return f"{sig}_{level}_ms" if sig in ("lag", "wait") else f"{sig}_{level}"


def threshold(cfg: CpuTierConfig, sig: str, level: str) -> float:
    """Threshold ``level`` (low, target, high) of signal ``sig`` (lag, wait, pending, cpu) in ``cfg``."""
    return getattr(cfg, _field(sig, level))


# name, label in reasons, unit, proportional to replicas (projected on one replica fewer when scaling down)
_SIGNALS = (("lag", "loop lag p95", "ms", False), ("wait", "wait p90", "ms", False),
            ("pending", "pending per replica", "", True), ("cpu", "cpu", "s/s", True))


def _values(s: CpuKindSignals) -> dict[str, float]:
    return {"lag": s.loop_lag_ms_p95, "wait": s.wait_ms_p90, "pending": s.pending / max(s.replicas, 1),
            "cpu": s.cpu_util}


def _fmt(v: float, unit: str) -> str:
    text = f"{v:.0f}" if abs(v) >= 10 else f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}".rstrip()


@dataclass
class _State:
    desired: int | None = None
    last_up: float = _NEG_INF
    last_change: float = _NEG_INF
    low_since: float | None = None


class CpuTierPolicy:
    """See module docstring. ``decide`` is O(kinds), deterministic for a given sequence of calls."""

    def __init__(self, cfg: CpuTierConfig | None = None) -> None:
        self.cfg = cfg or CpuTierConfig()
        self._state: dict[str, _State] = {}

    def seed(self, kind: str, desired: int, ts: float) -> None:
        """Adopt ``desired`` (e.g. read back from etcd by a new leader), changed at ``ts``."""
        self._state[kind] = _State(desired=int(desired), last_up=ts, last_change=ts)

    def desired(self, kind: str) -> int | None:
        """The last desired count of ``kind`` (None before any decision or seed)."""
        st = self._state.get(kind)
        return None if st is None else st.desired

    def decide(self, now: float, signals: Mapping[str, CpuKindSignals], limits: Mapping[str, Limits]) -> list[Decision]:
        """Decisions (changes only) for every kind in ``signals`` that has ``limits``; a kind without limits
        is left alone. TypeError if a value is not CpuKindSignals (the CPU tier reads no accelerator signal)."""
        out = []
        for kind in sorted(signals):
            s = signals[kind]
            if not isinstance(s, CpuKindSignals):
                raise TypeError(f"CpuTierPolicy takes CpuKindSignals, got {type(s).__name__} for {kind!r}")
            if kind in limits:
                d = self._decide_one(now, kind, s, limits[kind])
                if d is not None:
                    out.append(d)
        return out

    def _decide_one(self, now: float, kind: str, s: CpuKindSignals, lim: Limits) -> Decision | None:
        st = self._state.setdefault(kind, _State())
        base = s.replicas if st.desired is None else st.desired
        vals = _values(s)
        raw_lag = vals["lag"]
        if not self._busy(s, vals):
            vals["lag"] = 0.0
        new, reason = self._bounds(base, lim)
        if new is None:
            new, reason = self._up(now, st, s, vals, base, lim)
        if new is None:
            new, reason = self._down(now, st, s, vals, base, lim)
        if new is None or new == base:
            return None
        if new > base:
            st.last_up = now
        st.desired, st.last_change, st.low_since = new, now, None
        inputs = {**{f"{k}": round(v, 3) for k, v in vals.items()}, "replicas": s.replicas, "previous": base,
                  "handled_per_s": s.handled_per_s, "floor": lim.floor, "ceiling": lim.ceiling,
                  "lag_raw": round(raw_lag, 3)}
        return Decision(now, "cpu", kind, s.replicas, new, f"{kind} {reason}", inputs)

    def _busy(self, s: CpuKindSignals, vals: dict[str, float]) -> bool:
        """True when the kind does work of its own: it handled messages and its CPU, pending or wait is at
        least at its low threshold (only then does its loop lag mean load; module docstring)."""
        return s.handled_per_s > 0 and any(vals[n] >= threshold(self.cfg, n, "low") for n in ("cpu", "pending", "wait"))

    @staticmethod
    def _bounds(base: int, lim: Limits) -> tuple[int | None, str]:
        if base < lim.floor:
            return lim.floor, f"below floor {lim.floor}"
        if base > lim.ceiling:
            return lim.ceiling, f"above ceiling {lim.ceiling}"
        return None, ""

    def _up(self, now: float, st: _State, s: CpuKindSignals, vals: dict[str, float], base: int,
            lim: Limits) -> tuple[int | None, str]:
        over = [(vals[n] / threshold(self.cfg, n, "target"), n, label, unit)
                for n, label, unit, _ in _SIGNALS if vals[n] > threshold(self.cfg, n, "high")]
        if not over:
            return None, ""
        ratio, n, label, unit = max(over)
        if now - st.last_up < self.cfg.cooldown_up_s:
            return None, ""
        r = max(s.replicas, 1)
        want = min(max(math.ceil(r * ratio), r + 1), math.ceil(r * self.cfg.max_up_factor))
        new = min(want, lim.ceiling)
        if new <= base:
            return None, ""
        high = threshold(self.cfg, n, "high")
        return new, f"{label} {_fmt(vals[n], unit)} > {_fmt(high, unit)}"

    def _down(self, now: float, st: _State, s: CpuKindSignals, vals: dict[str, float], base: int,
              lim: Limits) -> tuple[int | None, str]:
        if not all(vals[n] < threshold(self.cfg, n, "low") for n, *_ in _SIGNALS):
            st.low_since = None
            return None, ""
        if st.low_since is None:
            st.low_since = now
        r = min(base, s.replicas)
        if (now - st.low_since < self.cfg.down_window_s or now - st.last_change < self.cfg.cooldown_down_s
                or r - 1 < lim.floor or r < 1):
            return None, ""
        for n, label, unit, proportional in _SIGNALS:
            if proportional and r > 1 and vals[n] * r / (r - 1) > threshold(self.cfg, n, "target"):
                return None, ""
        lows = ", ".join(f"{label} {_fmt(vals[n], unit)} < {_fmt(threshold(self.cfg, n, 'low'), unit)}"
                         for n, label, unit, _ in _SIGNALS)
        return r - 1, f"all low for {now - st.low_since:.0f} s ({lows})"
