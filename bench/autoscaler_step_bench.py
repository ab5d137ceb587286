"""A 3x load step on a live autoscaled stack: how soon the new worker takes traffic (issue [13] target:
within its cold start + 2 s of the step; docs/autoscaling.md, docs/bench.md).

Each run starts its own ``actorserve up`` stack (Supervisor, the tiny random-weight model, 1-slot workers,
the autoscaler with the short cool-downs of ``tests/cluster/test_autoscaler_live.py``), idles 4 s,
calibrates the base rate (45 % of what one worker serves), runs it 6 s, steps it 3x and records, in seconds
after the step: the new worker's spawn (the decision), its lease (spawn -> lease = its cold start, as the
supervisor and the schedulers count it) and its first dispatch (it takes traffic). The margin is
cold start + 2 s - first dispatch: >= 0 meets the target. A run where a worker was added before the step
(at the base load) is counted, but not timed.

The scenario and its figures are the live test's own (``step_scenario``, ``step_figures``); that test asserts
only a loose bound, since one run of a timing race is not a measurement (a timing target lives in a bench).

    python -m bench.autoscaler_step_bench [--runs 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any


def one_run(tiny: str, state: Path) -> dict[str, Any]:
    """One stack, one step: the figures of :func:`step_figures`, or ``{"base_scale_up": reason}``."""
    from tests.cluster.test_autoscaler_live import live_stack, step_figures, step_scenario

    with live_stack(state, tiny, autoscaler=True) as sup:
        out = asyncio.run(step_scenario(sup, keep_load=False))
        early = [e for e in out["base_log"] if e["kind"] == "worker"]
        if early:
            return {"base_scale_up": early[0]["reason"]}
        f = step_figures(sup, out)
        f["failed"] = sum(1 for r in out["results"] if r.kind != "ok")
        f["requests"] = len(out["results"])
        return f


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Runs timed, met, median / min / max margin and first-dispatch delay (s)."""
    timed = [r for r in runs if "margin" in r]
    margins = [round(r["margin"], 2) for r in timed]
    return {"runs": len(runs), "timed": len(timed), "met": sum(1 for m in margins if m >= 0),
            "base_scale_ups": len(runs) - len(timed),
            "margin_median_s": statistics.median(margins) if margins else None,
            "margin_min_s": min(margins, default=None), "margin_max_s": max(margins, default=None),
            "decision_median_s": round(statistics.median(r["decision"] for r in timed), 2) if timed else None,
            "failed_requests": sum(r["failed"] for r in timed)}


def main(argv: list[str] | None = None) -> int:
    """Run the step ``--runs`` times; print one line per run and a summary; 0 unless a run crashed."""
    import os

    from bench.cold_start_bench import cpu_name
    from tests.engine_fixtures import write_tiny_llama_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="stacks, one 3x step each (about 35 s per run)")
    ap.add_argument("--json", metavar="PATH", help="write the runs and the summary as JSON")
    args = ap.parse_args(argv)
    print(f"CPU: {cpu_name() or '?'}, {os.cpu_count()} cores")
    runs = []
    with tempfile.TemporaryDirectory(prefix="as-step-") as tmp:
        tiny = str(Path(tmp) / "tiny.gguf")
        write_tiny_llama_gguf(tiny)
        for i in range(args.runs):
            r = one_run(tiny, Path(tmp) / f"state-{i}")
            runs.append(r)
            if "base_scale_up" in r:
                print(f"run {i + 1}: a worker was added at the base load ({r['base_scale_up']}): not timed")
                continue
            print(f"run {i + 1}: decision {r['decision']:.2f} s, cold start {r['cold']:.2f} s, first dispatch "
                  f"{r['traffic']:.2f} s after the step: target {r['cold'] + 2:.2f} s "
                  f"{'met' if r['margin'] >= 0 else 'MISSED'} (margin {r['margin']:+.2f} s); "
                  f"{r['failed']}/{r['requests']} requests failed")
    s = summary(runs)
    print(f"summary: {s['met']}/{s['timed']} timed runs met cold start + 2 s (margin median "
          f"{s['margin_median_s']}, min {s['margin_min_s']}, max {s['margin_max_s']} s; decision median "
          f"{s['decision_median_s']} s); {s['base_scale_ups']} run(s) scaled up at the base load; "
          f"{s['failed_requests']} failed requests")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": s}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
