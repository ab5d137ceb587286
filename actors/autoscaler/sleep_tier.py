"""Sleeping replicas as a tier of the pool policy (issue [28]; decision 0042). Pure: no I/O, no clock.

A sleeping worker (actors/worker/sleep.py) holds its weights and its instance but no KV cache and no work; it
serves again ``wake_s`` after its wake (measured: the ``wake_s`` of its record, else ``default_wake_s``), where a
cold replica serves ``cold_start_s`` after its start (decision 0042: 10-20 s for the default model here, 52 s for
the simulator's fleet). The tier sits between running and cold, and it is not free:

* **cost.** A sleeper costs its instance's full price per hour, unless another model's awake replica shares the
  instance (a multi-model host, actors/worker/host_sleep.py: the instance is paid for by the replica that serves;
  the sleeper holds memory only), then nothing.
* **what it saves.** At the next scale-up a sleeper serves ``cold_start_s - wake_s`` seconds sooner than a cold
  replica. Those seconds are capacity missing while requests wait, weighed ``cold_start_penalty`` paid
  replica-seconds each (10 by default: a second of a step unserved counts as much as ten seconds of an idle paid
  replica; an operator who cares only for cost sets 1, which is the ski-rental break-even [Karlin et al.,
  "Competitive randomized algorithms for non-uniform problems", SODA 1990]).
* **how long it stays.** A sleeper stays asleep while what it has cost is below what it saves:
  ``keep_s = cold_start_penalty x (cold_start_s - wake_s) x price / cost``, at most ``idle_horizon_s`` (a shared,
  free sleeper stays the idle horizon); 0 when a wake saves nothing (``wake_s >= cold_start_s``).
* **whether a scale-down sleeps.** Only while recent history or the forecast says the capacity will be wanted
  again: ``wanted_again = max(peak active target over the last history_s, forecast) - active target``. The pool
  keeps at most that many sleepers (:attr:`SleepPlan.keep`): a scale-down's victim sleeps while fewer sleep,
  else it exits; sleepers beyond ``wanted_again``, or asleep past their ``keep_s``, exit
  (:attr:`SleepPlan.exit`: the dearest, slowest to wake and longest asleep go first).

The autoscaler writes the plan into the pool's desired record (``"sleep": SleepPlan.to_json()``); the supervisor
carries it out (control/ops/supervisor_sleep.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields

from control.policy.numbers import is_number

__all__ = ["SleeperInfo", "SleepTierConfig", "SleepPlan", "SleepTierPolicy"]


@dataclass(frozen=True)
class SleeperInfo:
    """One sleeping worker of a pool: ``asleep_s`` seconds asleep so far, ``wake_s`` its last measured wake (s;
    0: never woken), ``shared``: another model's awake replica runs on its instance (its cost is 0)."""

    worker_id: str
    asleep_s: float = 0.0
    wake_s: float = 0.0
    shared: bool = False


@dataclass(frozen=True)
class SleepTierConfig:
    """Knobs of :class:`SleepTierPolicy` (seconds; module docstring). Every field a number >= 0."""

    history_s: float = 600.0  # recent history: the peak active target over this window is wanted again
    idle_horizon_s: float = 1800.0  # no sleeper stays asleep longer
    default_wake_s: float = 2.0  # a sleeper never woken: the target (actors/scheduler/load.py WAKE_S)
    cold_start_s: float = 60.0  # a cold replica's start -> serving, when the caller has no measurement
    cold_start_penalty: float = 10.0  # a replica-second of missing capacity, in paid replica-seconds

    def __post_init__(self) -> None:
        for f in fields(self):
            if not is_number(getattr(self, f.name), minimum=0):
                raise ValueError(f"SleepTierConfig.{f.name} must be a number >= 0, got {getattr(self, f.name)!r}")


@dataclass(frozen=True)
class SleepPlan:
    """The tier's decision for one pool: ``keep`` sleepers at most (a scale-down sleeps its victim while fewer
    sleep); ``horizon_s``: how long a new sleeper on an instance of its own may stay asleep; ``exit``: worker ids
    of sleepers to stop now; ``wanted_again``: replicas recent history or the forecast wants back."""

    keep: int
    horizon_s: float
    exit: tuple[str, ...] = ()
    wanted_again: int = 0
    reason: str = ""

    def to_json(self) -> dict:
        """The ``sleep`` entry of the pool's desired record."""
        return {"keep": self.keep, "horizon_s": round(self.horizon_s, 1), "exit": list(self.exit),
                "wanted_again": self.wanted_again, "reason": self.reason}


