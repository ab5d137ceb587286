"""Chaos results: collected per fault phase while the tests run, rendered as a table at the end of the
session (tests/chaos/conftest.py) and written as JSON (the pytest temp dir, plus ``$ACTORSERVE_CHAOS_REPORT``
when set)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.chaos.load import PhaseResult

#: every phase run in this session, in order
RESULTS: list[PhaseResult] = []
#: where the JSON report went (filled by write_json)
WRITTEN: list[Path] = []

COLUMNS = ("sent", "in_flight_at_fault", "completed", "retryable", "failed", "hung",
           "jobs_submitted", "jobs_completed", "jobs_failed", "jobs_lost")
HEADERS = ("fault", "sent", "in flight at fault", "completed", "retryable", "failed", "hung",
           "jobs sub", "jobs done", "jobs failed", "jobs lost", "recovered s")


def totals(results: list[PhaseResult]) -> dict[str, int]:
    """Sum of every phase's counts."""
    out = {c: 0 for c in COLUMNS}
    for r in results:
        counts = r.counts()
        for c in COLUMNS:
            out[c] += counts[c]
    return out


def render_table(results: list[PhaseResult]) -> str:
    """A fixed-width table: one row per fault plus a total row (Markdown-compatible)."""
    rows = []
    for r in results:
        c = r.counts()
        rec = "-" if r.recovered_s is None else f"{r.recovered_s:.1f}"
        rows.append([r.name, *(str(c[k]) for k in COLUMNS), rec])
    t = totals(results)
    rows.append(["total", *(str(t[k]) for k in COLUMNS), ""])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(HEADERS)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                 enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(HEADERS), sep, *(line(row) for row in rows)])


def write_json(results: list[PhaseResult], *paths: Path | str | None) -> list[Path]:
    """Write the full report (counts, totals, every request and job) to each given path (None skipped)
    and to ``$ACTORSERVE_CHAOS_REPORT`` when set; returns the paths written."""
    data = {"phases": [r.as_dict() for r in results], "totals": totals(results)}
    targets = [Path(p) for p in paths if p]
    if os.environ.get("ACTORSERVE_CHAOS_REPORT"):
        targets.append(Path(os.environ["ACTORSERVE_CHAOS_REPORT"]))
    for p in targets:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=1) + "\n")
    WRITTEN[:] = targets
    return targets
