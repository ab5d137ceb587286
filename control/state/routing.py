"""A model's routing table and the pure rules that edit it and route by it (no I/O).

Stored as JSON at ``/actorserve/models/{name}/routing`` (docs/architecture.md). Record fields:

* ``stable``: version that takes the traffic the canary does not; None: the highest active version.
* ``canary``: version under rollout, or None.
* ``weight``: share of traffic for the canary, in percent, 0..100 (float; 0.01 resolution).
* ``sticky``: ``"request"`` (each request hashed on its own key: an even split) or ``"tenant"`` (one
  tenant always lands on the same side while the weight does not move past its bucket).
* ``state``: ``"idle"`` (no rollout), ``"canary"`` (rollout running), ``"promoted"``, ``"rolled_back"``.
* ``steps``: canary weights the rollout controller walks through when the canary is healthy
  (percent, ascending, last one 100 = promote), e.g. ``[5, 25, 50, 100]``.
* ``last_good``: the stable version before the rollout started (a rollback returns traffic to ``stable``,
  which is unchanged during a rollout; ``last_good`` is kept for ``promote`` followed by ``rollback``).
* ``analysis``: rollout controller thresholds (see actors/rollout/policy.py); {} means defaults.
* ``decisions``: newest last, at most MAX_DECISIONS: ``{"ts", "action", "by", "weight", "reasons"}``.
* ``started_at`` / ``updated_at``: unix seconds.

Routing split: a request key (tenant id or request id) is hashed with BLAKE2b together with the model
name into a bucket 0..9999; buckets below ``weight * 100`` go to the canary. The split therefore does not
depend on the order versions were registered in, and a tenant keeps its side while the weight grows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from control.policy.numbers import is_number

STICKY_MODES = ("request", "tenant")
STATES = ("idle", "canary", "promoted", "rolled_back")
DEFAULT_STEPS = (5.0, 25.0, 50.0, 100.0)
MAX_DECISIONS = 50
NUM_BUCKETS = 10_000


def bucket(name: str, key: str) -> int:
    """Stable hash bucket 0..NUM_BUCKETS-1 of ``key`` for model ``name`` (BLAKE2b, 8 bytes)."""
    h = hashlib.blake2b(f"{name}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % NUM_BUCKETS


def _check_weight(w: Any, fname: str = "weight") -> float:
    if not is_number(w) or not 0 <= w <= 100:
        raise ValueError(f"{fname} must be a number from 0 to 100 (percent), got {w!r}")
    return float(w)


def _check_steps(steps: Any) -> tuple[float, ...]:
    if not isinstance(steps, (list, tuple)) or not steps:
        raise ValueError("steps must be a non-empty list of percentages")
    out = tuple(_check_weight(s, "steps[]") for s in steps)
    if any(b <= a for a, b in zip(out, out[1:])) or out[-1] != 100.0:
        raise ValueError(f"steps must be strictly ascending and end at 100, got {list(steps)}")
    return out


@dataclass(frozen=True)
class RoutingTable:
    """One model's routing record (see module docstring). Validated on construction: ValueError names
    the field."""

    stable: str | None = None
    canary: str | None = None
    weight: float = 0.0
    sticky: str = "request"
    state: str = "idle"
    steps: tuple[float, ...] = DEFAULT_STEPS
    last_good: str | None = None
    analysis: dict[str, Any] = field(default_factory=dict)
    decisions: tuple[dict[str, Any], ...] = ()
    started_at: float | None = None
    updated_at: float | None = None

    def __post_init__(self) -> None:
        from control.state.names import validate_name
        for fname in ("stable", "canary", "last_good"):
            v = getattr(self, fname)
            if v is not None:
                validate_name(fname, v)
        object.__setattr__(self, "weight", _check_weight(self.weight))
        if self.sticky not in STICKY_MODES:
            raise ValueError(f"sticky must be one of {', '.join(STICKY_MODES)}, got {self.sticky!r}")
        if self.state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, got {self.state!r}")
        object.__setattr__(self, "steps", _check_steps(self.steps))
        if not isinstance(self.analysis, Mapping):
            raise ValueError("analysis must be an object")
        if self.canary is not None and self.canary == self.stable:
            raise ValueError("canary must differ from stable")
        object.__setattr__(self, "decisions", tuple(dict(d) for d in self.decisions)[-MAX_DECISIONS:])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "RoutingTable":
        """From the stored JSON (None or {} -> an empty table). Unknown keys are ignored."""
        if not data:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError("routing must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in data.items() if k in known}
        for k in ("steps", "decisions"):
            if k in kw and isinstance(kw[k], list):
                kw[k] = tuple(kw[k])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["steps"], d["decisions"] = list(self.steps), [dict(x) for x in self.decisions]
        return d

    @property
    def rollout_active(self) -> bool:
        """A canary takes (or may take) traffic."""
        return self.state == "canary" and self.canary is not None

    def with_decision(self, action: str, by: str, reasons: list[str] | tuple[str, ...] = (),
                      now: float | None = None, **changes: Any) -> "RoutingTable":
        """Copy with ``changes`` applied and a decision ``{ts, action, by, weight, reasons}`` appended."""
        now = time.time() if now is None else now
        nxt = dataclasses.replace(self, **changes, updated_at=now)
        rec = {"ts": now, "action": action, "by": by, "weight": nxt.weight, "reasons": list(reasons),
               "stable": nxt.stable, "canary": nxt.canary}
        return dataclasses.replace(nxt, decisions=(*self.decisions, rec))


def choose_version(name: str, table: RoutingTable, active: set[str] | frozenset[str], *, tenant: str,
                   request_key: str, fallback: str | None) -> str | None:
    """The version serving one request of model ``name`` (no pin), or None when nothing is active.

    ``active``: versions with status active; ``fallback``: the version used when the table names no
    usable stable (the caller's choice, e.g. the highest active). A canary that is not active gets no
    traffic; ``request_key`` is the request's id (or another per-request key).
    """
    stable = table.stable if table.stable in active else fallback
    if table.rollout_active and table.canary in active and table.weight > 0:
        key = tenant if table.sticky == "tenant" else request_key
        if bucket(name, key) < round(table.weight * NUM_BUCKETS / 100):
            return table.canary
    return stable


# --- edits (each returns a new table; ValueError when the edit is not allowed) --------------------


def start_rollout(table: RoutingTable, *, stable: str, canary: str, weight: float, sticky: str = "request",
                  steps: tuple[float, ...] | list[float] | None = None, analysis: Mapping[str, Any] | None = None,
                  by: str = "cli", now: float | None = None) -> RoutingTable:
    """Begin sending ``weight`` percent to ``canary``; ``stable`` is the version in service now."""
    if table.rollout_active:
        raise ValueError(f"a rollout of version {table.canary} is already running; promote or roll it back first")
    if canary == stable:
        raise ValueError(f"canary {canary} is already the stable version")
    now = time.time() if now is None else now
    return table.with_decision(
        "start", by, [f"canary {canary} at {float(weight):g}% against stable {stable}"], now,
        stable=stable, canary=canary, weight=weight, sticky=sticky, state="canary", last_good=stable,
        steps=tuple(steps) if steps is not None else table.steps,
        analysis=dict(analysis) if analysis is not None else dict(table.analysis), started_at=now)


def set_weight(table: RoutingTable, weight: float, *, by: str, reasons: list[str] | tuple[str, ...] = (),
               now: float | None = None) -> RoutingTable:
    """Move a running rollout's canary weight."""
    if not table.rollout_active:
        raise ValueError("no rollout is running")
    return table.with_decision("step", by, reasons, now, weight=weight)


def promote(table: RoutingTable, *, by: str = "cli", reasons: list[str] | tuple[str, ...] = (),
            now: float | None = None) -> RoutingTable:
    """The canary becomes stable (all traffic); the previous stable is kept as ``last_good``."""
    if not table.rollout_active:
        raise ValueError("no rollout is running")
    return table.with_decision("promote", by, reasons or [f"canary {table.canary} promoted"], now,
                               last_good=table.stable, stable=table.canary, canary=None, weight=0.0,
                               state="promoted")


def rollback(table: RoutingTable, *, by: str = "cli", reasons: list[str] | tuple[str, ...] = (),
             now: float | None = None) -> RoutingTable:
    """All traffic back to the last good stable version.

    During a rollout: the canary is dropped (``stable`` is unchanged). After a promote: ``stable`` goes
    back to ``last_good``. ValueError when there is nothing to roll back.
    """
    if table.rollout_active:
        return table.with_decision("rollback", by, reasons or [f"canary {table.canary} rolled back"], now,
                                   canary=None, weight=0.0, state="rolled_back")
    if table.state == "promoted" and table.last_good and table.last_good != table.stable:
        return table.with_decision("rollback", by, reasons or [f"{table.stable} rolled back to {table.last_good}"],
                                   now, stable=table.last_good, last_good=table.last_good, canary=None,
                                   weight=0.0, state="rolled_back")
    raise ValueError("nothing to roll back: no rollout is running and no promoted version has a predecessor")
