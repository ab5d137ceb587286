"""Result keys, target checks and the printed table of ``actorserve bench fairness`` (pure: dicts in, dicts
and text out; unit-tested in tests/unit/test_fairness_bench.py). Targets are issue 23's."""

from __future__ import annotations

from bench.fairness_workload import Result, counts, error_sample, finite, pct, ttft_stats

PHASES = ("capacity", "solo", "fair", "flood", "split", "three", "overload", "fcfs")  # run order
B_PHASES = ("solo", "fair", "flood", "fcfs")
MIN_B_SAMPLES = 300  # p99 over >= 300 of B's requests per phase


def timing_pct(timings: list[dict], q: float = 0.5) -> dict[str, float]:
    """q-quantile of each server-side timing key (ms) over ``timings`` (usage.actorserve_timing dicts)."""
    keys = sorted({k for t in timings for k in t if k != "decode_ms"})
    return {k: round(pct([float(t[k]) for t in timings if k in t], q), 1) for k in keys}


def b_phase_keys(name: str, results: list[Result]) -> dict:
    """JSON keys of B in phase ``name``: TTFT p50/p95/p99 (ms) and sample count, outcome counts, and the
    p50/p99 of server-side stage timings."""
    st, c = ttft_stats(results), counts(results)
    timings = [r.timing for r in results if r.status == "ok"]
    out = {f"b_{name}_ttft_{q}_ms": round(st[q], 1) for q in ("p50", "p95", "p99")}
    out[f"b_{name}_n"], out[f"b_{name}_sent"] = st["n"], len(results)
    out.update({f"b_{name}_{k}": v for k, v in c.items()})
    out[f"b_{name}_errors"] = error_sample(results)
    out[f"b_{name}_timing_p50_ms"] = timing_pct(timings, 0.5)
    out[f"b_{name}_timing_p99_ms"] = timing_pct(timings, 0.99)
    return out


def _ratio(res: dict, num: str, den: str) -> float:
    a, b = res.get(num), res.get(den)
    return round(a / b, 3) if finite(a) and finite(b) and b > 0 else float("nan")


def add_ratios(res: dict) -> None:
    """Add the ratio keys derived from B's phases (NaN where a phase did not run)."""
    res["b_fair_solo_p99_ratio"] = _ratio(res, "b_fair_ttft_p99_ms", "b_solo_ttft_p99_ms")
    res["b_fair_solo_p95_ratio"] = _ratio(res, "b_fair_ttft_p95_ms", "b_solo_ttft_p95_ms")
    res["b_fair_fcfs_p99_ratio"] = _ratio(res, "b_fair_ttft_p99_ms", "b_fcfs_ttft_p99_ms")
    res["interactive_under_batch_flood_ratio"] = _ratio(res, "b_flood_ttft_p99_ms", "b_solo_ttft_p99_ms")


