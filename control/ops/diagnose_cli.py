"""``actorserve diagnose``: scrape every actor's ``/metrics`` twice, print where time goes and what saturates.

The thin shell around :mod:`control.ops.diagnose`: it lists the metrics endpoints registered in etcd
(``/actorserve/metrics/{kind}/{id}``), scrapes each one at the start and at the end of ``--window-s``
seconds, reads each local actor's CPU time from ``/proc/<pid>/stat`` at the same moments (falling back to
its ``process_cpu_seconds_total``), builds a :class:`~control.ops.diagnose.Snapshot` and prints the
:class:`~control.ops.diagnose.Diagnosis` (``--json`` for machine-readable output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request
from typing import Any
from urllib.parse import urlparse

from control.ops.cli_errors import is_unreachable, report_unreachable
from control.ops import diagnose as policy

SCRAPE_TIMEOUT_S = 3.0
HISTOGRAMS = {  # Latency field -> gateway histogram
    "ttft": "actorserve_time_to_first_token_seconds",
    "e2e": "actorserve_e2e_request_latency_seconds",
    "queue": "actorserve_request_queue_time_seconds",
    "prefill": "actorserve_request_prefill_time_seconds",
    "decode": "actorserve_request_decode_time_seconds",
}
WORKER_GAUGES = {  # WorkerFigures field -> gauge
    "running": "actorserve_num_requests_running",
    "waiting": "actorserve_num_requests_waiting",
    "kv_usage": "actorserve_kv_cache_usage_perc",
    "batch_size": "actorserve_batch_size",
    "max_batch_size": "actorserve_max_batch_size",
    "generation_tps": "actorserve_generation_tokens_per_second",
}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_diagnose_command(sub: Any) -> None:
    """Add the ``diagnose`` verb to the CLI's subparsers ``sub``."""
    from actors.runtime import common_arguments

    p = sub.add_parser("diagnose", help="read live metrics: where time goes, which tier saturates, what to do",
                       description="Scrape every actor's /metrics (registered in etcd) twice, --window-s apart, "
                       "and print the latency breakdown, the saturated tier and actions in order.")
    common_arguments(p)
    p.add_argument("--window-s", type=_positive_float, default=5.0, metavar="S",
                   help="seconds between the two scrapes (default: 5)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=cmd_diagnose)


def _positive_float(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be positive")
    return v


# ---------------------------------------------------------------------------------------------
# collection


async def registered_endpoints(etcd_url: str) -> list[dict[str, Any]]:
    """Every ``{"url", "kind", "id", "pid"}`` registered under ``/actorserve/metrics/``."""
    from control.state.names import all_metrics_prefix
    from control.state.registry import Registry

    async with Registry.connect(etcd_url) as reg:
        found = await reg.get_prefix_json(all_metrics_prefix())
    return [v for v in found.values() if isinstance(v, dict) and v.get("url")]


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> list[Any] | None:
    """Samples (``prometheus_client`` Sample tuples) of one ``/metrics``; None when it does not answer.
    Only loopback http URLs are scraped (the endpoints are registered by local actors)."""
    from prometheus_client.parser import text_string_to_metric_families

    u = urlparse(url)
    if u.scheme != "http" or u.hostname not in _LOOPBACK:
        return None
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback http only)
            text = r.read().decode("utf-8", "replace")
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    except (OSError, ValueError):
        return None


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a local process from ``/proc/<pid>/stat`` (None if unreadable)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            stat = f.read()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _sum(samples: list[Any] | None, name: str, **labels: str) -> float | None:
    if not samples:
        return None
    vals = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(vals) if vals else None


def _take(endpoints: list[dict[str, Any]]) -> dict[str, tuple[float, list[Any] | None, float | None]]:
    """key -> (time, samples, /proc CPU seconds) of every endpoint, scraped now."""
    out = {}
    for ep in endpoints:
        key = f"{ep.get('kind')}/{ep.get('id')}"
        cpu = proc_cpu_seconds(ep["pid"]) if isinstance(ep.get("pid"), int) and \
            urlparse(ep["url"]).hostname in _LOOPBACK else None
        out[key] = (time.monotonic(), scrape(ep["url"]), cpu)
    return out


def build_snapshot(endpoints: list[dict[str, Any]], first: dict, second: dict, window_s: float) -> policy.Snapshot:
    """A policy snapshot from two scrapes (``_take`` results) of ``endpoints``."""
    actors, workers = [], {}
    sched_queue = 0.0
    hist_a: dict[str, list[float]] = {k: [0.0, 0.0] for k in HISTOGRAMS}  # [sum, count] first scrape
    hist_b: dict[str, list[float]] = {k: [0.0, 0.0] for k in HISTOGRAMS}
    for ep in endpoints:
        key = f"{ep.get('kind')}/{ep.get('id')}"
        kind = str(ep.get("kind"))
        t0, s0, c0 = first.get(key, (None, None, None))
        t1, s1, c1 = second.get(key, (None, None, None))
        if s1 is None:
            continue
        cpu = None
        if c0 is not None and c1 is not None and t1 > t0:
            cpu = (c1 - c0) / (t1 - t0)
        else:
            p0, p1 = _sum(s0, "process_cpu_seconds_total"), _sum(s1, "process_cpu_seconds_total")
            if p0 is not None and p1 is not None and t0 is not None and t1 > t0:
                cpu = (p1 - p0) / (t1 - t0)
        actors.append(policy.ActorFigures(kind, str(ep.get("id")), cpu, _sum(s1, "actorserve_event_loop_lag_seconds")))
        if kind == "gateway":
            for field, name in HISTOGRAMS.items():
                for acc, samples in ((hist_a, s0), (hist_b, s1)):
                    acc[field][0] += _sum(samples, name + "_sum") or 0.0
                    acc[field][1] += _sum(samples, name + "_count") or 0.0
        if kind == "scheduler":
            sched_queue += sum(s.value for s in s1 if s.name == "actorserve_num_requests_waiting"
                               and "worker" not in s.labels)
        if kind == "worker":
            by_worker: dict[str, dict[str, Any]] = {}
            for s in s1:
                for field, name in WORKER_GAUGES.items():
                    if s.name == name and "worker" in s.labels:
                        w = by_worker.setdefault(s.labels["worker"], {"model": s.labels.get("model", "")})
                        w[field] = w.get(field, 0.0) + s.value
            for wid, vals in by_worker.items():
                workers[wid] = policy.WorkerFigures(wid, **vals)
    lat = _latency(hist_a, hist_b)
    return policy.Snapshot(window_s, tuple(actors), tuple(workers.values()), sched_queue, lat)


def _latency(a: dict[str, list[float]], b: dict[str, list[float]]) -> policy.Latency | None:
    """Means over the window (deltas); since start when nothing completed in the window."""
    n = b["e2e"][1] - a["e2e"][1]
    src, base = "window", a
    if n <= 0:
        n, src, base = b["e2e"][1], "cumulative", {k: [0.0, 0.0] for k in a}
    if n <= 0:
        return None

    def mean(k: str) -> float:
        c = b[k][1] - base[k][1]
        return (b[k][0] - base[k][0]) / c if c > 0 else 0.0
    return policy.Latency(requests=n, source=src, **{k: mean(k) for k in HISTOGRAMS})


async def collect(etcd_url: str, window_s: float) -> policy.Snapshot:
    """List the endpoints, scrape them ``window_s`` apart, return the snapshot."""
    endpoints = await registered_endpoints(etcd_url)
    first = await asyncio.to_thread(_take, endpoints)
    await asyncio.sleep(window_s)
    second = await asyncio.to_thread(_take, endpoints)
    return build_snapshot(endpoints, first, second, window_s)


# ---------------------------------------------------------------------------------------------
# output


def report_dict(snap: policy.Snapshot, dx: policy.Diagnosis) -> dict[str, Any]:
    """The JSON document ``--json`` prints: verdict, breakdown, actions and the figures behind them."""
    from dataclasses import asdict

    d = dx.to_dict()
    return {"verdict": {"bottleneck": d["bottleneck"], "saturated": d["saturated"], "summary": d["summary"],
                        "dominant_stage": d["dominant_stage"], "evidence": d["evidence"]},
            "breakdown": d["breakdown"], "actions": d["actions"], "snapshot": asdict(snap)}


def print_report(snap: policy.Snapshot, dx: policy.Diagnosis) -> None:
    """The human-readable report."""
    print(f"verdict: {dx.summary}")
    lat = snap.latency
    if dx.breakdown and lat is not None:
        print(f"\nwhere time goes ({lat.requests:.0f} requests, {lat.source} means; TTFT {lat.ttft * 1e3:.0f} ms, "
              f"e2e {lat.e2e * 1e3:.0f} ms):")
        for stage in policy.STAGES:
            b = dx.breakdown[stage]
            print(f"  {stage:<11} {b['mean_s'] * 1e3:9.1f} ms  {b['share'] * 100:5.1f}%  {'#' * round(b['share'] * 40)}")
    else:
        print("\nwhere time goes: no completed requests yet")
    print("\ntiers:")
    for a in sorted(snap.actors, key=lambda a: (a.kind, a.id)):
        cpu = f"{a.cpu_cores * 100:5.0f}%" if a.cpu_cores is not None else "    -"
        lag = f"{a.loop_lag_s * 1e3:7.1f} ms" if a.loop_lag_s is not None else "       -"
        print(f"  {a.kind:<10} {a.id:<24} CPU {cpu}  loop lag {lag}")
    for w in snap.workers:
        print(f"  worker     {w.id:<24} running {w.running:.0f}/{w.max_batch_size:.0f}  waiting {w.waiting:.0f}  "
              f"KV {w.kv_usage * 100:.0f}%  batch {w.batch_size:.1f}  {w.generation_tps:.0f} tok/s")
    print(f"  scheduler queue: {snap.scheduler_queue:.0f}")
    if dx.saturated:
        print("\nsaturated: " + ", ".join(f"{t} ({'; '.join(dx.evidence.get(t, []))})" for t in dx.saturated))
    print("\nactions, in order:")
    for i, act in enumerate(dx.actions, 1):
        print(f"  {i}. {act.action}\n     why: {act.reason}")


def cmd_diagnose(args: argparse.Namespace) -> int:
    """Run ``actorserve diagnose``: 0 on a report, 3 (control/ops/cli_errors.py) when etcd or every
    metrics endpoint is unreachable."""
    from actors.runtime import resolve_endpoints

    _, etcd_url = resolve_endpoints(args, need_nats=False)
    try:
        snap = asyncio.run(collect(etcd_url, args.window_s))
    except Exception as e:  # etcd down
        if not is_unreachable(e):
            raise
        return report_unreachable("etcd", etcd_url, e)
    if not snap.actors:
        return report_unreachable("every actor metrics endpoint registered in etcd", None)
    dx = policy.diagnose(snap)
    if args.json:
        print(json.dumps(report_dict(snap, dx), indent=2, sort_keys=True))
    else:
        print_report(snap, dx)
    return 0
