"""Arrival-rate forecast per model version (pure: no I/O, no clock; ``now`` is passed in): additive seasonal
exponential smoothing (Holt-Winters), fitted online on the arrivals alone, so the pool policy can plan for the
demand one cold start ahead instead of the demand of the last tick (issue [29] item 2).

Method: Holt (1957, "Forecasting seasonals and trends by exponentially weighted moving averages", ONR memo
52; reprinted Int. J. Forecasting 20(1), 2004) and Winters (1960, "Forecasting sales by exponentially
weighted moving averages", Management Science 6(3)), in the additive form of Hyndman & Athanasopoulos,
"Forecasting: Principles and Practice", 3rd ed. (FPP3), section 8.3::

    level     l_t = alpha (y_t - s_{t-m}) + (1 - alpha) (l_{t-1} + b_{t-1})
    trend     b_t = beta (l_t - l_{t-1}) + (1 - beta) b_{t-1}
    season    s_t = gamma (y_t - l_{t-1} - b_{t-1}) + (1 - gamma) s_{t-m}
    forecast  y_{t+h|t} = l_t + h b_t + s_{t+h-m(k+1)},  k = floor((h - 1) / m)

y_t: the mean arrival rate (output tokens/s) over bucket t of ``bucket_s`` seconds; m = ``period_s /
bucket_s`` buckets a season (a day). Initialisation (FPP3 8.3's classical start, done online): until one
season has been seen, Holt's linear method (no season); after it, the level is that season's mean, the trend 0
and each seasonal index the bucket's deviation from the mean. The forecast is never below 0.

``ArrivalForecaster`` keeps one model per key (a version), takes the observed arrival rate at each call,
closes buckets on ``now``, and gives :meth:`ArrivalForecaster.planned`: ``max(observed, forecast at
lead_s)`` — the policy never plans below what arrives now (a forecast that misses a burst costs nothing
more than today's reactive rule), and plans for the ramp a cold start ahead. A key with no arrivals now is
left at 0 (an idle version still scales to zero). It also scores itself: each closed bucket's forecast made
``lead_s`` earlier against what arrived (MAPE and sMAPE, Hyndman & Koehler 2006, "Another look at measures of
forecast accuracy", Int. J. Forecasting 22(4)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Mapping

from control.policy.numbers import is_number


@dataclass(frozen=True)
class ForecastConfig:
    """Smoothing (alpha, beta, gamma in [0, 1]), bucket and season lengths (s), the lead (s: how far ahead the
    planned arrivals look; default one cold start of the simulated fleet, 52.2 s, plus a 30-s decision and
    mix cadence, rounded up to 90 s), ``drain_s`` (0: off; else plan :func:`backlog_rate` on top, so the
    backlog new replicas find drains within it) and ``enabled``.

    Defaults: alpha 0.5 and beta 0.1 follow a level shift within a few buckets (a 3x step moves the level
    half-way in one minute) while smoothing Poisson noise; gamma 0.2 learns a daily shape in a few days
    (FPP3's fitted values for daily-seasonal series lie in 0.1-0.3); bucket 60 s, season 1 day."""

    alpha: float = 0.5
    beta: float = 0.1
    gamma: float = 0.2
    bucket_s: float = 60.0
    period_s: float = 86_400.0
    lead_s: float = 90.0
    drain_s: float = 0.0
    enabled: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "enabled":
                if not isinstance(v, bool):
                    raise ValueError(f"ForecastConfig.enabled must be a bool, got {v!r}")
                continue
            if not is_number(v, minimum=0):
                raise ValueError(f"ForecastConfig.{f.name} must be a finite number >= 0, got {v!r}")
        for n in ("alpha", "beta", "gamma"):
            if getattr(self, n) > 1:
                raise ValueError(f"ForecastConfig.{n} must be in [0, 1], got {getattr(self, n)!r}")
        if self.bucket_s <= 0 or self.period_s < self.bucket_s:
            raise ValueError("ForecastConfig.bucket_s must be > 0 and period_s >= bucket_s")

    @property
    def season(self) -> int:
        """Buckets per season (m)."""
        return max(1, int(round(self.period_s / self.bucket_s)))


@dataclass
class HoltWinters:
    """One additive Holt-Winters model over buckets (module docstring); ``update(y)`` per bucket, in order."""

    cfg: ForecastConfig
    level: float | None = None
    trend: float = 0.0
    seasonal: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)  # the first season's values, for the classical start
    n: int = 0

    def update(self, y: float) -> None:
        """Fold in bucket ``n``'s mean rate ``y`` (>= 0; ValueError otherwise)."""
        if not is_number(y, minimum=0):
            raise ValueError(f"HoltWinters.update takes a finite rate >= 0, got {y!r}")
        c, m = self.cfg, self.cfg.season
        if not self.seasonal:
            self.first.append(y)
            if self.level is None:
                self.level = y
            else:  # Holt's linear method until one season is seen
                prev = self.level
                self.level = c.alpha * y + (1 - c.alpha) * (prev + self.trend)
                self.trend = c.beta * (self.level - prev) + (1 - c.beta) * self.trend
            if len(self.first) == m and m > 1:
                mean = sum(self.first) / m
                self.seasonal = [v - mean for v in self.first]
                self.level = mean
                self.trend = 0.0
                self.first = []
            self.n += 1
            return
        j = self.n % m
        s_old = self.seasonal[j]
        prev_l, prev_b = self.level, self.trend
        self.level = c.alpha * (y - s_old) + (1 - c.alpha) * (prev_l + prev_b)
        self.trend = c.beta * (self.level - prev_l) + (1 - c.beta) * prev_b
        self.seasonal[j] = c.gamma * (y - prev_l - prev_b) + (1 - c.gamma) * s_old
        self.n += 1

    def forecast(self, h: int) -> float:
        """The rate ``h`` >= 1 buckets after the last update (0 before any update), at least 0."""
        if self.level is None:
            return 0.0
        h = max(1, int(h))
        s = self.seasonal[(self.n - 1 + h) % self.cfg.season] if self.seasonal else 0.0
        return max(0.0, self.level + h * self.trend + s)


