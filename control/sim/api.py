"""The simulator's contract (issue [14] item 1): the types every policy, baseline, plot and CLI of
``control/sim/`` shares (pure: no nats / etcd / torch; time is simulated seconds from the trace's start).

Units: prices in USD per replica-hour (one replica serves the model on ``gpus_per_replica`` accelerators);
latencies in ms; rates per second; tokens are generated (output) tokens unless named ``prompt_``.

Functions (in the package, re-exported by ``control.sim``):

* ``load_inputs(path=None) -> FleetInputs`` (control/sim/inputs.py): reads ``control/sim/inputs/fleet.toml``
  (every number has a ``source``);
* ``make_trace(inputs, days=7, seed=0) -> Trace`` (control/sim/trace.py);
* ``simulate(inputs, trace, policy, *, tick_s, seed) -> PolicyResult`` (control/sim/engine.py).

A pool is one accelerator type on one market; its key is ``"<type>/<market>"`` (:func:`pool_key`), market in
:data:`MARKETS`. A :class:`FleetPolicy` is called every ``FleetInputs.decide_every_s`` with a
:class:`FleetView` (what a live autoscaler could observe: no future trace) and returns the desired replicas
(ready + starting; leaving ones excluded) per pool key; a key left out keeps its count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from control.policy.curves import ThroughputCurve
from actors.autoscaler.signals import Slo
from control.policy.numbers import is_number

MARKETS = ("on_demand", "spot")

__all__ = ["MARKETS", "AccelType", "SpotModel", "CpuTier", "TraceSpec", "FleetInputs", "PoolView", "FleetView",
           "FleetPolicy", "Trace", "PolicyResult", "Slo", "ThroughputCurve", "pool_key", "split_pool_key"]


def pool_key(type_name: str, market: str) -> str:
    """``"<type>/<market>"``; ValueError for an unknown market."""
    if market not in MARKETS:
        raise ValueError(f"market must be one of {', '.join(MARKETS)}, got {market!r}")
    return f"{type_name}/{market}"


def split_pool_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`pool_key`: ``(type, market)``."""
    type_name, _, market = key.rpartition("/")
    if not type_name or market not in MARKETS:
        raise ValueError(f"pool key must be '<type>/<market>', got {key!r}")
    return type_name, market


def _num(owner: str, name: str, v: Any, minimum: float = 0.0, strict: bool = False) -> None:
    bad = not is_number(v)
    if bad or v < minimum or (strict and v <= minimum):
        raise ValueError(f"{owner}.{name} must be a finite number {'>' if strict else '>='} {minimum:g}, got {v!r}")


@dataclass(frozen=True)
class AccelType:
    """One accelerator type: prices (USD per replica-hour, both markets), accelerators per replica, cold start
    (s, start to serving), one replica's throughput curve for the model, KV slots (most concurrent sequences
    of the trace's mean length one replica holds) and the source of each figure."""

    name: str
    on_demand_per_h: float
    spot_per_h: float
    gpus_per_replica: int
    cold_start_s: float
    curve: ThroughputCurve
    source: str
    max_batch: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"AccelType.name must be a non-empty string without '/', got {self.name!r}")
        for n in ("on_demand_per_h", "spot_per_h", "cold_start_s"):
            _num("AccelType", n, getattr(self, n), strict=n != "cold_start_s")
        if isinstance(self.gpus_per_replica, bool) or not isinstance(self.gpus_per_replica, int) \
                or self.gpus_per_replica < 1:
            raise ValueError(f"AccelType.gpus_per_replica must be an integer >= 1, got {self.gpus_per_replica!r}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"AccelType.max_batch must be an integer >= 1, got {self.max_batch!r}")
        if not isinstance(self.curve, ThroughputCurve) or not self.curve.prefill:
            raise ValueError("AccelType.curve must be a ThroughputCurve with prefill points")
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("AccelType.source must name where the figures come from")

    def price_per_h(self, market: str) -> float:
        """USD per replica-hour on ``market``."""
        pool_key(self.name, market)
        return self.spot_per_h if market == "spot" else self.on_demand_per_h


@dataclass(frozen=True)
class SpotModel:
    """Spot preemptions: independent rate per replica-hour per type, notice (s) before the replica is gone, and
    one correlated event at ``correlated_at_s`` taking ``correlated_fraction`` of every spot pool's replicas
    (notices spread evenly over ``correlated_over_s``)."""

    preemption_rate_per_h: Mapping[str, float]
    notice_s: float
    correlated_at_s: float
    correlated_fraction: float = 0.3
    correlated_over_s: float = 120.0
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "preemption_rate_per_h", dict(self.preemption_rate_per_h))
        for t, r in self.preemption_rate_per_h.items():
            _num("SpotModel", f"preemption_rate_per_h[{t}]", r)
        for n in ("notice_s", "correlated_at_s", "correlated_over_s"):
            _num("SpotModel", n, getattr(self, n))
        if not 0 <= self.correlated_fraction <= 1:
            raise ValueError(f"SpotModel.correlated_fraction must be in [0, 1], got {self.correlated_fraction!r}")
        if not self.source.strip():
            raise ValueError("SpotModel.source must name where the figures come from")


