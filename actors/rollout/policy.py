"""Automatic canary analysis: the pure decision rules of the rollout controller (no I/O).

The approach is the one of Kayenta, the automated canary analysis of Spinnaker (Netflix and Google,
https://netflixtechblog.com/automated-canary-analysis-at-netflix-with-kayenta-3260bc7acc69): the canary is
judged *against the stable version serving at the same time* (not against a fixed SLO), over the same
window, on a few metrics, and the rollout advances only while every metric stays within its tolerance.
Unlike Kayenta's Mann-Whitney classification and score, we compare three summaries with explicit
thresholds, which keeps every decision explainable in one line:

* error rate: ``errors / (ok + errors)``; a cancelled request (client gone, deadline) is neither.
  Rollback when ``canary_rate - stable_rate > max_error_rate_delta`` (absolute, default 0.05).
* TTFT p95 (ms): per request ``queue_ms + prefill_ms`` (+ ``validation_ms``, ``gateway_ms`` when present),
  over successful requests. Rollback when ``canary_p95 > stable_p95 * max_ttft_p95_ratio + ttft_slack_ms``.
* ITL p95 (ms): per request ``decode_ms / (completion_tokens - 1)``, only for successful requests with at
  least 2 completion tokens. Rollback when ``canary_p95 > stable_p95 * max_itl_p95_ratio + itl_slack_ms``.

The slack keeps tiny latencies (a few ms, where a ratio is noise) from tripping a ratio.

Samples: the completion records (``as.int.done.<name>.<version>``) of the stable and the canary version
with ``ts`` within the last ``window_s`` seconds and not before the rollout started. Percentiles are
nearest-rank.

Rules of :func:`analyse`, in order:

1. Early error stop (before the canary has ``min_samples``): the canary's errors already exceed what the
   threshold allows at ``min_samples`` samples, i.e. ``errors / max(n, min_samples) > baseline +
   max_error_rate_delta`` where the baseline is the stable error rate if the stable side has
   ``min_samples``, else 0. Even if every further canary request succeeded, the error-rate verdict at
   ``min_samples`` would be a rollback (curtailment, as in sequential testing), so waiting only sends
   more users to a broken version.
2. The canary has fewer than ``min_samples`` -> wait.
3. The stable side has fewer than ``min_samples`` -> wait (nothing to compare with; rule 1 still guards
   against a failing canary with a zero baseline).
4. Any metric worse beyond its threshold -> rollback, reasons naming each failed metric with figures.
   A latency metric with fewer than ``max(1, min_samples // 2)`` values on a side is skipped (noted).
5. Healthy, but less than ``step_interval_s`` since the last decision (start or step, by anyone) -> wait.
6. Healthy -> step to the next weight of ``table.steps`` above the current one; when that is 100 (or
   there is none above) -> promote.

Thresholds come from the routing table's ``analysis`` dict over :class:`PolicyConfig`'s defaults
(:meth:`PolicyConfig.from_analysis`); ``auto: false`` there leaves the rollout to the operator.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from control.policy.latency import itl_ms, ttft_ms
from control.policy.numbers import is_number

ACTIONS = ("wait", "step", "promote", "rollback")


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the canary analysis (see the module docstring). ValueError on bad values."""

    window_s: float = 30.0  # sliding window of samples, seconds
    min_samples: int = 20  # per side (non-cancelled requests) before any comparison
    step_interval_s: float = 10.0  # minimum time between two decisions that move the weight
    max_error_rate_delta: float = 0.05  # canary error rate minus stable's, absolute
    max_ttft_p95_ratio: float = 1.5  # canary TTFT p95 / stable TTFT p95
    max_itl_p95_ratio: float = 1.5  # canary ITL p95 / stable ITL p95
    ttft_slack_ms: float = 50.0  # absolute slack added to the TTFT limit
    itl_slack_ms: float = 20.0  # absolute slack added to the ITL limit
    auto: bool = True  # False: the controller leaves this rollout alone

    def __post_init__(self) -> None:
        def num(fname: str, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
            v = getattr(self, fname)
            if not is_number(v):
                raise ValueError(f"analysis.{fname} must be a number, got {v!r}")
            if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
                bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
                raise ValueError(f"analysis.{fname} must be {bound}{'' if hi is None else f' and <= {hi:g}'}, "
                                 f"got {v!r}")
            object.__setattr__(self, fname, float(v))

        num("window_s", 0.0, lo_open=True)
        num("step_interval_s", 0.0)
        num("max_error_rate_delta", 0.0, 1.0)
        num("max_ttft_p95_ratio", 1.0)
        num("max_itl_p95_ratio", 1.0)
        num("ttft_slack_ms", 0.0)
        num("itl_slack_ms", 0.0)
        m = self.min_samples
        if isinstance(m, bool) or not isinstance(m, (int, float)) or m != int(m) or m < 1:
            raise ValueError(f"analysis.min_samples must be an integer >= 1, got {m!r}")
        object.__setattr__(self, "min_samples", int(m))
        if not isinstance(self.auto, bool):
            raise ValueError(f"analysis.auto must be true or false, got {self.auto!r}")

    @classmethod
    def from_analysis(cls, analysis: Mapping[str, Any] | None, *, strict: bool = True) -> "PolicyConfig":
        """Defaults overridden by a routing table's ``analysis`` dict. Unknown keys: ValueError when
        ``strict`` (the CLI), ignored otherwise (the controller reading a newer writer's record)."""
        analysis = dict(analysis or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(analysis) - known)
        if unknown and strict:
            raise ValueError(f"unknown analysis setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**{k: v for k, v in analysis.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every setting."""
        return dataclasses.asdict(self)


# --- samples and windows -----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """What the analysis keeps of one completion record."""

    ts: float  # completion time, unix seconds
    status: str  # "ok" | "error" | "cancelled"
    ttft_ms: float | None = None  # None when the record has no queue/prefill timing
    itl_ms: float | None = None  # None with fewer than 2 completion tokens


def sample_from_record(record: Any, *, received_at: float | None = None) -> Sample:
    """A Sample from a ``bus.messages.CompletionRecord`` (or its dict). ``received_at`` stands in for a
    missing ``ts``. An unknown status counts as an error."""
    get = record.get if isinstance(record, Mapping) else (lambda k, d=None: getattr(record, k, d))
    status = get("status", "error")
    if status not in ("ok", "error", "cancelled"):
        status = "error"
    ts = get("ts", 0.0) or (received_at or 0.0)
    timing = get("timing", None) or {}
    tokens = get("completion_tokens", 0) or 0
    return Sample(float(ts), status, ttft_ms(timing), itl_ms(timing, int(tokens)))


class VersionWindow:
    """Samples of one model version, oldest first, bounded in count (``maxlen``) and pruned by age."""

    def __init__(self, maxlen: int = 50_000) -> None:
        self.samples: deque[Sample] = deque(maxlen=maxlen)

    def add(self, sample: Sample) -> None:
        """Append one sample (records arrive roughly in time order; analysis filters by ts anyway)."""
        self.samples.append(sample)

    def prune(self, older_than: float) -> None:
        """Drop samples with ``ts`` before ``older_than`` from the old end."""
        while self.samples and self.samples[0].ts < older_than:
            self.samples.popleft()

    def __len__(self) -> int:
        return len(self.samples)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(s)))
    return s[min(rank, len(s)) - 1]


