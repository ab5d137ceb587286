"""Accelerator pool records and throughput-curve storage in etcd.

A pool record lives at ``pool_key(pool)`` (``/actorserve/pools/{pool}``)::

    {"accelerator": "cpu", "memory_bytes": int, "price_on_demand_per_h": float, "price_spot_per_h": float,
     "market": "on_demand" | "spot", "preemption_rate_per_h": float, "max_workers": int}

written by ``actorserve pools set`` (control/ops/pools_cli.py); the pool under ``actorserve up`` is ``local``.
A version's measured curve on a pool lives at ``profile_key(name, version, pool)`` (``actorserve profile``,
control/policy/curves.py). ``PoolRecord`` is pure; the async helpers take any object with the Registry's
``get_json`` / ``put_json`` / ``get_prefix_json`` / ``delete`` (control/state/registry.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from control.policy.curves import ThroughputCurve
from control.state import names
from control.policy.numbers import is_number

MARKETS = ("on_demand", "spot")
LOCAL_POOL = "local"
_FLOATS = ("price_on_demand_per_h", "price_spot_per_h", "preemption_rate_per_h")
_INTS = ("memory_bytes", "max_workers")


@dataclass(frozen=True)
class PoolRecord:
    """One pool: accelerator type, memory per worker (bytes), prices per worker-hour (on demand, spot), the
    market its workers are bought on, the spot preemption rate (per worker-hour) and the most workers.
    ValueError naming the field when invalid."""

    name: str
    accelerator: str = "cpu"
    memory_bytes: int = 0
    price_on_demand_per_h: float = 0.0
    price_spot_per_h: float = 0.0
    market: str = "on_demand"
    preemption_rate_per_h: float = 0.0
    max_workers: int = 1

    def __post_init__(self) -> None:
        names.validate_name("pool name", self.name)
        if not isinstance(self.accelerator, str) or not self.accelerator.strip():
            raise ValueError("accelerator must be a non-empty string (e.g. cpu, h100)")
        for f in _INTS:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f} must be an integer >= 0, got {v!r}")
        for f in _FLOATS:
            v = getattr(self, f)
            if not is_number(v, minimum=0):
                raise ValueError(f"{f} must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.market not in MARKETS:
            raise ValueError(f"market must be one of {', '.join(MARKETS)}, got {self.market!r}")

    @property
    def price_per_h(self) -> float:
        """Price of one worker-hour on this pool's market."""
        return self.price_spot_per_h if self.market == "spot" else self.price_on_demand_per_h

    def to_json(self) -> dict[str, Any]:
        """The stored value (the name is the key)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}

    @classmethod
    def from_json(cls, name: str, data: Mapping[str, Any]) -> "PoolRecord":
        """Record ``name`` from its stored value (unknown keys ignored, missing ones take defaults)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"pool {name!r}: record must be an object")
        known = {f.name for f in dataclasses.fields(cls)} - {"name"}
        return cls(name, **{k: v for k, v in data.items() if k in known})

    def with_changes(self, changes: Mapping[str, Any]) -> "PoolRecord":
        """A copy with ``changes`` (field -> value; None values ignored), validated."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


async def get_pool(reg: Any, name: str) -> PoolRecord | None:
    """The pool record ``name`` or None."""
    raw = await reg.get_json(names.pool_key(name))
    return None if raw is None else PoolRecord.from_json(name, raw)


async def put_pool(reg: Any, record: PoolRecord) -> int:
    """Store ``record``; the etcd revision."""
    return await reg.put_json(names.pool_key(record.name), record.to_json())


async def list_pools(reg: Any) -> dict[str, PoolRecord]:
    """Every pool record by name (a malformed record raises ValueError naming its pool)."""
    prefix = names.pools_prefix()
    raw = await reg.get_prefix_json(prefix)
    return {k[len(prefix):]: PoolRecord.from_json(k[len(prefix):], v) for k, v in sorted(raw.items())}


async def get_curve(reg: Any, name: str, version: str, pool: str) -> ThroughputCurve | None:
    """The measured curve of ``name@version`` on ``pool``, or None."""
    raw = await reg.get_json(names.profile_key(name, version, pool))
    return None if raw is None else ThroughputCurve.from_json(raw)


async def put_curve(reg: Any, name: str, version: str, curve: ThroughputCurve) -> int:
    """Store ``curve`` at ``profile_key(name, version, curve.pool)``; the etcd revision."""
    return await reg.put_json(names.profile_key(name, version, curve.pool), curve.to_json())
