"""Scaling decisions and their bounded log (pure: no I/O, no clock).

A ``Decision`` records one change of a target's desired replica count: when (``ts``, epoch s, passed in),
which loop (``"cpu"`` for the CPU tier, ``"pool"`` for accelerator pools, ``"lend"`` for a host lent to a version
short of replicas: actors/autoscaler/lend_carry.py), the target (``"validator"``,
``"gateway"``, ``"worker/<name>/<version>/<pool>"``), the observed count, the new desired count, a human
reason ("validator wait p90 412 ms > 200 ms") and every input the policy used. The autoscaler actor stores
``DecisionLog.to_json()`` at ``autoscaler_decisions_key()`` (newest last, at most 200).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

LOOPS = ("cpu", "pool", "lend")
DEFAULT_LOG_LEN = 200


def _plain(value: Any) -> Any:
    """JSON-safe copy of an input value: numbers, strings, bools, None, lists and dicts of those."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise ValueError(f"Decision.inputs values must be JSON-like, got {type(value).__name__}")


@dataclass(frozen=True)
class Decision:
    """One change of a desired count (see module docstring). ValueError naming the field when invalid."""

    ts: float
    loop: str
    target: str
    current: int
    desired: int
    reason: str
    inputs: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.ts, bool) or not isinstance(self.ts, (int, float)) or self.ts < 0:
            raise ValueError(f"Decision.ts must be epoch seconds >= 0, got {self.ts!r}")
        if self.loop not in LOOPS:
            raise ValueError(f"Decision.loop must be one of {', '.join(LOOPS)}, got {self.loop!r}")
        if not isinstance(self.target, str) or not self.target:
            raise ValueError("Decision.target must be a non-empty string")
        for name in ("current", "desired"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Decision.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise ValueError("Decision.reason must be a non-empty string")
        if not isinstance(self.inputs, Mapping):
            raise ValueError("Decision.inputs must be an object")
        object.__setattr__(self, "inputs", _plain(self.inputs))

    @property
    def delta(self) -> int:
        """desired - current."""
        return self.desired - self.current

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict with every field."""
        return {"ts": self.ts, "loop": self.loop, "target": self.target, "current": self.current,
                "desired": self.desired, "reason": self.reason, "inputs": dict(self.inputs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Decision":
        """Inverse of to_json; ValueError when a field is missing or invalid."""
        if not isinstance(data, Mapping):
            raise ValueError("decision must be an object")
        missing = [k for k in ("ts", "loop", "target", "current", "desired", "reason") if k not in data]
        if missing:
            raise ValueError(f"decision is missing {', '.join(missing)}")
        return cls(data["ts"], data["loop"], data["target"], data["current"], data["desired"], data["reason"],
                   data.get("inputs") or {})


class DecisionLog:
    """The last ``max_len`` decisions, oldest first (a bounded history; older ones are dropped)."""

    def __init__(self, max_len: int = DEFAULT_LOG_LEN, decisions: Iterable[Decision] = ()) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"DecisionLog.max_len must be an integer >= 1, got {max_len!r}")
        self._items: deque[Decision] = deque(decisions, maxlen=max_len)

    @property
    def max_len(self) -> int:
        return self._items.maxlen or 0

    def extend(self, decisions: Iterable[Decision]) -> None:
        """Append ``decisions`` (newest last), dropping the oldest past ``max_len``."""
        self._items.extend(decisions)

    def append(self, decision: Decision) -> None:
        """Append one decision."""
        self._items.append(decision)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def last(self, target: str) -> Decision | None:
        """The newest decision about ``target``, or None."""
        for d in reversed(self._items):
            if d.target == target:
                return d
        return None

    def to_json(self) -> dict[str, Any]:
        """``{"decisions": [Decision.to_json(), ...]}``, newest last."""
        return {"decisions": [d.to_json() for d in self._items]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None, max_len: int = DEFAULT_LOG_LEN) -> "DecisionLog":
        """Inverse of to_json (None or ``{}``: an empty log); ValueError on a malformed entry."""
        items = (data or {}).get("decisions") or []
        if not isinstance(items, list):
            raise ValueError("decisions must be a list")
        return cls(max_len, (Decision.from_json(d) for d in items))
