"""Pure parts of ``actorserve bench fairness`` (bench/fairness_bench.py): the request distribution, the
per-request result record and the figures computed from results. No clock reads, no I/O besides parsing
text handed in: everything here is unit-tested (tests/unit/test_fairness_bench.py).

Request distribution (seeded; the same ``--seed`` gives the same requests in every run):
- request ``i`` of stream ``tag`` (e.g. ``"fair-b"``) draws from ``random.Random(f"{seed}/{tag}/{i}")``;
- its prompt starts with the unique marker ``"[<tag>-<i>]"`` (so consecutive prompts share no prefix past
  the chat template, and the prefix cache cannot serve them all from one cached prompt), followed by
  ``words`` words drawn uniformly with replacement from the fixed 64-word list ``WORDS``, with ``words``
  ~ uniform integer in ``[prompt_words_lo, prompt_words_hi]`` (default 4..24; about one token a word, and
  the marker and the chat template add about 45 tokens: 62 prompt tokens on average);
- its output length ``max_tokens`` ~ uniform integer in ``[out_tokens_lo, out_tokens_hi]`` (default
  2..12), sent with ``ignore_eos`` so every completed request generates exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from actors.scheduler.fair_queue import service_tokens

WORDS = (
    "sea", "river", "mountain", "city", "forest", "desert", "island", "harbor", "bridge", "tower", "garden",
    "market", "winter", "summer", "morning", "evening", "history", "music", "science", "language", "number",
    "engine", "window", "letter", "journey", "storm", "light", "shadow", "stone", "paper", "glass", "silver",
    "orange", "yellow", "quiet", "ancient", "modern", "small", "large", "simple", "strange", "bright", "slow",
    "quick", "explain", "describe", "compare", "imagine", "remember", "build", "travel", "write", "count",
    "teacher", "sailor", "farmer", "doctor", "painter", "kitchen", "library", "school", "station", "planet",
    "ocean",
)
HUNG_MARGIN_S = 5.0  # a request with no answer by its deadline + this is "hung"


@dataclass(frozen=True)
class Workload:
    """Ranges of the request distribution (inclusive; see the module docstring)."""

    prompt_words_lo: int = 4
    prompt_words_hi: int = 24
    out_tokens_lo: int = 2
    out_tokens_hi: int = 12
    seed: int = 0

    def __post_init__(self) -> None:
        if not (1 <= self.prompt_words_lo <= self.prompt_words_hi and 1 <= self.out_tokens_lo <= self.out_tokens_hi):
            raise ValueError("ranges must satisfy 1 <= lo <= hi")

    def describe(self) -> str:
        """One line stating the distribution (printed and written to the JSON)."""
        return (f"seed {self.seed}; unique '[tag-i]' prefix + U{{{self.prompt_words_lo}..{self.prompt_words_hi}}} "
                f"words from a {len(WORDS)}-word list; max_tokens ~ U{{{self.out_tokens_lo}..{self.out_tokens_hi}}}, "
                "ignore_eos")


@dataclass(frozen=True)
class Spec:
    """One request to send: its prompt, word count and output length (tokens)."""

    prompt: str
    words: int
    max_tokens: int


def spec(workload: Workload, tag: str, i: int) -> Spec:
    """Request ``i`` of stream ``tag`` (deterministic in ``(workload.seed, tag, i)``)."""
    rng = random.Random(f"{workload.seed}/{tag}/{i}")
    words = rng.randint(workload.prompt_words_lo, workload.prompt_words_hi)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return Spec(f"[{tag}-{i}] {text}", words, rng.randint(workload.out_tokens_lo, workload.out_tokens_hi))


@dataclass
class Result:
    """Client-side outcome of one request. Times in seconds (client monotonic clock) or ms as named.

    ``status``: ``ok`` (200 and the final usage chunk, no error), ``refused`` (429/503), ``expired``
    (accepted but ended by its deadline: 408/504, or an error event naming the deadline), ``failed``
    (anything else that answered), ``hung`` (no answer by deadline + ``HUNG_MARGIN_S``)."""

    tenant: str
    sent: float
    deadline_ms: int
    words: int
    max_tokens: int
    status: str = "failed"
    http_status: int = 0
    ttft_ms: float | None = None
    e2e_ms: float | None = None  # send -> final chunk (ok) or -> answer (others)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: dict = field(default_factory=dict)  # usage.actorserve_timing (server stage ms)
    error: str = ""  # start of the error body / event, or the exception, when not ok

    @property
    def done(self) -> float:
        """Client time (s) the answer ended."""
        return self.sent + (self.e2e_ms or 0.0) / 1e3

    @property
    def service(self) -> float:
        """Weighted service tokens of an ok request (``fair_queue.service_tokens``), else 0."""
        return service_tokens(self.prompt_tokens, self.completion_tokens) if self.status == "ok" else 0.0


def refusal_status(http_status: int, body: str) -> str:
    """Status of a non-200 answer: ``expired`` for a deadline that passed after acceptance (code
    ``deadline_exceeded``, or 408/504), ``refused`` for any other 429/503 (queue full, deadline
    unmeetable: refused at once), else ``failed``."""
    if "deadline_exceeded" in body or http_status in (408, 504):
        return "expired"
    return "refused" if http_status in (429, 503) else "failed"


def pct(values: list[float], q: float) -> float:
    """q-quantile (0..1) by nearest rank; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def ttft_stats(results: list[Result]) -> dict[str, float]:
    """``{"p50", "p95", "p99": TTFT ms, "n": ok samples}`` over the ok results."""
    ttft = [r.ttft_ms for r in results if r.status == "ok" and r.ttft_ms is not None]
    return {"p50": pct(ttft, 0.5), "p95": pct(ttft, 0.95), "p99": pct(ttft, 0.99), "n": len(ttft)}


