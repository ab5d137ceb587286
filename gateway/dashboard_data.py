"""The operator dashboard's figures (pure: no I/O, every time is an argument): :class:`Traffic` and
:func:`build_snapshot`, the JSON of ``GET /dashboard/data`` (gateway/dashboard.py, docs/dashboard.md).

Sources, all read by the gateway shell (gateway/dashboard_feed.py):

* completion records (``as.int.done.*.*``, every record of the deployment, not the metrics queue group):
  traffic per model version over :data:`RATE_WINDOW_S` (requests/s, prompt and generated tokens/s) and
  latency quantiles over :data:`LATENCY_WINDOW_S`: TTFT = validation + queue + prefill of the record
  (validator entry -> first token; the gateway's own auth and transport are not in a record), ITL =
  decode / (output tokens - 1), one sample per request (``actors.metrics.record_observations``);
* the active schedulers' load reports (``ActorLoad``: queue length and tokens, arrivals and served tokens/s,
  live workers, requests held for a cold start, tenant shares);
* worker statistics (``actors.metrics.WorkerGauges`` rows: KV use, running, waiting, tokens/s per worker);
* etcd: worker records (pool), preemption notices, desired counts and the autoscaler's decisions.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from actors.load_report import percentile
from actors.metrics import record_observations

RATE_WINDOW_S = 10.0  # requests/s and tokens/s are means over this window (s)
LATENCY_WINDOW_S = 60.0  # TTFT / ITL quantiles and request counts cover this window (s)
MAX_SAMPLES = 5000  # finished requests remembered per version (the oldest go first)
LOAD_STALE_S = 10.0  # a scheduler load report older than this is not shown (s)
MAX_DECISIONS = 20  # autoscaler decisions shown, newest first


class VersionTraffic:
    """Finished requests of one model version: ``(t, prompt, generated, ttft_s, itl_s, ok)`` per request
    (``t``: monotonic s of the record's arrival), the last :data:`LATENCY_WINDOW_S` seconds, at most
    ``max_samples``."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        if max_samples < 1:
            raise ValueError("max_samples must be >= 1")
        self.items: deque[tuple[float, int, int, float | None, float | None, bool]] = deque(maxlen=max_samples)
        self.extra_tokens: deque[tuple[float, int]] = deque(maxlen=max_samples)  # choices > 0: tokens only

    def add(self, now: float, status: str, prompt: int, generated: int, timing: Mapping | None,
            primary: bool = True) -> None:
        """One completion record at ``now``; a non-primary choice (``choice_index`` > 0) adds its tokens only."""
        if not primary:
            self.extra_tokens.append((now, max(0, generated)))
            return
        ok = status == "ok"
        obs = record_observations(timing, generated) if ok else {}
        self.items.append((now, max(0, prompt), max(0, generated), obs.get("ttft"), obs.get("itl"), ok))

    def figures(self, now: float, rate_s: float = RATE_WINDOW_S, window_s: float = LATENCY_WINDOW_S) -> dict:
        """Rates over the last ``rate_s``, quantiles (ms) and counts over the last ``window_s``."""
        while self.items and self.items[0][0] < now - window_s:
            self.items.popleft()
        while self.extra_tokens and self.extra_tokens[0][0] < now - window_s:
            self.extra_tokens.popleft()
        recent = [i for i in self.items if i[0] >= now - rate_s]
        gen_recent = sum(i[2] for i in recent) + sum(n for t, n in self.extra_tokens if t >= now - rate_s)
        ttft = [i[3] for i in self.items if i[3] is not None]
        itl = [i[4] for i in self.items if i[4] is not None]
        return {"requests_per_s": round(len(recent) / rate_s, 3),
                "prompt_tokens_per_s": round(sum(i[1] for i in recent) / rate_s, 2),
                "generation_tokens_per_s": round(gen_recent / rate_s, 2),
                "requests_60s": len(self.items), "errors_60s": sum(1 for i in self.items if not i[5]),
                "generation_tokens_60s": sum(i[2] for i in self.items) + sum(n for _, n in self.extra_tokens),
                "ttft_ms_p50": _ms(ttft, 0.50), "ttft_ms_p99": _ms(ttft, 0.99),
                "itl_ms_p50": _ms(itl, 0.50), "itl_ms_p99": _ms(itl, 0.99)}


def _ms(values: list[float], q: float) -> float | None:
    """The ``q``-quantile of ``values`` (s) in ms, rounded; None without values."""
    return round(percentile(values, q) * 1e3, 1) if values else None


class Traffic:
    """:class:`VersionTraffic` per model version (``name@version``); versions silent for a whole window are
    forgotten."""

    def __init__(self, max_samples: int = MAX_SAMPLES) -> None:
        self.max_samples = max_samples
        self.versions: dict[str, VersionTraffic] = {}

    def add_record(self, now: float, rec: Any) -> None:
        """One ``bus.messages.CompletionRecord`` heard at ``now`` (monotonic s)."""
        key = f"{rec.name}@{rec.version}"
        vt = self.versions.get(key)
        if vt is None:
            vt = self.versions[key] = VersionTraffic(self.max_samples)
        vt.add(now, rec.status, int(rec.prompt_tokens or 0), int(rec.completion_tokens or 0), rec.timing,
               primary=int(getattr(rec, "choice_index", 0) or 0) == 0)

    def figures(self, now: float) -> dict[str, dict]:
        """``{version: figures}`` of the versions with a request in the last window."""
        out = {}
        for key in list(self.versions):
            figs = self.versions[key].figures(now)
            if figs["requests_60s"] or figs["generation_tokens_60s"]:
                out[key] = figs
            else:
                del self.versions[key]
        return out


def _version_of_worker_key(key: str, prefix: str) -> tuple[str, str] | None:
    """``(name@version, worker id)`` of a worker record key ``<prefix><name>/<version>/<id>``; None otherwise."""
    parts = key[len(prefix):].split("/") if key.startswith(prefix) else []
    return (f"{parts[0]}@{parts[1]}", parts[2]) if len(parts) == 3 and all(parts) else None


def workers_by_version(records: Mapping[str, Any], prefix: str, notices: Mapping[str, Any], notice_prefix: str,
                       stats_rows: Iterable[Mapping[str, Any]]) -> dict[str, list[dict]]:
    """Every worker per version, from its etcd record (pool) and its statistics row (KV use, batch):
    ``{version: [{"worker", "pool", "state", "kv", "running", "waiting", "gen_tps"}]}``. ``state``:
    ``preempting`` (a preemption notice names it), ``sleeping`` (its record says it sleeps: KV cache freed,
    process and weights kept, woken in about a second; docs/autoscaling.md), ``serving`` (registered, statistics heard),
    ``registered`` (registered, no statistics yet: loading or silent), ``unregistered`` (statistics without a
    record: draining or lease lost)."""
    noticed = {k[len(notice_prefix):] for k in notices if k.startswith(notice_prefix)}
    stats = {(r["labels"]["model"], r["labels"]["worker"]): r for r in stats_rows}
    out: dict[str, list[dict]] = {}
    seen = set()
    for key, value in records.items():
        vw = _version_of_worker_key(key, prefix)
        if vw is None:
            continue
        seen.add(vw)
        pool = value.get("pool") if isinstance(value, Mapping) and isinstance(value.get("pool"), str) else "default"
        row = stats.get(vw)
        sleep = value.get("sleep") if isinstance(value, Mapping) else None
        asleep = isinstance(sleep, Mapping) and sleep.get("state") == "sleeping"
        state = "preempting" if vw[1] in noticed else "sleeping" if asleep else (
            "serving" if row is not None else "registered")
        out.setdefault(vw[0], []).append(_worker_row(vw[1], pool, state, row))
    for vw, row in stats.items():
        if vw not in seen:
            out.setdefault(vw[0], []).append(_worker_row(vw[1], "?", "unregistered", row))
    for rows in out.values():
        rows.sort(key=lambda r: (r["pool"], r["worker"]))
    return out


def _worker_row(worker: str, pool: str, state: str, stats: Mapping[str, Any] | None) -> dict:
    s = stats or {}
    return {"worker": worker, "pool": pool, "state": state, "kv": _round(s.get("kv"), 4),
            "running": s.get("running"), "waiting": s.get("waiting"), "gen_tps": _round(s.get("gen_tps"), 1)}


def _round(v: Any, digits: int) -> float | None:
    return round(float(v), digits) if isinstance(v, (int, float)) and math.isfinite(v) else None


POOL_COUNTS = {"serving": "ready", "preempting": "preempting", "registered": "no_stats",
               "unregistered": "leaving", "sleeping": "sleeping"}


def pools_of(workers: list[dict], desired: Mapping[str, Any], version: str) -> list[dict]:
    """Replicas of one version by pool: ``[{"pool", "ready", "preempting", "no_stats", "leaving", "sleeping",
    "desired"}]``
    (worker states counted by :data:`POOL_COUNTS`); ``desired`` from the autoscaler's
    ``worker/<name>/<version>/<pool>`` targets (None: no desired count)."""
    name, _, ver = version.partition("@")
    pools: dict[str, dict] = {}

    def pool(key: str) -> dict:
        return pools.setdefault(key, {"pool": key, **{c: 0 for c in POOL_COUNTS.values()}, "desired": None})
    for w in workers:
        pool(w["pool"])[POOL_COUNTS[w["state"]]] += 1
    head = f"worker/{name}/{ver}/"
    for target, value in desired.items():
        if target.startswith(head) and isinstance(value, Mapping):
            pool(target[len(head):])["desired"] = value.get("count")
    return sorted(pools.values(), key=lambda p: p["pool"])


def desired_targets(records: Mapping[str, Any], prefix: str) -> dict[str, dict]:
    """``{target: {"count", "reason", "ts"}}`` from the desired-count records (``<prefix><target>``)."""
    return {k[len(prefix):]: {"count": v.get("count"), "reason": v.get("reason", ""), "ts": v.get("ts")}
            for k, v in records.items() if k.startswith(prefix) and isinstance(v, Mapping)}


def recent_decisions(record: Any, last: int = MAX_DECISIONS) -> list[dict]:
    """The ``last`` decisions of the autoscaler's history record (``{"decisions": [...]}``, newest last in
    etcd), newest first, each ``{ts, loop, target, current, desired, reason}``."""
    rows = (record or {}).get("decisions") if isinstance(record, Mapping) else None
    keep = ("ts", "loop", "target", "current", "desired", "reason")
    good = [{k: d.get(k) for k in keep} for d in (rows or []) if isinstance(d, Mapping)]
    return good[-last:][::-1]


def queue_of(load: Mapping[str, Any] | None, age_s: float | None) -> dict | None:
    """The queue figures of a scheduler load report (``ActorLoad`` as a dict) taken ``age_s`` ago."""
    if load is None:
        return None
    keys = ("queue_len", "queue_tokens", "arrivals_tokens_per_s", "served_tokens_per_s", "workers",
            "cold_start_waiting")
    return {**{k: load.get(k) for k in keys}, "scheduler": load.get("actor_id"),
            "age_s": None if age_s is None else round(age_s, 1)}


def tenants_of(load: Mapping[str, Any] | None) -> list[dict]:
    """``[{"tenant", "service_share", "weight_share"}]`` of a scheduler load report."""
    return [{"tenant": t, "service_share": s, "weight_share": w} for t, s, w in (load or {}).get("tenants") or ()]


def build_snapshot(*, taken_at: float, traffic: Mapping[str, dict], loads: Mapping[str, tuple[float, dict]],
                   workers: Mapping[str, list[dict]], desired: Mapping[str, dict], decisions: list[dict],
                   show_tenants: bool, errors: Mapping[str, str] | None = None) -> dict:
    """The dashboard's JSON: one entry per model version (traffic, queue, workers, pools, tenants), the
    autoscaler's desired counts and recent decisions, ``taken_at`` (epoch s) and the sources that failed.
    ``loads``: ``{version: (age_s, ActorLoad dict)}``; ``show_tenants`` False leaves every tenant out (no
    operator token configured: the same rule as the token-less ``/metrics``)."""
    versions = sorted({*traffic, *loads, *workers})
    rows = []
    for v in versions:
        age, load = loads.get(v, (None, None))
        rows.append({"model": v, "traffic": traffic.get(v) or VersionTraffic().figures(0.0),
                     "queue": queue_of(load, age), "workers": workers.get(v, []),
                     "pools": pools_of(workers.get(v, []), desired, v),
                     "tenants": tenants_of(load) if show_tenants else None})
    return {"taken_at": round(taken_at, 3), "versions": rows, "desired": dict(desired), "decisions": decisions,
            "tenants_visible": show_tenants, "errors": dict(errors or {}),
            "windows": {"rate_s": RATE_WINDOW_S, "latency_s": LATENCY_WINDOW_S}}
