"""What the autoscaler's pure policies read (pure: no I/O, no clock): per-kind CPU-tier signals, per
(model version, pool) accelerator signals, limits and SLOs, and the helpers that build them from a manifest's
``autoscale`` extra key and that set config fields from ``--policy-set FIELD=VALUE``.

Every dataclass is frozen and validated at construction (ValueError naming the field). Latencies are in ms,
rates per second, utilisations are fractions (KV) or CPU seconds per wall second (one asyncio process
saturates at 1.0). The CPU tier (``CpuKindSignals``) and the accelerator pools (``PoolSignals``) are separate
types on purpose: neither policy can read the other's signals (issue [13] item 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from control.policy.numbers import is_number

CPU_KINDS = ("validator", "gateway")


def _check_number(owner: str, name: str, value: Any, minimum: float = 0.0) -> None:
    if not is_number(value, minimum=minimum, finite=False):
        raise ValueError(f"{owner}.{name} must be a number >= {minimum:g}, got {value!r}")


def _check_count(owner: str, name: str, value: Any, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_all(obj: Any, counts: tuple[str, ...], numbers: tuple[str, ...]) -> None:
    owner = type(obj).__name__
    for name in counts:
        _check_count(owner, name, getattr(obj, name))
    for name in numbers:
        _check_number(owner, name, getattr(obj, name))


@dataclass(frozen=True)
class CpuKindSignals:
    """One CPU-tier kind, aggregated over its live replicas for one window (~1 s of ActorLoad reports).

    ``loop_lag_ms_p95`` and ``wait_ms_p90``: the worst replica's (ms); ``pending``: messages waiting in the
    kind's queue-group subscriptions, summed over replicas; ``cpu_util``: mean over replicas of process CPU
    seconds per wall second; ``handled_per_s``: messages handled per second, summed (logged, not scaled on).
    """

    kind: str
    replicas: int
    loop_lag_ms_p95: float = 0.0
    pending: float = 0.0
    wait_ms_p90: float = 0.0
    cpu_util: float = 0.0
    handled_per_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError("CpuKindSignals.kind must be a non-empty string")
        _check_all(self, ("replicas",), ("loop_lag_ms_p95", "pending", "wait_ms_p90", "cpu_util", "handled_per_s"))


@dataclass(frozen=True)
class PoolSignals:
    """One model version on one accelerator pool, for one window.

    ``replicas``: live workers (registered), leaving ones included; ``starting``: started, not yet live;
    ``leaving``: of ``replicas``, those with a preemption notice or draining (they count as gone).
    ``queue_tokens`` / ``queue_len``: the version's scheduler queue (tokens, requests); ``kv_util``: mean KV
    block use of its workers (0..1); ``ttft_ms_p90`` / ``itl_ms_p90``: 0 when the window had none;
    ``arrival_tokens_per_s`` / ``served_tokens_per_s``: generated-token demand arriving and tokens served
    (the unit of ThroughputCurve.capacity_tokens_per_s); ``cold_start_waiting``: requests held for a worker;
    ``sleeping``: sleeping workers of the pool, not counted in ``replicas`` (a scale-up wakes them first).
    """

    name: str
    version: str
    pool: str
    replicas: int
    starting: int = 0
    leaving: int = 0
    queue_tokens: float = 0.0
    queue_len: int = 0
    kv_util: float = 0.0
    ttft_ms_p90: float = 0.0
    itl_ms_p90: float = 0.0
    arrival_tokens_per_s: float = 0.0
    served_tokens_per_s: float = 0.0
    cold_start_waiting: int = 0
    sleeping: int = 0  # sleeping workers of the version pool (not in replicas): woken in ~1 s (decision 0042)

    def __post_init__(self) -> None:
        for name in ("name", "version", "pool"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"PoolSignals.{name} must be a non-empty string")
        _check_all(self, ("replicas", "starting", "leaving", "queue_len", "cold_start_waiting", "sleeping"),
                   ("queue_tokens", "kv_util", "ttft_ms_p90", "itl_ms_p90", "arrival_tokens_per_s",
                    "served_tokens_per_s"))
        if self.leaving > self.replicas:
            raise ValueError(f"PoolSignals.leaving ({self.leaving}) must be <= replicas ({self.replicas})")

    @property
    def key(self) -> str:
        """``name/version/pool``: the key of this pool in every mapping PoolPolicy.decide takes."""
        return pool_signal_key(self.name, self.version, self.pool)

    @property
    def target(self) -> str:
        """``worker/<name>/<version>/<pool>``: Decision.target of this pool."""
        return worker_target(self.name, self.version, self.pool)

    @property
    def active(self) -> int:
        """Live workers that are not leaving."""
        return self.replicas - self.leaving

    def idle(self) -> bool:
        """No demand at all: nothing arriving, queued, held for a cold start or being served."""
        return (self.arrival_tokens_per_s <= 0 and self.queue_len == 0 and self.queue_tokens <= 0
                and self.cold_start_waiting == 0 and self.served_tokens_per_s <= 0)


@dataclass(frozen=True)
class Limits:
    """Floor and ceiling of one target's replica count; ``scale_to_zero``: may go to 0 when idle (pools only;
    the floor then applies while the version is in use)."""

    floor: int
    ceiling: int
    scale_to_zero: bool = False

    def __post_init__(self) -> None:
        _check_count("Limits", "floor", self.floor)
        _check_count("Limits", "ceiling", self.ceiling, max(1, self.floor))
        if not isinstance(self.scale_to_zero, bool):
            raise ValueError("Limits.scale_to_zero must be a boolean")


@dataclass(frozen=True)
class Slo:
    """A version's latency objectives (ms, at p90): time to first token and inter-token latency."""

    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        _check_number("Slo", "ttft_ms", self.ttft_ms, 1e-9)
        _check_number("Slo", "itl_ms", self.itl_ms, 1e-9)