def counts(results: list[Result]) -> dict[str, int]:
    """Number of results per status (every status key present)."""
    out = dict.fromkeys(("ok", "refused", "expired", "failed", "hung"), 0)
    for r in results:
        out[r.status] += 1
    return out


def error_sample(results: list[Result], k: int = 3) -> list[str]:
    """Up to ``k`` distinct error texts (with their status) of the results, for the report."""
    seen: dict[str, None] = {}
    for r in results:
        if r.error and len(seen) < k:
            seen.setdefault(f"{r.status} {r.http_status}: {r.error}", None)
    return list(seen)


def window_sum(results: list[Result], t0: float, t1: float, value: str = "service") -> float:
    """Sum of ``value`` (``"service"`` or ``"completion_tokens"``) over ok results done in ``[t0, t1]``."""
    return sum(getattr(r, value) for r in results if r.status == "ok" and t0 <= r.done <= t1)


def share_errors(served: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Relative error of each tenant's share of ``served`` against its weight's share:
    ``(share_i - w_i / sum w) / (w_i / sum w)``; NaN for all when nothing was served."""
    total, wsum = sum(served.values()), sum(weights.values())
    if total <= 0:
        return {t: float("nan") for t in weights}
    return {t: (served.get(t, 0.0) / total - w / wsum) / (w / wsum) for t, w in weights.items()}


def fit_latency(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares ``e2e_ms ~ a + b * words + c * max_tokens`` over ``(words, max_tokens, e2e_ms)``;
    returns ``(a, b, c)``. With too few or degenerate samples: ``(median e2e, 0, 0)``."""
    import numpy as np

    if len(samples) < 6:
        return (pct([s[2] for s in samples], 0.5) if samples else 1000.0, 0.0, 0.0)
    x = np.array([[1.0, s[0], s[1]] for s in samples])
    y = np.array([s[2] for s in samples])
    coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    if rank < 3:
        return (float(np.median(y)), 0.0, 0.0)
    return tuple(float(v) for v in coef)


def deadline_ms(model: tuple[float, float, float], words: int, max_tokens: int, factor: float = 2.0,
                floor_ms: int = 100) -> int:
    """``factor`` x the solo latency ``model`` predicts for a request of this shape (ms), at least
    ``floor_ms``."""
    a, b, c = model
    return max(floor_ms, int(round(factor * (a + b * words + c * max_tokens))))


def overload_summary(results: list[Result], t0: float, duration_s: float, capacity: float) -> dict:
    """Figures of the overload phase. ``results``: every request sent from ``t0`` for ``duration_s``;
    ``capacity``: measured req/s. Goodput counts ok requests finished within their deadline and within
    the phase window; lateness is ``e2e / deadline - 1`` of ok requests; ``late_fraction``: accepted
    requests (ok or expired) that finished more than 10 % past their deadline; ``expired_fraction``:
    accepted requests the stack ended at their deadline with an error (no answer, but not a late one)."""
    c = counts(results)
    ok = [r for r in results if r.status == "ok"]
    in_time = [r for r in ok if r.e2e_ms <= r.deadline_ms and t0 <= r.done <= t0 + duration_s]
    late = [r for r in ok if r.e2e_ms > 1.1 * r.deadline_ms]
    accepted = len(ok) + c["expired"]
    lateness = [r.e2e_ms / r.deadline_ms - 1.0 for r in ok]
    goodput = len(in_time) / duration_s
    return {
        "offered_req_s": len(results) / duration_s, "goodput_req_s": goodput,
        "goodput_fraction": goodput / capacity if capacity > 0 else float("nan"),
        "completed_req_s": sum(1 for r in ok if t0 <= r.done <= t0 + duration_s) / duration_s,
        **c, "answered": len(results) - c["hung"], "accepted": accepted,
        "late_fraction": len(late) / accepted if accepted else 0.0,
        "expired_fraction": c["expired"] / accepted if accepted else 0.0,
        "max_lateness_frac": max(lateness) if lateness else float("nan"),
        "max_lateness_ms": max((r.e2e_ms - r.deadline_ms for r in ok), default=float("nan")),
        "deadline_p50_ms": pct([float(r.deadline_ms) for r in results], 0.5),
    }


def vm_rss_kib(status_text: str) -> int | None:
    """``VmRSS`` (KiB) from the text of ``/proc/<pid>/status``; None when absent (zombie, kernel thread)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def rss_growth_mib(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Growth (MiB) per process present in both ``before`` and ``after`` (``{name: VmRSS KiB}``)."""
    return {k: round((after[k] - before[k]) / 1024, 1) for k in before if k in after}


def finite(x: float) -> bool:
    """True for a real number (not NaN/inf/None)."""
    return isinstance(x, (int, float)) and math.isfinite(x)