@dataclass
class _Key:
    model: HoltWinters
    bucket_start: float
    acc: float = 0.0  # rate x seconds observed in the open bucket
    seen: float = 0.0  # seconds observed in the open bucket
    last_t: float | None = None
    last_y: float = 0.0
    pending: dict = field(default_factory=dict)  # bucket index -> forecast made lead_s before it
    errors: list = field(default_factory=list)  # (actual, forecast) of closed buckets


class ArrivalForecaster:
    """Per-key online Holt-Winters on observed arrival rates (module docstring)."""

    def __init__(self, cfg: ForecastConfig | None = None) -> None:
        self.cfg = cfg or ForecastConfig()
        self._keys: dict[str, _Key] = {}

    def observe(self, key: str, now: float, rate: float) -> None:
        """The arrival rate (output tokens/s, >= 0) seen at ``now`` (s, non-decreasing per key): it holds from
        the previous call to this one; buckets that end on the way are closed and fitted."""
        if not is_number(rate, minimum=0):
            raise ValueError(f"ArrivalForecaster.observe takes a finite rate >= 0, got {rate!r} for {key!r}")
        b = self.cfg.bucket_s
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = _Key(HoltWinters(self.cfg), math.floor(now / b) * b, last_t=now, last_y=rate)
            return
        t = k.last_t
        while now >= k.bucket_start + b:
            end = k.bucket_start + b
            k.acc += rate * max(0.0, end - t)
            k.seen += max(0.0, end - t)
            t = end
            self._close(k)
        k.acc += rate * max(0.0, now - t)
        k.seen += max(0.0, now - t)
        k.last_t, k.last_y = now, rate

    def _close(self, k: _Key) -> None:
        y = k.acc / k.seen if k.seen > 0 else k.last_y
        idx = int(round(k.bucket_start / self.cfg.bucket_s))
        made = k.pending.pop(idx, None)
        if made is not None:
            k.errors.append((y, made))
        k.model.update(y)
        k.bucket_start += self.cfg.bucket_s
        k.acc = k.seen = 0.0
        ahead = max(1, math.ceil(self.cfg.lead_s / self.cfg.bucket_s))
        k.pending[idx + 1 + ahead] = k.model.forecast(1 + ahead)  # the bucket that ends lead_s past the next
        for old in [i for i in k.pending if i < idx]:
            del k.pending[old]

    def forecast(self, key: str, now: float, horizon_s: float | None = None) -> float:
        """The forecast rate ``horizon_s`` (default ``lead_s``) after ``now`` (0 for an unknown key)."""
        k = self._keys.get(key)
        if k is None:
            return 0.0
        h = self.cfg.lead_s if horizon_s is None else horizon_s
        ahead = max(1, math.ceil((now + h - k.bucket_start) / self.cfg.bucket_s))
        return k.model.forecast(ahead)

    def planned(self, key: str, now: float, observed: float) -> float:
        """What to plan for: ``max(observed, forecast at lead_s)`` when enabled and ``observed`` > 0, else
        ``observed`` (module docstring). Call :meth:`observe` first."""
        if not self.cfg.enabled or observed <= 0:
            return observed
        return max(observed, self.forecast(key, now))

    def errors(self, key: str, last: int | None = None) -> dict[str, float | int]:
        """``{"buckets", "mape", "smape"}`` of the forecasts made ``lead_s`` ahead, over the closed buckets (the
        ``last`` ones when given) (MAPE over buckets with a non-zero actual; sMAPE = mean of 2|f - a| / (|a| +
        |f|), 0 where both are 0); NaN before any."""
        k = self._keys.get(key)
        pairs = (k.errors if k else [])[-last:] if last else (k.errors if k else [])
        nz = [(a, f) for a, f in pairs if a > 0]
        mape = sum(abs(f - a) / a for a, f in nz) / len(nz) if nz else math.nan
        sm = [2 * abs(f - a) / (abs(a) + abs(f)) if (a or f) else 0.0 for a, f in pairs]
        return {"buckets": len(pairs), "mape": mape, "smape": sum(sm) / len(sm) if sm else math.nan}

    def keys(self) -> list[str]:
        """The keys seen."""
        return list(self._keys)