def targets(res: dict) -> list[tuple[str, float, str, bool | None]]:
    """``(figure, value, target, met)`` for every target of the issue; met is None when not measured."""
    add_ratios(res)
    nan = float("nan")
    split = res.get("weighted_split_ratio", nan)
    b_n = [res[f"b_{p}_sent"] for p in B_PHASES if f"b_{p}_sent" in res]
    rows = [
        ("B fair/solo TTFT p99", res["b_fair_solo_p99_ratio"], "<= 2", lambda v: v <= 2),
        ("B fair/solo TTFT p95", res["b_fair_solo_p95_ratio"], "<= 2", lambda v: v <= 2),
        ("B fair/fcfs TTFT p99", res["b_fair_fcfs_p99_ratio"], "<= 0.25", lambda v: v <= 0.25),
        ("3:1 service-token split", split, "3.0 +- 0.3", lambda v: abs(v - 3.0) <= 0.3),
        ("1:2:3 max share error", res.get("three_tenant_max_share_error", nan), "<= 0.10", lambda v: v <= 0.10),
        ("overload goodput / capacity", res.get("overload_goodput_fraction", nan), ">= 0.8", lambda v: v >= 0.8),
        ("overload hung requests", res.get("overload_hung", nan), "0", lambda v: v == 0),
        ("overload max lateness (x deadline)", res.get("overload_max_lateness_frac", nan), "<= 0.10",
         lambda v: v <= 0.10),
        ("overload late fraction", res.get("overload_late_fraction", nan), "0 (none > 10 % late)", lambda v: v == 0),
        ("  accepted, then ended at the deadline", res.get("overload_expired_fraction", nan), "(informational)",
         lambda v: True),
        ("overload RSS growth max (MiB)", res.get("overload_rss_growth_max_mib", nan), "<= 50", lambda v: v <= 50),
        ("  of which in its second half (MiB)", res.get("overload_rss_growth_second_half_max_mib", nan), "(leak check)",
         lambda v: v <= 25),
        ("interactive p99 under batch flood / solo", res["interactive_under_batch_flood_ratio"], "<= 1.5",
         lambda v: v <= 1.5),
        ("B requests sent per phase (min)", min(b_n) if b_n else nan, f">= {MIN_B_SAMPLES}",
         lambda v: v >= MIN_B_SAMPLES),
    ]
    return [(name, v, tgt, bool(test(v)) if finite(v) else None) for name, v, tgt, test in rows]


def _fmt(v) -> str:
    return f"{v:,.3f}" if isinstance(v, float) else str(v)


def table_lines(res: dict) -> list[str]:
    """The human-readable summary: capacity, B's TTFT per phase, then every target with its verdict."""
    lines = [f"workload: {res.get('workload')}",
             f"capacity: {res.get('capacity_req_s')} req/s {res.get('capacity_counts')}; B offered "
             f"{res.get('b_rate_req_s')} req/s, A 10x that"]
    for p in B_PHASES:
        if f"b_{p}_n" not in res:
            continue
        q = " ".join(f"{k} {res[f'b_{p}_ttft_{k}_ms']:9.1f}" for k in ("p50", "p95", "p99"))
        lines.append(f"  B TTFT {p:5s} (ms): {q}   ok={res[f'b_{p}_n']}/{res[f'b_{p}_sent']} "
                     f"refused={res[f'b_{p}_refused']} expired={res[f'b_{p}_expired']} failed={res[f'b_{p}_failed']} "
                     f"hung={res[f'b_{p}_hung']}")
        for q in ("p50", "p99"):
            t = res.get(f"b_{p}_timing_{q}_ms") or {}
            lines.append(f"      server-side {q} (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in t.items()))
        lines += [f"      error: {e}" for e in res.get(f"b_{p}_errors", [])]
    if "overload_offered_req_s" in res:
        lines.append(f"  overload: offered {res['overload_offered_req_s']:.1f} req/s, goodput "
                     f"{res['overload_goodput_req_s']:.2f} req/s; ok {res['overload_ok']} refused "
                     f"{res['overload_refused']} expired {res['overload_expired']} failed {res['overload_failed']} "
                     f"hung {res['overload_hung']}; deadline p50 {res['overload_deadline_p50_ms']:.0f} ms")
        lines += [f"      error: {e}" for e in res.get("overload_errors", [])]
        lines.append(f"      client event-loop lag max {res.get('overload_client_loop_lag_max_ms')} ms; hung sent at "
                     f"{res.get('overload_hung_sent_s')} s; late ok requests' server p50 "
                     f"{res.get('overload_late_timing_p50_ms')}")
    lines.append(f"  {'figure':42s} {'value':>12s}  {'target':22s} met")
    for name, v, tgt, ok in targets(res):
        lines.append(f"  {name:42s} {_fmt(v):>12s}  {tgt:22s} {'-' if ok is None else 'yes' if ok else 'NO'}")
    if "bench_wall_s" in res:
        lines.append(f"  wall time {res['bench_wall_s']:.0f} s")
    return lines


def print_table(res: dict) -> None:
    """Print ``table_lines``."""
    print("\n".join(table_lines(res)))