class SleepTierPolicy:
    """Weighs sleepers against cold starts per pool (module docstring). Keeps the recent active targets."""

    def __init__(self, cfg: SleepTierConfig | None = None) -> None:
        self.cfg = cfg or SleepTierConfig()
        self._history: dict[str, deque[tuple[float, int]]] = {}

    def observe(self, key: str, now: float, active: int) -> None:
        """Note ``key``'s active target at ``now`` (s)."""
        h = self._history.setdefault(key, deque())
        if not h or h[-1][1] != active:
            h.append((now, int(active)))
        while len(h) > 1 and h[1][0] <= now - self.cfg.history_s:
            h.popleft()  # the oldest entry stays: it is the value at the window's start

    def peak(self, key: str, now: float) -> int:
        """The largest active target of ``key`` within the last ``history_s`` (0 when none was observed)."""
        return max((n for _, n in self._history.get(key, ())), default=0)

    def keep_s(self, wake_s: float, cold_start_s: float, shared: bool) -> float:
        """How long a sleeper stays asleep (s): ``idle_horizon_s`` when shared, else the break-even of the module
        docstring; 0 when its wake saves nothing."""
        saved = cold_start_s - (wake_s or self.cfg.default_wake_s)
        if saved <= 0:
            return 0.0
        if shared:
            return self.cfg.idle_horizon_s
        return min(self.cfg.idle_horizon_s, self.cfg.cold_start_penalty * saved)

    def plan(self, key: str, now: float, active: int, sleepers: list[SleeperInfo],
             cold_start_s: float | None = None, forecast_replicas: int = 0, awake: int | None = None) -> SleepPlan:
        """The plan of pool ``key`` at ``now`` (s) with its active target ``active`` and its ``sleepers``;
        ``cold_start_s``: the pool's measured cold start (else the config's); ``forecast_replicas``: replicas a
        forecast wants within the horizon (0: none); ``awake``: the pool's awake replicas now (None: ``active``).
        Sleepers that a scale-up to ``active`` wakes (``active - awake``) are wanted as well: a scale-up's own
        sleepers never exit. Observes ``active`` first."""
        self.observe(key, now, active)
        cold = self.cfg.cold_start_s if cold_start_s is None else float(cold_start_s)
        to_wake = max(0, int(active) - (int(active) if awake is None else int(awake)))
        wanted = max(0, max(self.peak(key, now), int(forecast_replicas)) - int(active)) + to_wake
        wake = [s.wake_s for s in sleepers if s.wake_s > 0]
        horizon = self.keep_s(max(wake) if wake else 0.0, cold, False)
        ranked = sorted(sleepers, key=lambda s: (not s.shared, s.wake_s or self.cfg.default_wake_s, s.asleep_s,
                                                 s.worker_id))
        exits, why = [], []
        for i, s in enumerate(ranked):
            left = self.keep_s(s.wake_s, cold, s.shared) - s.asleep_s
            if i >= wanted:
                exits.append(s.worker_id)
                why.append(f"{s.worker_id} exits: {wanted} replica(s) wanted again")
            elif left <= 0:
                exits.append(s.worker_id)
                why.append(f"{s.worker_id} exits: asleep {s.asleep_s:.0f} s, worth keeping "
                           f"{self.keep_s(s.wake_s, cold, s.shared):.0f} s")
        keep = wanted if horizon > 0 or any(s.shared for s in sleepers) else min(wanted, to_wake)
        reason = (f"peak {self.peak(key, now)} in {self.cfg.history_s:.0f} s, forecast {forecast_replicas}, active "
                  f"{active}, awake {active if awake is None else awake}: {wanted} wanted again; a sleeper saves {cold:.0f} s of cold start for "
                  f"{horizon:.0f} s asleep at full price")
        return SleepPlan(keep, horizon, tuple(exits), wanted, "; ".join([reason, *why]))
