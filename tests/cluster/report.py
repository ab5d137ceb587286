"""Cluster results: every attempt classified once the fault's times are known, one table row per fault,
printed at the end of the session (tests/cluster/conftest.py) and written as JSON (the pytest temp dir,
plus ``$ACTORSERVE_CLUSTER_REPORT`` when set). The table renderer is tests/chaos/report.py's layout.

How an attempt is counted (tests/cluster/loadgen.py records the raw facts):

* ``ok`` -- a complete answer;
* ``retry_before`` -- a retryable error before the first token: 429 / 5xx with ``Retry-After``, or an
  in-stream error marked retryable before any text;
* ``after_first`` -- a stream that had sent text and then ended with a retryable in-stream error (its
  worker was lost; through a surviving gateway);
* ``severed`` -- the attempt went to a gateway on the lost host during the fault (refused, reset, cut,
  connect timeout, no answer) -- the client's own connection was lost with its gateway;
* ``hung`` -- no final answer within deadline + grace from a gateway that was not lost;
* ``failed`` -- anything else: a non-retryable error, a transport error or cut stream from a surviving
  gateway, a stream error that says not to retry.

Idempotency: every key whose attempts (and the replay sent after the fault) produced more than one
distinct complete text counts in ``idem_conflicts``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

OUTCOMES = ("ok", "retry_before", "after_first", "severed", "hung", "failed")
COLUMNS = ("sent", "keys", *OUTCOMES, "jobs_submitted", "jobs_completed", "jobs_failed", "jobs_lost",
           "idem_checked", "idem_conflicts")
HEADERS = ("fault", "sent", "keys", "ok", "retry before 1st tok", "failed after 1st tok", "severed", "hung",
           "failed", "jobs sub", "jobs done", "jobs failed", "jobs lost", "idem keys", "idem 2 results",
           "full service s", "all back s")

#: every phase of this session, in order
RESULTS: list["ClusterPhase"] = []
#: where the JSON report went
WRITTEN: list[Path] = []


def classify(a: dict, lost_gateways: set[int], window: tuple[float, float] | None) -> str:
    """The outcome of one raw attempt (see the module docstring). ``window``: (from, to) monotonic times
    during which the gateways in ``lost_gateways`` were lost (killed / partitioned, until serving again)."""
    if a["raw"] == "ok":
        return "ok"
    lost = (window is not None and a["gateway"] in lost_gateways
            and a["sent_at"] <= window[1] and (a["ended_at"] or a["sent_at"]) >= window[0])
    if a["raw"] in ("transport", "timeout", "incomplete") and lost:
        return "severed"
    if a["raw"] == "timeout":
        return "hung"
    if a["raw"] == "http_error":
        return "retry_before" if a["retryable"] else "failed"
    if a["raw"] == "stream_error" and a["retryable"]:
        return "after_first" if a["first_token_at"] is not None else "retry_before"
    return "failed"


@dataclass
class ClusterPhase:
    """One fault phase: its raw attempts and jobs, the fault's times, recovery figures."""

    name: str
    note: str = ""
    attempts: list[dict] = field(default_factory=list)
    jobs: list[dict] = field(default_factory=list)
    lost_gateways: set[int] = field(default_factory=set)
    fault_at: float | None = None
    fault_end: float | None = None
    lost_window: tuple[float, float] | None = None
    full_service_s: float | None = None  # fault end -> every gateway answers a probe
    all_back_s: float | None = None  # fault end -> every process, member and registration back
    idem: dict[str, list[str]] = field(default_factory=dict)  # key -> distinct digests seen
    idem_checked: int = 0
    replay_problems: list[str] = field(default_factory=list)

    def outcome(self, a: dict) -> str:
        """The classified outcome of attempt ``a``."""
        return classify(a, self.lost_gateways, self.lost_window)

    def counts(self) -> dict[str, int]:
        """The table row's numbers."""
        c = {"sent": len(self.attempts), "keys": len({a["key"] for a in self.attempts})}
        for o in OUTCOMES:
            c[o] = 0
        for a in self.attempts:
            c[self.outcome(a)] += 1
        accepted = {j["id"]: j for j in self.jobs if j["submit"] == "accepted"}
        c["jobs_submitted"] = len(accepted)
        c["jobs_completed"] = sum(j["status"] == "completed" for j in accepted.values())
        c["jobs_failed"] = sum(j["status"] == "failed" for j in accepted.values())
        c["jobs_lost"] = c["jobs_submitted"] - c["jobs_completed"] - c["jobs_failed"]
        c["idem_checked"] = self.idem_checked
        c["idem_conflicts"] = sum(len(d) > 1 for d in self.idem.values())
        return c

    def last_error_s(self) -> float | None:
        """Seconds from the fault's end to the end of the last attempt that was neither ok nor severed
        (how long clients still saw errors; negative: none after the end), None without a fault."""
        if self.fault_end is None:
            return None
        ends = [a["ended_at"] for a in self.attempts if self.outcome(a) not in ("ok", "severed")]
        return round(max(ends) - self.fault_end, 1) if ends else None

    def as_dict(self) -> dict:
        """Counts, times and every attempt (with its outcome) and job, for the JSON report."""
        return {"name": self.name, "note": self.note, "counts": self.counts(), "fault_at": self.fault_at,
                "fault_end": self.fault_end, "lost_gateways": sorted(self.lost_gateways),
                "lost_window": self.lost_window, "full_service_s": self.full_service_s,
                "all_back_s": self.all_back_s,
                "last_error_after_end_s": self.last_error_s(),
                "replay_problems": self.replay_problems,
                "idem_conflicts": {k: v for k, v in self.idem.items() if len(v) > 1},
                "attempts": [{**a, "outcome": self.outcome(a)} for a in self.attempts], "jobs": self.jobs}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render_table(results: list[ClusterPhase]) -> str:
    """One row per fault plus a total row (Markdown-compatible, fixed width)."""
    rows, total = [], {c: 0 for c in COLUMNS}
    for r in results:
        c = r.counts()
        for k in COLUMNS:
            total[k] += c[k]
        rows.append([r.name, *(str(c[k]) for k in COLUMNS), _fmt(r.full_service_s), _fmt(r.all_back_s)])
    rows.append(["total", *(str(total[k]) for k in COLUMNS), "", ""])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(HEADERS)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEADERS), sep, *(line(row) for row in rows)])


def write_json(results: list[ClusterPhase], *paths: Path | str | None, extra: dict | None = None) -> list[Path]:
    """Write the report to each path given (None skipped) and to ``$ACTORSERVE_CLUSTER_REPORT``."""
    data = {"phases": [r.as_dict() for r in results], **(extra or {})}
    targets = [Path(p) for p in paths if p]
    if os.environ.get("ACTORSERVE_CLUSTER_REPORT"):
        targets.append(Path(os.environ["ACTORSERVE_CLUSTER_REPORT"]))
    for p in targets:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=1) + "\n")
    WRITTEN[:] = targets
    return targets
