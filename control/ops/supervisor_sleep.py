"""The sleeping tier of the supervisor's worker scaling (issue [28]; the worker side is actors/worker/sleep.py).

With ``StackConfig.sleep_horizon_s`` > 0 a worker pool's scale-down puts its victims to sleep instead of stopping
them (the capacity was wanted until now, so recent history says it may be wanted again within the horizon); its
scale-up wakes sleepers first (about a second, against a
cold start of 10-20 s on this machine) and spawns only what they do not cover; a sleeper asleep for
``sleep_horizon_s`` exits (SIGTERM, as a scale-down). A sleeper keeps its process, weights and lease and holds no
KV cache; it counts against neither the pool's awake count nor ``max_workers`` (it uses no core).

:class:`SleepTier` keeps the commands to write (``sleep_key(worker id)`` = ``{"want":
"sleep" | "wake", "by": "supervisor", "ts"}``); the registry watch writes them after each round
(control/ops/supervisor_versions.py) and hands back the sleep records it read, so a sleeper that a scheduler woke
(requests waited and only sleepers were left) counts as awake again. Pure but for the clock it is given.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from control.ops.supervisor_processes import ActorProcess

__all__ = ["SleepTier"]


class SleepTier:
    """The sleep decisions of one supervisor (module docstring). ``horizon_s``: 0 turns the tier off (scale-down
    stops workers, scale-up spawns them)."""

    def __init__(self, horizon_s: float) -> None:
        if horizon_s < 0:
            raise ValueError("horizon_s must be >= 0")
        self.horizon_s = float(horizon_s)
        self._commands: list[tuple[str, dict]] = []
        self._plans: dict[tuple[str, str], Mapping[str, Any]] = {}  # (ref, pool) -> the autoscaler's plan

    @property
    def on(self) -> bool:
        """True when scale-downs may sleep."""
        return self.horizon_s > 0

    def set_plan(self, ref: str, pool: str, plan: Mapping[str, Any] | None) -> None:
        """The autoscaler's sleeping-tier plan of ``ref`` on ``pool`` (the ``sleep`` of its desired record:
        ``keep``, ``horizon_s``, ``exit``; actors/autoscaler/sleep_tier.py), or None (a desired count written by
        hand or by an older autoscaler: the horizon rule alone)."""
        if plan is None:
            self._plans.pop((ref, pool), None)
        else:
            self._plans[(ref, pool)] = plan

    def prefers_sleep(self, ref: str = "", pool: str = "", asleep: int = 0) -> bool:
        """Whether a scale-down of ``ref`` on ``pool`` (with ``asleep`` sleepers now) sleeps its victim: while
        the tier is on and, with the autoscaler's plan, while fewer than its ``keep`` sleep (recent history or
        the forecast wants the capacity again and a sleeper is worth its cost). Without a plan: always (the
        capacity was wanted until this scale-down; a sleeper not woken within the horizon exits)."""
        plan = self._plans.get((ref, pool))
        if not self.on:
            return False
        return plan is None or asleep < int(plan.get("keep", 0) or 0)

    def sleep(self, a: ActorProcess, now: float) -> None:
        """Put worker ``a`` to sleep (command queued; ``a.sleeping_since`` set)."""
        a.sleeping_since = now
        self._commands.append(self._command(a.name, "sleep"))

    def wake(self, a: ActorProcess) -> None:
        """Wake worker ``a`` (command queued; ``a.sleeping_since`` cleared)."""
        a.sleeping_since = None
        self._commands.append(self._command(a.name, "wake"))

    def expired(self, actors: Iterable[ActorProcess], now: float, default_pool: str = "") -> list[ActorProcess]:
        """Sleepers that exit: asleep for the horizon or longer, or named in their pool's plan's ``exit``
        (beyond the sleepers wanted again, or past the time their cost buys: sleep_tier.py)."""
        out = []
        for a in actors:
            if a.sleeping_since is None:
                continue
            plan = self._plans.get((a.model or "", a.pool or default_pool)) or {}
            if now - a.sleeping_since >= self.horizon_s or a.name in (plan.get("exit") or ()):
                out.append(a)
        return out

    def observe(self, records: Mapping[str, Any], actors: Iterable[ActorProcess]) -> list[ActorProcess]:
        """Take the sleep records read from etcd (key -> value): a sleeper whose record now says ``wake`` (a
        scheduler woke it) is awake again. Returns those actors."""
        from control.state.names import sleep_key

        woken = []
        for a in actors:
            rec = records.get(sleep_key(a.name)) if a.sleeping_since is not None else None
            if isinstance(rec, dict) and rec.get("want") == "wake" and rec.get("by") != "supervisor":
                a.sleeping_since = None
                woken.append(a)
        return woken

    def take_commands(self) -> list[tuple[str, dict]]:
        """The commands queued since the last call, oldest first (the watch writes them to etcd)."""
        out, self._commands = self._commands, []
        return out

    @staticmethod
    def _command(worker_id: str, want: str) -> tuple[str, dict]:
        from control.state.names import sleep_key

        return sleep_key(worker_id), {"want": want, "by": "supervisor", "ts": time.time()}