def backlog_rate(queue_tokens: float, arrivals: float, capacity: float, lead_s: float, drain_s: float) -> float:
    """Tokens/s to plan on top of the arrivals so that the backlog new replicas will find drains within
    ``drain_s`` of their start of service: the queue now plus what piles up until they serve (arrivals above the
    fleet's current SLO capacity, for ``lead_s``), over ``drain_s``. 0 without a queue or an overload.
    ValueError for a negative figure or ``drain_s`` <= 0. (Little's law on the fluid queue: a backlog B drains
    in B / excess capacity; this sizes the excess.)"""
    for n, v in (("queue_tokens", queue_tokens), ("arrivals", arrivals), ("capacity", capacity), ("lead_s", lead_s)):
        if not is_number(v, minimum=0):
            raise ValueError(f"backlog_rate: {n} must be a finite number >= 0, got {v!r}")
    if not is_number(drain_s, minimum=0) or drain_s <= 0:
        raise ValueError(f"backlog_rate: drain_s must be > 0, got {drain_s!r}")
    return (queue_tokens + max(0.0, arrivals - capacity) * lead_s) / drain_s


def forecast_signals(forecaster: ArrivalForecaster, now: float, signals: Mapping[str, object]) -> dict[str, object]:
    """The live service's hook: each ``name/version/pool`` PoolSignals observed, and returned with
    ``arrival_tokens_per_s`` = :meth:`ArrivalForecaster.planned` (the other signals unchanged); a disabled
    forecaster returns the signals as they are (nothing observed)."""
    if not forecaster.cfg.enabled:
        return dict(signals)
    out = {}
    for key, s in signals.items():
        seen = s.arrival_tokens_per_s
        forecaster.observe(key, now, seen)
        out[key] = replace(s, arrival_tokens_per_s=forecaster.planned(key, now, seen))
    return out