def pool_signal_key(name: str, version: str, pool: str) -> str:
    """``name/version/pool``."""
    return f"{name}/{version}/{pool}"


def worker_target(name: str, version: str, pool: str) -> str:
    """``worker/<name>/<version>/<pool>`` (Decision.target of an accelerator pool)."""
    return f"worker/{name}/{version}/{pool}"


#: the keys a manifest's ``autoscale`` may hold, and their types
AUTOSCALE_KEYS = {"min_workers": int, "max_workers": int, "scale_to_zero": bool, "ttft_slo_ms": float,
                  "itl_slo_ms": float}


def check_autoscale(autoscale: Any) -> None:
    """ValueError naming the field when a manifest's ``autoscale`` is not what :func:`limits_from_autoscale` and
    :func:`slo_from_autoscale` read exactly: an object of :data:`AUTOSCALE_KEYS` only (a misspelt key would be
    ignored in silence), integers that are integers (not ``"2"`` or ``1.5``), a boolean ``scale_to_zero``, numbers
    for the SLOs, ``min_workers <= max_workers``. ``actorserve models register --option autoscale=...`` checks it."""
    if not isinstance(autoscale, Mapping):
        raise ValueError(f"autoscale must be an object of {sorted(AUTOSCALE_KEYS)}, got {autoscale!r}")
    for key, value in autoscale.items():
        kind = AUTOSCALE_KEYS.get(key)
        if kind is None:
            raise ValueError(f"autoscale.{key}: unknown key (known: {', '.join(sorted(AUTOSCALE_KEYS))})")
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"autoscale.{key} must be true or false, got {value!r}")
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"autoscale.{key} must be an integer >= 0, got {value!r}")
        if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"autoscale.{key} must be a number of milliseconds > 0, got {value!r}")
    lo, hi = autoscale.get("min_workers"), autoscale.get("max_workers")
    if hi is not None and (hi < 1 or (lo is not None and lo > hi)):
        raise ValueError(f"autoscale.max_workers must be >= 1 and >= min_workers ({'unset' if lo is None else lo}), got {hi}")


def limits_from_autoscale(autoscale: Mapping[str, Any] | None, default: Limits) -> Limits:
    """Limits of a version from its manifest's ``autoscale`` extra key (``min_workers``, ``max_workers``,
    ``scale_to_zero``); absent fields take ``default``'s. ValueError naming the field when invalid."""
    a = dict(autoscale or {})
    try:
        return Limits(int(a.get("min_workers", default.floor)), int(a.get("max_workers", default.ceiling)),
                      bool(a.get("scale_to_zero", default.scale_to_zero)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"autoscale: {e}") from None


def slo_from_autoscale(autoscale: Mapping[str, Any] | None, default: Slo) -> Slo:
    """Slo of a version from its manifest's ``autoscale`` (``ttft_slo_ms``, ``itl_slo_ms``); absent fields
    take ``default``'s. ValueError naming the field when invalid."""
    a = dict(autoscale or {})
    try:
        return Slo(float(a.get("ttft_slo_ms", default.ttft_ms)), float(a.get("itl_slo_ms", default.itl_ms)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"autoscale: {e}") from None


def _parse_field(cls_name: str, f: dataclasses.Field, text: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind == "bool":
            if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return text.lower() in ("1", "true", "yes", "on")
        return int(text) if kind == "int" else float(text)
    except ValueError:
        raise ValueError(f"{cls_name}.{f.name}: {text!r} is not a {kind}") from None


def set_fields(cfg: Any, assignments: Mapping[str, str]) -> Any:
    """A copy of config dataclass ``cfg`` with fields set from strings (``--policy-set cpu.FIELD=VALUE``
    gives ``{"FIELD": "VALUE"}``), converted to the field's type (float, int, bool) and validated by the
    class's ``__post_init__``. ValueError naming the field for an unknown field or a bad value."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    values = {}
    for name, text in assignments.items():
        if name not in fields:
            raise ValueError(f"{type(cfg).__name__} has no field {name!r} (fields: {', '.join(sorted(fields))})")
        values[name] = _parse_field(type(cfg).__name__, fields[name], str(text))
    return dataclasses.replace(cfg, **values)
