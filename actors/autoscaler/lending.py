"""Lending capacity across models (pure: no I/O, no clock; ``now`` is passed in): where a scale-up of one model's
replicas comes from, when hosts hold sleeping replicas of several models (issue [29] item 1; sleeping replicas:
decision 0042).

A host that served a model and was scaled down keeps that model asleep (``SpareHost``: KV cache freed, weights
in host memory, the host still billed) for ``horizon_s``, then is given back. A scale-up of model m by k takes,
in this order, the cheapest start first (every host is billed the same per second, so the cheapest start is
the one that bills the fewest host-seconds before serving and adds no host):

1. m's own sleepers: a wake (``wake_s``);
2. with lending on: another model's sleeper, that model's sleep given up and m's weights loaded on the running
   host (``load_other_s``: no boot) — only from a model whose forecast does not want its sleepers back
   (``protected``: the caller's forecast says its replicas will be needed), the longest-asleep first;
3. a cold start on a new host (``cold_start_s``).

Without lending (``lend`` False) step 2 is skipped: each model on its own hosts, sleeping allowed — the
comparison issue [29] asks for. A lend is cheaper than a cold start whenever a sleeper would otherwise sit
idle: the cold start bills a new host for ``cold_start_s`` before it serves and the idle sleeper bills on
until its horizon; the lend bills ``load_other_s`` on a host already paid for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

from control.policy.numbers import is_number

HOWS = ("wake", "lend", "cold")


@dataclass(frozen=True)
class LendingConfig:
    """Seconds from the decision to serving for a wake, a lend (load on a running host) and a cold start; how
    long a slept host is kept (s); whether lending across models is on."""

    wake_s: float = 1.93
    load_other_s: float = 12.2
    cold_start_s: float = 52.2
    horizon_s: float = 900.0
    lend: bool = True

    def __post_init__(self) -> None:
        for n in ("wake_s", "load_other_s", "cold_start_s", "horizon_s"):
            if not is_number(getattr(self, n), minimum=0):
                raise ValueError(f"LendingConfig.{n} must be a finite number >= 0, got {getattr(self, n)!r}")
        if not isinstance(self.lend, bool):
            raise ValueError(f"LendingConfig.lend must be a bool, got {self.lend!r}")


@dataclass(frozen=True)
class SpareHost:
    """A billed host with ``model`` asleep on it since ``since`` (s). ``host``: an integer in the simulator, the
    host id live (actors/autoscaler/lend_carry.py)."""

    host: Hashable
    model: str
    since: float


@dataclass(frozen=True)
class Start:
    """One replica of ``model`` to be serving ``ready_in_s`` from now: ``how`` in HOWS, on ``host`` (None: new)."""

    model: str
    how: str
    host: Hashable | None
    ready_in_s: float


def expire(spares: Iterable[SpareHost], now: float, cfg: LendingConfig) -> tuple[list[SpareHost], list[SpareHost]]:
    """(kept, given back): spares asleep for ``horizon_s`` or longer are given back."""
    kept, gone = [], []
    for s in spares:
        (gone if now - s.since >= cfg.horizon_s else kept).append(s)
    return kept, gone


def plan_starts(wants: Mapping[str, int], spares: Iterable[SpareHost], cfg: LendingConfig,
                protected: Iterable[str] = (),
                holds: Mapping[str, Iterable[Hashable]] | None = None) -> tuple[list[Start], list[SpareHost]]:
    """Starts for ``wants`` (model -> replicas to add, > 0) from ``spares`` (module docstring), and the spares
    left. Models are served in descending order of want (then by name: deterministic); ValueError for a
    negative want. ``holds``: model -> hosts where it is resident already (a live multi-version host holds
    several models; one replica of a model per host): another model's sleeper there is not lent to it."""
    holds = {m: set(h) for m, h in (holds or {}).items()}
    left = sorted(spares, key=lambda s: (s.since, s.host))
    keep = set(protected)
    out: list[Start] = []
    for model in sorted(wants, key=lambda m: (-wants[m], m)):
        k = wants[model]
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"plan_starts: want for {model!r} must be an integer >= 0, got {k!r}")
        own = [s for s in left if s.model == model][:k]
        for s in own:
            out.append(Start(model, "wake", s.host, cfg.wake_s))
        taken = {s.host for s in own}
        k -= len(own)
        if cfg.lend and k > 0:
            other = [s for s in left if s.model != model and s.model not in keep and s.host not in taken
                     and s.host not in holds.get(model, ())][:k]
            for s in other:
                out.append(Start(model, "lend", s.host, cfg.load_other_s))
            taken |= {s.host for s in other}
            k -= len(other)
        out.extend(Start(model, "cold", None, cfg.cold_start_s) for _ in range(k))
        left = [s for s in left if s.host not in taken]
    return out, left
