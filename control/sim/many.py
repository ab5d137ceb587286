"""Many models on shared hosts (issue [29] item 1): a compact fluid simulation of ``count`` models of Zipf
popularity, each with its own diurnal phase and bursts (control/sim/inputs/models.toml), on one accelerator
type on demand, scaled by the live policy code — PoolPolicy per model (actors/autoscaler/pool_policy.py), its
ceiling the forecast arrivals over the SLO capacity at ``target_util`` (as the single-model adapter's mix
sets it), the arrival forecast (forecast.py) and the lending rule (lending.py) — with lending on or off.

Coarser than control/sim/engine.py, and the same for both variants (the comparison is the figure): per model
one queue; a ready replica serves ``c`` = the type's SLO capacity (tokens/s at the ITL SLO) / mean output
requests/s; in a tick of ``dt`` a model with r ready replicas and backlog q serves min(q + a, r c dt), and
of its a arrivals ``min(a, max(0, r c (dt + w) - q))`` are within the SLO, w = TTFT SLO - prefill of the mean
prompt (FIFO: the backlog first; an arrival waits at most w). A model's ceiling is the largest need of the last
``cooldown_down_s`` (a need read off one noisy tick would sleep and wake replicas every decision). Every host that exists is billed (serving,
starting, asleep). A scale-down puts the replica to sleep (a spare host, kept ``sleep_horizon_s``); a
scale-up takes a wake, a lend (lending on) or a cold start (lending.plan_starts); a start cancelled before it
serves releases its host. Not modelled here: spot, several types, prompt bins, CPU tiers, preemption.
"""

from __future__ import annotations

import math
import time
from collections import deque
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from actors.autoscaler.forecast import ArrivalForecaster, ForecastConfig
from actors.autoscaler.lending import LendingConfig, SpareHost, expire, plan_starts
from actors.autoscaler.pool_policy import PoolConfig, PoolPolicy
from actors.autoscaler.signals import Limits, PoolSignals
from control.sim.api import FleetInputs
from control.sim.inputs import check_sources
from control.sim.latency import CurveTable, lognormal_clipped_mean
from control.sim.trace import DAY_S

MODELS_INPUTS = Path(__file__).resolve().parent / "inputs" / "models.toml"


@dataclass(frozen=True)
class ManyInputs:
    """models.toml, read: the models' popularity and phases, bursts, and the host's wake / lend / cold times."""

    count: int
    zipf_exponent: float
    total_peak_rps: float
    trough_over_peak: float
    peak_hour_first: float
    peak_hour_last: float
    phase_order: int
    weekend_factor: float
    bursts_per_day: float
    burst_factor: float
    burst_s: float
    host_type: str
    lending: LendingConfig

    def shares(self) -> np.ndarray:
        """Each model's share of the traffic: rank r (1-based) ~ 1 / r^s, normalised."""
        w = 1.0 / np.arange(1, self.count + 1) ** self.zipf_exponent
        return w / w.sum()

    def peak_hours(self) -> np.ndarray:
        """Model rank r's peak hour (UTC): first + ((r x order) mod count) / (count - 1) x (last - first)."""
        r = np.arange(1, self.count + 1)
        pos = (r * self.phase_order) % self.count / max(1, self.count - 1)
        return self.peak_hour_first + pos * (self.peak_hour_last - self.peak_hour_first)


def load_many_inputs(path: str | Path | None = None) -> ManyInputs:
    """Read models.toml (ValueError naming a number without a source, a missing key or a bad value)."""
    p = Path(path) if path else MODELS_INPUTS
    data = tomllib.loads(p.read_text())
    missing = check_sources(data, "models")
    if missing:
        raise ValueError(f"numbers without a <name>_source line: {', '.join(missing)}")
    try:
        m, h = data["models"], data["host"]
        lend = LendingConfig(float(h["wake_s"]), float(h["load_other_s"]), float(h["cold_start_s"]),
                             float(h["sleep_horizon_s"]))
        out = ManyInputs(int(m["count"]), float(m["zipf_exponent"]), float(m["total_peak_rps"]),
                         float(m["trough_over_peak"]), float(m["peak_hour_first"]), float(m["peak_hour_last"]),
                         int(m["phase_order"]), float(m["weekend_factor"]), float(m["bursts_per_day"]),
                         float(m["burst_factor"]), float(m["burst_s"]), str(h["type"]), lend)
    except KeyError as e:
        raise ValueError(f"{p}: missing key {e}") from None
    if out.count < 1 or not 0 < out.trough_over_peak <= 1:
        raise ValueError(f"{p}: count must be >= 1 and trough_over_peak in (0, 1]")
    return out