@dataclass(frozen=True)
class SideStats:
    """Summary of one side (stable or canary) over the window."""

    ok: int = 0
    errors: int = 0
    cancelled: int = 0
    ttft_p95_ms: float | None = None
    itl_p95_ms: float | None = None
    ttft_count: int = 0
    itl_count: int = 0

    @property
    def n(self) -> int:
        """Requests that count for the error rate (cancelled ones do not)."""
        return self.ok + self.errors

    @property
    def error_rate(self) -> float:
        """errors / n (0 when n is 0)."""
        return self.errors / self.n if self.n else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {"ok": self.ok, "errors": self.errors, "cancelled": self.cancelled, "n": self.n,
                "error_rate": round(self.error_rate, 4),
                "ttft_p95_ms": None if self.ttft_p95_ms is None else round(self.ttft_p95_ms, 1),
                "itl_p95_ms": None if self.itl_p95_ms is None else round(self.itl_p95_ms, 2),
                "ttft_count": self.ttft_count, "itl_count": self.itl_count}


def summarise(samples: Iterable[Sample], *, since: float, until: float) -> SideStats:
    """SideStats of the samples with ``since <= ts <= until``."""
    ok = errors = cancelled = 0
    ttfts: list[float] = []
    itls: list[float] = []
    for s in samples:
        if s.ts < since or s.ts > until:
            continue
        if s.status == "cancelled":
            cancelled += 1
        elif s.status == "ok":
            ok += 1
            if s.ttft_ms is not None:
                ttfts.append(s.ttft_ms)
            if s.itl_ms is not None:
                itls.append(s.itl_ms)
        else:
            errors += 1
    return SideStats(ok, errors, cancelled, percentile(ttfts, 95), percentile(itls, 95), len(ttfts), len(itls))


