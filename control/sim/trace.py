"""The synthetic 7-day trace (pure, numpy, seeded): arrivals per tick with a diurnal cycle, weekends, random
bursts, a 3x step and Poisson noise; prompt / output lengths are the TraceSpec's clipped lognormals.

Rate (req/s) at time t (s from Monday 00:00 UTC): ``base + (peak - base) x (1 + cos(2 pi (h - peak_hour) /
24)) / 2`` (h = hour of day), x ``weekend_factor`` on days 5 and 6, x ``burst_factor`` inside each burst
(``bursts_per_day`` a day, Poisson count, uniform start, ``burst_s`` long), x ``step_factor`` over
``[step_at_s, step_at_s + step_s)``. Arrivals in a tick are Poisson(rate x tick_s); ``Trace.rps`` holds
arrivals / tick_s. No download: the shape is the Azure LLM inference trace's (diurnal, bursty; lengths from
its published medians, see fleet.toml), generated locally.
"""

from __future__ import annotations

import numpy as np

from control.sim.api import FleetInputs, Trace
from control.sim.latency import lognormal_clipped_mean

DAY_S = 86_400.0


def rate_curve(inputs: FleetInputs, t: np.ndarray, rng: np.random.Generator, days: float) -> np.ndarray:
    """Mean arrival rate (req/s) at times ``t`` (module docstring), bursts drawn from ``rng``."""
    s = inputs.trace
    hour = (t % DAY_S) / 3600.0
    rate = s.base_rps + (s.peak_rps - s.base_rps) * (1 + np.cos(2 * np.pi * (hour - s.peak_hour) / 24.0)) / 2
    day = (t // DAY_S).astype(int)
    rate = np.where(day % 7 >= 5, rate * s.weekend_factor, rate)
    n_bursts = rng.poisson(s.bursts_per_day * days)
    for start in rng.uniform(0, days * DAY_S, n_bursts):
        rate = np.where((t >= start) & (t < start + s.burst_s), rate * s.burst_factor, rate)
    in_step = (t >= s.step_at_s) & (t < s.step_at_s + s.step_s)
    return np.where(in_step, rate * s.step_factor, rate)


def make_trace(inputs: FleetInputs, days: float = 7, seed: int = 0, tick_s: float | None = None) -> Trace:
    """The seeded trace of ``days`` days at ``tick_s`` (default inputs.tick_s). ValueError for days <= 0."""
    if not days > 0:
        raise ValueError(f"days must be > 0, got {days!r}")
    dt = float(tick_s or inputs.tick_s)
    n = int(round(days * DAY_S / dt))
    rng = np.random.default_rng(seed)
    t = np.arange(n) * dt
    rate = rate_curve(inputs, t, rng, days)
    rps = rng.poisson(rate * dt) / dt
    s = inputs.trace
    return Trace(dt, rps.astype(float), s.prompt_median, s.prompt_sigma, s.prompt_max, s.output_median,
                 s.output_sigma, s.output_max, s.step_at_s, inputs.spot.correlated_at_s, seed,
                 lognormal_clipped_mean(s.prompt_median, s.prompt_sigma, s.prompt_max),
                 lognormal_clipped_mean(s.output_median, s.output_sigma, s.output_max))
