"""Which model versions a worker keeps resident within one memory budget (issue [11] item 1). Pure: no torch,
no nats; times are arguments.

A worker's memory budget (bytes: ``--memory-budget-bytes``, or what the machine has) holds the weights of its
resident versions and a KV cache per version. :class:`ResidencyPolicy` turns what the worker knows --
each version's :class:`VersionSpec` (weight bytes, the artifact + quantization its weights come from, KV
floor, pin, SLO class, load cost) and :class:`Demand` (recent tokens/s, queue, running sequences) -- into a
:class:`ResidencyPlan`: what to load, what to stop admitting (drain), what to evict, and the KV bytes of each
version that stays.

Rules (after ModelMesh's and Triton's many-models-per-server residency, where the least valuable model is
unloaded when a more valuable one needs the room; the value here is demand weighted by SLO class):

1. Pinned versions are always wanted. Any other version is wanted by its *score*: ``slo weight x (tokens/s
   + queue_tokens_weight x queued requests)``; a resident version's score is raised by ``hysteresis`` (it costs
   nothing to keep), a version not resident is lowered by its load cost (``score / (1 + load_cost_s /
   load_cost_horizon_s)``): a version is not swapped in for a slightly busier one that costs seconds to load.
2. Versions are taken in score order (pinned first; ties: resident first, then the most recently used) while
   their bytes fit: weights once per share key (two versions naming one artifact and quantization share one
   copy) plus the version's KV floor. A version with no demand is never loaded; a resident one with no demand
   stays while it fits (nothing evicts without a need).
3. A resident version not wanted is evicted only with no running sequence; one with running sequences is
   drained first (no new admissions) and evicted when they end, or when it has drained ``drain_bound_s``
   (``forced``: the caller ends what still runs with a retryable error, as a worker drain does).
4. A version to load is loaded only when its bytes fit beside what stays resident after this plan's
   evictions; otherwise it waits (``waiting``) for a drain to end.
5. The KV bytes left after the resident weights are split across the resident versions: each its floor, the
   rest in proportion to ``1 + tokens/s`` (an idle version keeps more than its floor only while nothing else
   needs it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: SLO (priority) class -> weight of a version's demand; the classes of control/state/tenants.py
#: ``PRIORITY_CLASSES`` (batch demand is worth a quarter: it waits well); an unknown class weighs 1
SLO_WEIGHTS = {"interactive": 1.0, "batch": 0.25}


@dataclass(frozen=True)
class VersionSpec:
    """What one version needs. ``ref``: ``name@version``; ``weights_bytes``: bytes of its converted (and
    quantized) weights; ``share_key``: versions with equal keys share one copy of the weights (the artifact
    path + quantization); ``kv_floor_bytes``: the least KV cache it is resident with; ``load_cost_s``: seconds
    a load takes (measured, else an estimate)."""

    ref: str
    weights_bytes: int
    share_key: str
    kv_floor_bytes: int = 0
    pinned: bool = False
    slo_class: str = "interactive"
    load_cost_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.ref or "@" not in self.ref:
            raise ValueError(f"ref must be name@version, got {self.ref!r}")
        if self.weights_bytes < 0 or self.kv_floor_bytes < 0:
            raise ValueError("weights_bytes and kv_floor_bytes must be >= 0")
        if self.load_cost_s < 0:
            raise ValueError("load_cost_s must be >= 0")


@dataclass(frozen=True)
class Demand:
    """Recent demand for one version: ``tokens_per_s`` served and arriving (tokens/s), ``queue_len`` requests
    waiting for it (here or at its scheduler), ``running`` sequences it runs on this worker now, ``last_used``
    (monotonic s of its latest request; 0: never)."""

    tokens_per_s: float = 0.0
    queue_len: int = 0
    running: int = 0
    last_used: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens_per_s < 0 or self.queue_len < 0 or self.running < 0:
            raise ValueError("tokens_per_s, queue_len and running must be >= 0")

    def active(self) -> bool:
        """True when anything asks for the version."""
        return self.tokens_per_s > 0 or self.queue_len > 0 or self.running > 0


@dataclass
class ResidencyPlan:
    """One decision. Every list holds refs."""

    load: list[str] = field(default_factory=list)  # not resident, wanted, fits now: load these
    waiting: list[str] = field(default_factory=list)  # wanted, but the room frees only when a drain ends
    drain: list[str] = field(default_factory=list)  # resident, not wanted, sequences running: admit no more
    evict: list[str] = field(default_factory=list)  # resident, not wanted, nothing running (or forced): unload
    forced: list[str] = field(default_factory=list)  # the evictions whose drain ran past the bound
    kv_bytes: dict[str, int] = field(default_factory=dict)  # ref -> KV cache bytes, every version resident after
    weights_bytes: int = 0  # resident weights after the plan (shared copies once), bytes
    reasons: dict[str, str] = field(default_factory=dict)  # ref -> why it was loaded / drained / evicted / waits


@dataclass(frozen=True)
class ResidencyConfig:
    """Knobs of :class:`ResidencyPolicy` (module docstring)."""

    hysteresis: float = 0.5  # a resident version's score x (1 + this)
    load_cost_horizon_s: float = 10.0  # a load of this many seconds halves a candidate's score
    queue_tokens_weight: float = 100.0  # a queued request counts as this many tokens/s of demand
    drain_bound_s: float = 30.0  # a drained version is evicted at the latest this long after its drain began

    def __post_init__(self) -> None:
        if self.hysteresis < 0 or self.load_cost_horizon_s <= 0 or self.queue_tokens_weight < 0:
            raise ValueError("hysteresis and queue_tokens_weight must be >= 0, load_cost_horizon_s > 0")
        if self.drain_bound_s < 0:
            raise ValueError("drain_bound_s must be >= 0")


class ResidencyPolicy:
    """Plans residency for one worker (module docstring). Keeps only when each drain began."""

    def __init__(self, config: ResidencyConfig | None = None) -> None:
        self.cfg = config or ResidencyConfig()
        self.draining_since: dict[str, float] = {}  # ref -> monotonic s its drain began

    def score(self, spec: VersionSpec, demand: Demand, resident: bool) -> float:
        """The version's value (rule 1); ``inf`` when pinned."""
        if spec.pinned:
            return float("inf")
        raw = SLO_WEIGHTS.get(spec.slo_class, 1.0) * (demand.tokens_per_s
                                                       + self.cfg.queue_tokens_weight * demand.queue_len)
        if resident:
            return raw * (1.0 + self.cfg.hysteresis)
        return raw / (1.0 + spec.load_cost_s / self.cfg.load_cost_horizon_s)

    def plan(self, budget_bytes: int, specs: dict[str, VersionSpec], demand: dict[str, Demand],
             resident: set[str], now: float, asleep: set[str] = frozenset()) -> ResidencyPlan:
        """The plan for ``budget_bytes`` (bytes) given every known version's spec, its demand (missing: none)
        and the refs resident now; ``asleep``: resident refs that sleep (their specs' floors hold no KV; they get
        no KV share: actors/worker/host_sleep.py). ValueError for a resident ref without a spec."""
        if missing := sorted(resident - set(specs)):
            raise ValueError(f"resident versions without a spec: {missing}")
        wanted = self._wanted(budget_bytes, specs, demand, resident)
        out = ResidencyPlan()
        self._leave(out, specs, demand, resident, wanted, now)
        staying = resident - set(out.evict)
        self._enter(out, budget_bytes, specs, wanted, resident, staying)
        after = staying | set(out.load)
        out.weights_bytes = _weights(specs, after)
        lent = sum(specs[r].kv_floor_bytes for r in after & asleep)  # a sleeper's floor: its LoRA slots only
        out.kv_bytes = self.split_kv(budget_bytes - out.weights_bytes - lent,
                                     [specs[r] for r in sorted(after - asleep)], demand)
        out.kv_bytes.update({r: 0 for r in after & asleep})
        return out

    def _wanted(self, budget: int, specs: dict[str, VersionSpec], demand: dict[str, Demand],
                resident: set[str]) -> list[str]:
        cands = [r for r, s in specs.items() if s.pinned or r in resident or demand.get(r, Demand()).active()]
        key = {r: (-self.score(specs[r], demand.get(r, Demand()), r in resident), r not in resident,
                   -demand.get(r, Demand()).last_used, r) for r in cands}
        taken: list[str] = []
        for ref in sorted(cands, key=key.__getitem__):
            if _weights(specs, taken + [ref]) + sum(specs[r].kv_floor_bytes for r in taken + [ref]) <= budget:
                taken.append(ref)
        return taken

    def _leave(self, out: ResidencyPlan, specs, demand, resident: set[str], wanted: list[str], now: float) -> None:
        for ref in sorted(resident - set(wanted)):
            running = demand.get(ref, Demand()).running
            since = self.draining_since.setdefault(ref, now)
            if running == 0 or now - since >= self.cfg.drain_bound_s:
                out.evict.append(ref)
                self.draining_since.pop(ref, None)
                if running:
                    out.forced.append(ref)
                out.reasons[ref] = (f"evicted: drained {now - since:.0f} s >= {self.cfg.drain_bound_s:g} s with "
                                    f"{running} running" if running else "evicted: not wanted, nothing running")
            else:
                out.drain.append(ref)
                out.reasons[ref] = f"draining: not wanted, {running} running"
        for ref in list(self.draining_since):
            if ref in wanted or ref not in resident:
                del self.draining_since[ref]  # wanted again (the drain is called off), or gone

    def _enter(self, out: ResidencyPlan, budget: int, specs, wanted: list[str], resident: set[str],
               staying: set[str]) -> None:
        held = set(staying)
        for ref in wanted:
            if ref in resident:
                continue
            need = _weights(specs, held | {ref}) + sum(specs[r].kv_floor_bytes for r in held | {ref})
            if need <= budget:
                out.load.append(ref)
                held.add(ref)
                out.reasons[ref] = "loaded: wanted and fits"
            else:
                out.waiting.append(ref)
                out.reasons[ref] = f"waiting: needs {need} bytes of {budget} until a drain ends"

    @staticmethod
    def split_kv(free_bytes: int, resident: list[VersionSpec], demand: dict[str, Demand]) -> dict[str, int]:
        """KV bytes per resident version (rule 5): each its floor, the rest of ``free_bytes`` in proportion to
        ``1 + tokens/s``. Floors that do not fit are given as they are (the plan never builds such a set)."""
        if not resident:
            return {}
        rest = max(0, free_bytes - sum(s.kv_floor_bytes for s in resident))
        weight = {s.ref: 1.0 + demand.get(s.ref, Demand()).tokens_per_s for s in resident}
        total = sum(weight.values())
        return {s.ref: s.kv_floor_bytes + int(rest * weight[s.ref] / total) for s in resident}


def _weights(specs: dict[str, VersionSpec], refs) -> int:
    """Weight bytes of ``refs``, one copy per share key."""
    by_key = {specs[r].share_key: specs[r].weights_bytes for r in refs}
    return sum(by_key.values())
