"""The sleeping tier without a supervisor: the autoscaler writes the sleep and wake records itself (issue [28];
``actorserve actor autoscaler --carry-sleep``, for Kubernetes with KEDA, issue [27]).

Under ``actorserve up`` the supervisor carries out a pool's desired count and its sleep plan
(control/ops/supervisor_sleep.py). On Kubernetes KEDA sets a Deployment's replicas from the exported gauge
(actors/autoscaler/export.py), which is **running + sleeping**: a sleeper is a pod that stays, so a scale-down to
sleep or a wake changes no pod. The transitions travel as the workers' etcd records instead (``sleep_key(worker
id)`` = ``{"want": "sleep" | "wake", "by": "autoscaler", "ts"}``, watched by every worker, actors/worker/sleep.py):

* awake workers over the desired count: the extras sleep while the plan's ``keep`` has room (the highest ids
  first), and are not counted as sleepers in the export until then (:attr:`SleepCarrier.pending`); what the plan
  does not keep leaves the export's count, and Kubernetes removes a pod;
* awake workers under the desired count with sleepers in the pool: sleepers wake (not those the plan lets exit,
  then the most recently slept first) before the export asks for new pods;
* sleepers in the plan's ``exit`` leave the export's count (Kubernetes chooses which pod it removes; a sleeper is
  not marked for it).

A command is not repeated for ``retry_s`` while the worker's record has not yet changed. Pure but for the clock
passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["SleepCarrier"]


class SleepCarrier:
    """Sleep and wake commands of the autoscaler (module docstring)."""

    def __init__(self, retry_s: float = 10.0) -> None:
        self.retry_s = retry_s
        self._sent: dict[str, tuple[str, float, str]] = {}  # worker id -> (want, epoch s, pool key)

    def pending(self, key: str, want: str = "sleep") -> int:
        """Workers of pool ``key`` told to ``want`` (sleep / wake) whose records do not say so yet: the export
        counts those going to sleep as sleepers, and those waking not (the desired count holds them)."""
        return sum(1 for w, _, k in self._sent.values() if w == want and k == key)

    def commands(self, now: float, workers: Iterable[Any], desired: Mapping[str, int], plans: Mapping[str, Any],
                 leaving: set[str]) -> list[tuple[str, str]]:
        """``[(worker id, "sleep" | "wake")]`` for this tick. ``workers``: collect.WorkerRecord; ``desired``:
        pool key (``name/version/pool``) -> desired awake count; ``plans``: pool key -> SleepPlan; ``leaving``:
        worker ids with a preemption notice (never put to sleep)."""
        workers = list(workers)
        state = {w.worker_id: w.sleeping for w in workers}
        for wid, (want, ts, _) in list(self._sent.items()):  # done (the record says so), gone, or to retry
            if wid not in state or state[wid] == (want == "sleep") or now - ts >= self.retry_s:
                del self._sent[wid]
        out = []
        for key, plan in sorted(plans.items()):
            if key not in desired:
                continue
            mine = [w for w in workers if f"{w.name}/{w.version}/{w.pool}" == key]
            awake = [w for w in mine if not w.sleeping and w.worker_id not in leaving
                     and self._sent.get(w.worker_id, ("",))[0] != "sleep"]
            asleep = [w for w in mine if w.sleeping and self._sent.get(w.worker_id, ("",))[0] != "wake"]
            waking = sum(1 for w in mine if w.sleeping and self._sent.get(w.worker_id, ("",))[0] == "wake")
            want = int(desired[key]) - waking  # told to wake: they count as awake
            if len(awake) > want:
                room = max(0, int(plan.keep) - len(asleep) - self.pending(key))
                for w in sorted(awake, key=lambda w: w.worker_id, reverse=True)[:min(len(awake) - want, room)]:
                    out.append((w.worker_id, "sleep"))
                    self._sent[w.worker_id] = ("sleep", now, key)
            elif len(awake) < want and asleep:
                exiting = set(plan.exit)
                order = sorted(asleep, key=lambda w: (w.worker_id in exiting, -w.asleep_since, w.worker_id))
                for w in order[:want - len(awake)]:
                    out.append((w.worker_id, "wake"))
                    self._sent[w.worker_id] = ("wake", now, key)
        return out