@dataclass(frozen=True)
class CpuTier:
    """The CPU tiers in front of the accelerators (validators and gateways): CPU seconds each spends per
    request (per kind), the price of one CPU-tier replica-hour (one asyncio process saturates one vCPU),
    its start time (s) and floor / ceiling per kind. ``ttft_cpu_s_per_request``: the part of each kind's
    CPU seconds that lies on the path to the first token (<= ``cpu_s_per_request``; a kind left out: all)."""

    cpu_s_per_request: Mapping[str, float]
    price_per_replica_h: float
    start_s: float
    floor: int = 1
    ceiling: int = 10_000
    source: str = ""
    ttft_cpu_s_per_request: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu_s_per_request", dict(self.cpu_s_per_request))
        object.__setattr__(self, "ttft_cpu_s_per_request", dict(self.ttft_cpu_s_per_request))
        for k, v in self.cpu_s_per_request.items():
            _num("CpuTier", f"cpu_s_per_request[{k}]", v, strict=True)
        for k, v in self.ttft_cpu_s_per_request.items():
            _num("CpuTier", f"ttft_cpu_s_per_request[{k}]", v)
            if k not in self.cpu_s_per_request or v > self.cpu_s_per_request[k]:
                raise ValueError(f"CpuTier.ttft_cpu_s_per_request[{k}] must be a kind of cpu_s_per_request and "
                                 f"at most its CPU per request, got {v!r}")
        _num("CpuTier", "price_per_replica_h", self.price_per_replica_h)
        _num("CpuTier", "start_s", self.start_s)
        if not (isinstance(self.floor, int) and isinstance(self.ceiling, int) and 1 <= self.floor <= self.ceiling):
            raise ValueError(f"CpuTier.floor/ceiling must be integers with 1 <= floor <= ceiling, got "
                             f"{self.floor!r} / {self.ceiling!r}")
        if not self.source.strip():
            raise ValueError("CpuTier.source must name where the figures come from")

    def ttft_cpu_s(self, kind: str) -> float:
        """CPU seconds of ``kind`` on the path to the first token (all of its CPU when not given)."""
        return self.ttft_cpu_s_per_request.get(kind, self.cpu_s_per_request[kind])


@dataclass(frozen=True)
class TraceSpec:
    """The synthetic trace's shape (control/sim/trace.py): mean rate at the diurnal trough / peak (req/s),
    peak hour (UTC), weekend factor, bursts (per day, multiplier, duration s), prompt / output lengths
    (lognormal: median and sigma of ln; clipped to ``*_max``), the 3x step (at s, factor, duration s)."""

    base_rps: float
    peak_rps: float
    peak_hour: float
    weekend_factor: float
    bursts_per_day: float
    burst_factor: float
    burst_s: float
    prompt_median: float
    prompt_sigma: float
    prompt_max: int
    output_median: float
    output_sigma: float
    output_max: int
    step_at_s: float
    step_factor: float
    step_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for n in ("base_rps", "peak_rps", "prompt_median", "output_median", "burst_factor", "step_factor"):
            _num("TraceSpec", n, getattr(self, n), strict=True)
        for n in ("peak_hour", "weekend_factor", "bursts_per_day", "burst_s", "prompt_sigma", "output_sigma",
                  "step_at_s", "step_s"):
            _num("TraceSpec", n, getattr(self, n))
        if self.peak_rps < self.base_rps:
            raise ValueError("TraceSpec.peak_rps must be >= base_rps")
        if not self.source.strip():
            raise ValueError("TraceSpec.source must say how the trace is built")