def make_many_trace(mi: ManyInputs, days: float, seed: int, tick_s: float) -> np.ndarray:
    """Arrivals (req/s) per model and tick, shape (count, ticks): each model's diurnal cosine between
    trough_over_peak and 1 of its peak (total_peak_rps x its share) around its own peak hour, x weekend_factor
    on days 5-6, x burst_factor in its own bursts (Poisson count a day, uniform start), Poisson per tick."""
    rng = np.random.default_rng(seed)
    n = int(round(days * DAY_S / tick_s))
    t = np.arange(n) * tick_s
    hour = (t % DAY_S) / 3600.0
    weekend = np.where((t // DAY_S).astype(int) % 7 >= 5, mi.weekend_factor, 1.0)
    out = np.zeros((mi.count, n))
    for i, (share, ph) in enumerate(zip(mi.shares(), mi.peak_hours())):
        shape = mi.trough_over_peak + (1 - mi.trough_over_peak) * (1 + np.cos(2 * np.pi * (hour - ph) / 24)) / 2
        rate = mi.total_peak_rps * share * shape * weekend
        for start in rng.uniform(0, days * DAY_S, rng.poisson(mi.bursts_per_day * days)):
            rate = np.where((t >= start) & (t < start + mi.burst_s), rate * mi.burst_factor, rate)
        out[i] = rng.poisson(rate * tick_s) / tick_s
    return out


def simulate_many(inputs: FleetInputs, mi: ManyInputs, rps: np.ndarray, *, lend: bool,
                  pool_cfg: PoolConfig | None = None, forecast: ForecastConfig | None = None) -> dict[str, Any]:
    """Run the many-model fleet (module docstring) over ``rps`` (count x ticks at ``inputs.tick_s``); returns
    ``{"lend", "cost_usd", "slo_attainment", "min_model_attainment", "host_hours": {serving, starting,
    asleep}, "starts": {wake, lend, cold}, "forecast": {model: errors}, "peak_hosts", "cpu_s"}``."""
    c0 = time.process_time()
    cfg = pool_cfg or PoolConfig()
    lcfg = LendingConfig(**{**mi.lending.__dict__, "lend": lend})
    acc = inputs.types[mi.host_type]
    tab = CurveTable(acc.curve)
    slo = inputs.slo
    out_mean = lognormal_clipped_mean(inputs.trace.output_median, inputs.trace.output_sigma, inputs.trace.output_max)
    prompt_mean = lognormal_clipped_mean(inputs.trace.prompt_median, inputs.trace.prompt_sigma,
                                         inputs.trace.prompt_max)
    cap_tok = acc.curve.capacity_tokens_per_s(slo.itl_ms)
    b_slo = acc.curve.max_batch_at(slo.itl_ms)
    c = cap_tok / out_mean
    w = max(0.0, (slo.ttft_ms - float(tab.ttft_ms(np.array([prompt_mean]))[0])) / 1e3)
    price, dt = acc.on_demand_per_h, inputs.tick_s
    n_m, n_t = rps.shape
    names = [f"m{i + 1:02d}" for i in range(n_m)]
    keys = {m: f"{m}/1/{mi.host_type}" for m in names}
    policy, fc = PoolPolicy(cfg), ArrivalForecaster(forecast or ForecastConfig())
    ready = np.zeros(n_m, dtype=np.int64)
    starting: list[tuple[float, int, int]] = []  # (ready_at, model index, host)
    spares: list[SpareHost] = []
    q = np.zeros(n_m)
    host_seq = 0
    every = max(1, int(round(inputs.decide_every_s / dt)))
    arrived, met = np.zeros(n_m), np.zeros(n_m)
    hours = {"serving": 0.0, "starting": 0.0, "asleep": 0.0}
    starts = {"wake": 0, "lend": 0, "cold": 0}
    peak = 0
    recent = [deque() for _ in range(n_m)]
    for i in range(n_t):
        now = i * dt
        if i == 0:  # warm start: each model's need for its first arrivals is serving at t = 0
            ready[:] = np.maximum(1, np.ceil(rps[:, 0] * out_mean / (cap_tok * cfg.target_util))).astype(np.int64)
            host_seq = int(ready.sum())
        if starting:
            done = [s for s in starting if s[0] <= now]
            for _, m, _ in done:
                ready[m] += 1
            starting = [s for s in starting if s[0] > now]
        a = rps[:, i] * dt
        capacity = ready * c * dt
        met_now = np.minimum(a, np.maximum(0.0, ready * c * (dt + w) - q))
        served = np.minimum(q + a, capacity)
        q = q + a - served
        arrived += a
        met += met_now
        n_start = len(starting)
        hours["serving"] += float(ready.sum()) * dt / 3600
        hours["starting"] += n_start * dt / 3600
        hours["asleep"] += len(spares) * dt / 3600
        peak = max(peak, int(ready.sum()) + n_start + len(spares))
        if i % every or i == 0:
            continue
        st_count = np.zeros(n_m, dtype=np.int64)
        for _, m, _ in starting:
            st_count[m] += 1
        own_sleep = {m: 0 for m in range(n_m)}
        for s in spares:
            own_sleep[names.index(s.model)] += 1
        signals, limits, planned_need = {}, {}, {}
        for m, name in enumerate(names):
            seen = float(rps[m, i] * out_mean)
            fc.observe(keys[name], now, seen)
            plan = fc.planned(keys[name], now, seen)
            need = max(1, math.ceil(plan / (cap_tok * cfg.target_util) - 1e-9))
            planned_need[name] = need
            hist = recent[m]
            hist.append((now, need))
            while hist[0][0] < now - cfg.cooldown_down_s:
                hist.popleft()
            need = max(n for _, n in hist)  # the ceiling falls only after cooldown_down_s (HPA's stabilisation)
            load = served[m] / capacity[m] if capacity[m] > 0 else 1.0
            wait_ms = q[m] / (ready[m] * c) * 1e3 if ready[m] > 0 else 1e7
            s = PoolSignals(name, "1", mi.host_type, replicas=int(ready[m]), starting=int(st_count[m]),
                            queue_tokens=float(q[m] * out_mean), queue_len=int(round(q[m])),
                            kv_util=min(1.0, load * b_slo / acc.max_batch), ttft_ms_p90=min(wait_ms, 1e7),
                            itl_ms_p90=tab.itl_ms(load * b_slo), arrival_tokens_per_s=plan,
                            served_tokens_per_s=float(served[m] / dt * out_mean), sleeping=own_sleep[m])
            signals[s.key], limits[s.key] = s, Limits(1, need)
        desired = {d.target.split("/")[1]: d.desired for d in policy.decide(now, signals, limits, {}, {})}
        wants: dict[str, int] = {}
        for m, name in enumerate(names):
            if name not in desired:
                continue
            delta = desired[name] - int(ready[m] + st_count[m])
            if delta > 0:
                wants[name] = delta
            elif delta < 0:
                k = -delta
                mine = sorted((s for s in starting if s[1] == m), reverse=True)[:k]
                starting = [s for s in starting if s not in mine]
                k -= len(mine)
                k = min(k, int(ready[m]) - 1)
                for _ in range(max(0, k)):
                    ready[m] -= 1
                    host_seq += 1
                    spares.append(SpareHost(host_seq, name, now))
        spares, _ = expire(spares, now, lcfg)
        if wants:
            protected = {n for n, m in zip(names, range(n_m)) if planned_need[n] > ready[m] + st_count[m]}
            plan_list, spares = plan_starts(wants, spares, lcfg, protected)
            for st in plan_list:
                starts[st.how] += 1
                host_seq += 1
                starting.append((now + st.ready_in_s, names.index(st.model), st.host or host_seq))
    cost = sum(hours.values()) * price
    att = met / np.maximum(arrived, 1e-9)
    return {"lend": lend, "cost_usd": cost, "slo_attainment": float(met.sum() / arrived.sum()),
            "min_model_attainment": float(att.min()), "host_hours": hours, "starts": starts, "peak_hosts": peak,
            "forecast": {name: fc.errors(keys[name]) for name in names}, "models": n_m,
            "cpu_s": time.process_time() - c0}


def compare_lending(inputs: FleetInputs, mi: ManyInputs, days: float, seed: int,
                    pool_cfg: PoolConfig | None = None) -> dict[str, Any]:
    """Both variants on the same trace: ``{"lend": ..., "no_lend": ..., "cost_saving": 1 - lend / no_lend}``."""
    rps = make_many_trace(mi, days, seed, inputs.tick_s)
    on = simulate_many(inputs, mi, rps, lend=True, pool_cfg=pool_cfg)
    off = simulate_many(inputs, mi, rps, lend=False, pool_cfg=pool_cfg)
    return {"lend": on, "no_lend": off, "cost_saving": 1 - on["cost_usd"] / off["cost_usd"],
            "days": days, "seed": seed}


def summary(result: Mapping[str, Any]) -> str:
    """One line per variant for the CLI."""
    rows = []
    for k in ("lend", "no_lend"):
        r = result[k]
        sm = np.nanmean([e["smape"] for e in r["forecast"].values()])
        rows.append(f"{k:<8} cost ${r['cost_usd']:.0f}  attainment {r['slo_attainment']:.4f} (worst model "
                    f"{r['min_model_attainment']:.4f})  starts {r['starts']}  host-h "
                    f"{ {h: round(v) for h, v in r['host_hours'].items()} }  forecast sMAPE {sm:.3f}")
    rows.append(f"lending saves {100 * result['cost_saving']:.1f} % of the cost")
    return "\n".join(rows)