# --- the decision -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What the controller should do now. ``weight``: the canary weight after the action (the current
    weight for wait, 100 for promote, 0 for rollback). ``reasons``: human-readable, with figures."""

    action: str
    weight: float
    reasons: list[str] = field(default_factory=list)
    stable: SideStats = field(default_factory=SideStats)
    canary: SideStats = field(default_factory=SideStats)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {', '.join(ACTIONS)}, got {self.action!r}")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def next_weight(steps: Iterable[float], weight: float) -> float:
    """The first step above ``weight`` (100 when none is)."""
    return next((float(s) for s in sorted(steps) if s > weight), 100.0)


def analyse(table: Any, stable_samples: Iterable[Sample], canary_samples: Iterable[Sample],
            config: PolicyConfig, now: float) -> Decision:
    """Decide on a running rollout (``table``: a control.state.routing.RoutingTable in state "canary").

    ``stable_samples`` / ``canary_samples``: samples of the table's stable and canary versions (any age;
    those outside the window or before ``table.started_at`` are ignored). Pure: same inputs, same output.
    See the module docstring for the rules.
    """
    weight = float(table.weight)
    since = max(now - config.window_s, float(table.started_at or 0.0))
    st = summarise(stable_samples, since=since, until=now)
    ca = summarise(canary_samples, since=since, until=now)
    m = config.min_samples

    def decide(action: str, reasons: list[str], w: float = weight) -> Decision:
        return Decision(action, w, reasons, st, ca)

    if not getattr(table, "rollout_active", False):
        return decide("wait", ["no rollout is running"])
    counts = (f"canary {table.canary}: {ca.n} requests ({ca.errors} errors, {ca.cancelled} cancelled), "
              f"stable {table.stable}: {st.n} requests ({st.errors} errors) in the last {config.window_s:g} s")

    # 1. early error stop
    baseline = st.error_rate if st.n >= m else 0.0
    if ca.n < m and ca.errors and ca.errors / m > baseline + config.max_error_rate_delta:
        return decide("rollback", [
            f"error rate: canary has {ca.errors} errors in its first {ca.n} requests; at least "
            f"{_pct(ca.errors / m)} over {m} requests, above stable {_pct(baseline)} + "
            f"{_pct(config.max_error_rate_delta)} allowed", counts], 0.0)
    # 2./3. enough samples?
    if ca.n < m or st.n < m:
        short = [f"{side} has {s.n}/{m} samples" for side, s in (("canary", ca), ("stable", st)) if s.n < m]
        return decide("wait", [f"waiting: {', '.join(short)}", counts])

    # 4. compare
    failed: list[str] = []
    passed: list[str] = []
    delta = ca.error_rate - st.error_rate
    line = (f"error rate: canary {_pct(ca.error_rate)} ({ca.errors}/{ca.n}) vs stable {_pct(st.error_rate)} "
            f"({st.errors}/{st.n}), delta {_pct(delta)} (max {_pct(config.max_error_rate_delta)})")
    (failed if delta > config.max_error_rate_delta + 1e-12 else passed).append(line)
    need = max(1, m // 2)
    for label, cp, sp, cn, sn, ratio, slack in (
            ("TTFT p95", ca.ttft_p95_ms, st.ttft_p95_ms, ca.ttft_count, st.ttft_count,
             config.max_ttft_p95_ratio, config.ttft_slack_ms),
            ("ITL p95", ca.itl_p95_ms, st.itl_p95_ms, ca.itl_count, st.itl_count,
             config.max_itl_p95_ratio, config.itl_slack_ms)):
        if cn < need or sn < need or cp is None or sp is None:
            passed.append(f"{label}: not compared (canary {cn}, stable {sn} values; need {need} each)")
            continue
        limit = sp * ratio + slack
        line = (f"{label}: canary {_ms(cp)} vs stable {_ms(sp)} (limit {_ms(limit)} = "
                f"{ratio:g} x stable + {slack:g} ms)")
        (failed if cp > limit else passed).append(line)
    if failed:
        return decide("rollback", [*failed, counts], 0.0)

    # 5. pace
    last = float(table.started_at or 0.0)
    for d in table.decisions:
        if isinstance(d, Mapping) and isinstance(d.get("ts"), (int, float)):
            last = max(last, float(d["ts"]))
    if now - last < config.step_interval_s:
        return decide("wait", [f"healthy; next step in {config.step_interval_s - (now - last):.1f} s "
                               f"(step interval {config.step_interval_s:g} s)", *passed, counts])
    # 6. advance
    nxt = next_weight(table.steps, weight)
    if nxt >= 100.0:
        return decide("promote", [f"healthy at {weight:g}%: promoting canary {table.canary}", *passed, counts],
                      100.0)
    return decide("step", [f"healthy at {weight:g}%: canary weight {weight:g}% -> {nxt:g}%", *passed, counts], nxt)