@dataclass(frozen=True)
class FleetInputs:
    """Everything a simulation reads (one checked-in file; every policy and baseline uses the same)."""

    types: Mapping[str, AccelType]
    spot: SpotModel
    slo: Slo
    cpu_tier: CpuTier
    trace: TraceSpec
    max_accelerators: int
    max_replicas_per_pool: int = 1000
    spot_max_fraction: float = 0.7
    decide_every_s: float = 10.0
    tick_s: float = 5.0
    path: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "types", dict(self.types))
        if len(self.types) < 1:
            raise ValueError("FleetInputs.types must name at least one accelerator type")
        for k, t in self.types.items():
            if not isinstance(t, AccelType) or t.name != k:
                raise ValueError(f"FleetInputs.types[{k!r}] must be an AccelType named {k!r}")
        if isinstance(self.max_accelerators, bool) or not isinstance(self.max_accelerators, int) \
                or self.max_accelerators < 1:
            raise ValueError(f"FleetInputs.max_accelerators must be an integer >= 1, got {self.max_accelerators!r}")
        _num("FleetInputs", "decide_every_s", self.decide_every_s, strict=True)
        _num("FleetInputs", "tick_s", self.tick_s, strict=True)
        if not 0 <= self.spot_max_fraction <= 1:
            raise ValueError("FleetInputs.spot_max_fraction must be in [0, 1]")

    def pool_keys(self) -> list[str]:
        """Every pool key, types in file order, on-demand before spot."""
        return [pool_key(t, m) for t in self.types for m in MARKETS]


@dataclass(frozen=True)
class PoolView:
    """One pool as the policies see it for the last tick: replicas ready (serving, not leaving), starting
    (cold start), leaving (preemption notice: serve and migrate until their deadline); output tokens/s served;
    queued requests' output tokens; TTFT / ITL p90 (ms) of the last tick; KV use (0..1: in-flight over slots)."""

    key: str
    accel: AccelType
    market: str
    ready: int
    starting: int
    leaving: int
    served_tokens_per_s: float
    queue_tokens: float
    ttft_ms_p90: float
    itl_ms_p90: float
    kv_util: float


@dataclass(frozen=True)
class FleetView:
    """The fleet at ``now_s``: arrivals of the last tick (req/s, output tokens/s demanded), the trace's mean
    prompt / output lengths so far, the fleet's queue (output tokens) and every pool."""

    now_s: float
    arrival_rps: float
    arrival_tokens_per_s: float
    prompt_tokens_mean: float
    output_tokens_mean: float
    queue_tokens: float
    pools: Mapping[str, PoolView]
    inputs: FleetInputs


class FleetPolicy(Protocol):
    """A fleet policy (module docstring)."""

    name: str

    def decide(self, view: FleetView) -> Mapping[str, int]:
        """Desired replicas (ready + starting) per pool key; a key left out keeps its count."""
        ...


@dataclass(frozen=True)
class Trace:
    """Arrivals per tick: ``rps[i]`` (req/s over tick i, ``tick_s`` long), the length mix (prompt / output
    lognormal parameters), the step's start (s) and the correlated spot event's start (s)."""

    tick_s: float
    rps: Any  # numpy float64 array, shape (n_ticks,)
    prompt_median: float
    prompt_sigma: float
    prompt_max: int
    output_median: float
    output_sigma: float
    output_max: int
    step_at_s: float
    correlated_at_s: float
    seed: int = 0
    prompt_mean: float = 0.0
    output_mean: float = 0.0

    @property
    def n_ticks(self) -> int:
        return len(self.rps)

    @property
    def duration_s(self) -> float:
        return self.n_ticks * self.tick_s


@dataclass
class PolicyResult:
    """What one policy did over one trace (see ``to_json``)."""

    name: str
    cost_usd: float
    slo_met_output_tokens: float
    cost_per_1m_slo_tokens: float
    slo_attainment: float
    dropped_by_preemption: float
    recovery_s_after_step: float | None
    cpu_tier: dict
    per_minute: dict
    requests: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_json(self, per_minute: bool = True) -> dict[str, Any]:
        """``{"name", "cost_usd", "slo_met_output_tokens", "cost_per_1m_slo_tokens", "slo_attainment",
        "dropped_by_preemption", "recovery_s_after_step", "cpu_tier", "requests", "extra"[, "per_minute"]}``;
        per_minute: ``{"t_min", "load_rps", "attainment", "cost_usd_cum", "replicas": {pool key: [...]}}``."""
        out = {"name": self.name, "cost_usd": self.cost_usd, "slo_met_output_tokens": self.slo_met_output_tokens,
               "cost_per_1m_slo_tokens": self.cost_per_1m_slo_tokens, "slo_attainment": self.slo_attainment,
               "dropped_by_preemption": self.dropped_by_preemption,
               "recovery_s_after_step": self.recovery_s_after_step, "cpu_tier": dict(self.cpu_tier),
               "requests": dict(self.requests), "extra": dict(self.extra)}
        if per_minute:
            out["per_minute"] = self.per_minute
        return out
