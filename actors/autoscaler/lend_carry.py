"""Lending across models, live (issue [29] item 1): the autoscaler's starts on multi-version worker hosts
(``actorserve actor autoscaler --lend``; ``actorserve up --multi-model --lend``; decision 0049).

The simulator's rule (actors/autoscaler/lending.py, :func:`~actors.autoscaler.lending.plan_starts`) decides here
on the live state. A version's replicas on hosts are its resident slots (actors/worker/host.py), each with a
worker record that names its ``host``; a sleeping slot (actors/worker/host_sleep.py: KV cache freed, weights
kept) is a spare of that host. Each tick, for every version whose desired count (the pool policy's, written by
the autoscaler) exceeds its awake replicas plus the lends still on their way:

1. its own sleepers are woken -- by the sleep carrier (sleep_carry.py, ``--carry-sleep``), or by its scheduler
   when requests wait; not here;
2. another version's sleeper on a host where this version is not resident is **lent**: the host is asked to
   load this version (``as.int.host.<host_id>.load``, HostLoad, the scheduler's own ask), and loads it into the
   room the sleeper's freed KV cache left -- or, short of room, its residency policy evicts the idle sleeper
   ("that model's sleep given up"). A version that wants replicas itself (its desired count above its awake
   ones) is ``protected``: its sleepers are not lent away;
3. what neither covers would be a cold start: hosts are fixed processes under ``up --multi-model``, so these
   are only counted (:attr:`LendCarrier.cold`; ``actorserve autoscaler status`` shows them) -- a version with no
   replica still gets one from its scheduler's ask to the host with the most free memory.

An ask is not repeated for ``retry_s`` while the host's records do not show the version (a load takes seconds);
it counts as a replica on its way meanwhile. Pure but for the clock passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from actors.autoscaler.lending import LendingConfig, SpareHost, plan_starts

__all__ = ["LendAsk", "LendCarrier"]


@dataclass(frozen=True)
class LendAsk:
    """Ask host ``host_id`` to load ``name@version`` (``queue_len``: the version's queued requests, at least 1:
    the host counts the ask as demand); ``lent_from``: the versions asleep there whose room it takes (", "-joined)."""

    host_id: str
    name: str
    version: str
    queue_len: int
    lent_from: str

    def to_json(self) -> dict:
        """The ``lends`` entry of the autoscaler's snapshot."""
        return {"host": self.host_id, "model": f"{self.name}@{self.version}", "lent_from": self.lent_from,
                "queue_len": self.queue_len}


class LendCarrier:
    """The lends of the autoscaler (module docstring). ``cfg``: the lending rule's config (``lend`` False: no
    lends, only the counts); ``retry_s``: seconds before an ask not yet seen carried out is sent again."""

    def __init__(self, cfg: LendingConfig | None = None, retry_s: float = 15.0) -> None:
        self.cfg = cfg or LendingConfig()
        self.retry_s = retry_s
        self._sent: dict[tuple[str, str], float] = {}  # (host id, ref) -> epoch s of the ask
        self.cold: dict[str, int] = {}  # ref -> replicas this tick found neither a sleeper nor a spare for

    def on_the_way(self, ref: str) -> int:
        """Lends of ``ref`` asked for and not yet seen on their hosts."""
        return sum(1 for _, r in self._sent if r == ref)

    def asks(self, now: float, workers: Iterable[Any], desired: Mapping[str, int],
             queue_lens: Mapping[str, int] | None = None) -> list[LendAsk]:
        """This tick's asks. ``workers``: collect.WorkerRecord (only those with a ``host`` count); ``desired``:
        pool key ``name/version/pool`` -> desired awake count (a version's pools summed); ``queue_lens``: ref ->
        requests its scheduler holds."""
        workers = list(workers)
        hosted = [w for w in workers if w.host]
        holds: dict[str, set[str]] = {}
        for w in hosted:
            holds.setdefault(f"{w.name}@{w.version}", set()).add(w.host)
        for (host, ref), ts in list(self._sent.items()):  # carried out (resident there), or to ask again
            if host in holds.get(ref, ()) or now - ts >= self.retry_s:
                del self._sent[(host, ref)]
        wants = self._wants(workers, desired)
        asking = {host for host, _ in self._sent}  # a host with an ask on its way is not lent again
        spares = [SpareHost(w.host, f"{w.name}@{w.version}", w.asleep_since) for w in hosted if w.sleeping
                  and w.host not in asking]
        starts, _ = plan_starts(wants, spares, self.cfg, protected=set(wants), holds=holds)
        from_of: dict[str, list[str]] = {}  # host -> the versions asleep there (a host may hold several)
        for sp in spares:
            from_of.setdefault(sp.host, []).append(sp.model)
        out, self.cold = [], {}
        for s in starts:
            if s.how == "lend":
                name, _, version = s.model.partition("@")
                out.append(LendAsk(str(s.host), name, version, max(1, int((queue_lens or {}).get(s.model, 0))),
                                   ", ".join(sorted(from_of[s.host]))))
                self._sent[(str(s.host), s.model)] = now
            elif s.how == "cold":
                self.cold[s.model] = self.cold.get(s.model, 0) + 1
        return out

    def _wants(self, workers: list[Any], desired: Mapping[str, int]) -> dict[str, int]:
        """ref -> replicas short: desired minus awake (on hosts or not) minus lends on their way (> 0 only)."""
        want: dict[str, int] = {}
        for key, count in desired.items():
            name, version, _pool = key.split("/")
            ref = f"{name}@{version}"
            want[ref] = want.get(ref, 0) + int(count)
        for w in workers:
            ref = f"{w.name}@{w.version}"
            if not w.sleeping and ref in want:
                want[ref] -= 1
        short = {ref: n - self.on_the_way(ref) for ref, n in want.items()}
        return {ref: n for ref, n in short.items() if n > 0}
