"""Metrics every actor shares: OpenTelemetry SDK meters exported as Prometheus text.

One ``MeterProvider`` per process (:func:`setup_metrics`) feeds a ``PrometheusMetricReader`` whose
backend is prometheus_client's default registry, so the same text is served

* by the per-actor loopback server (:func:`start_metrics_server`, ``--metrics-port``; 0 = a free port,
  -1 = off), registered under a short etcd lease at ``/actorserve/metrics/{kind}/{id}``
  (:func:`keep_metrics_registered`), and
* by the gateway's public ``GET /metrics`` (``gateway/http.py``).

The shared run loop (``actors.runtime``) starts all of that for every actor with
:func:`actor_metrics`, plus the event-loop lag gauge (:func:`loop_lag_task`). Pure helpers
(:class:`LabelLimiter`, :func:`record_observations`, :class:`WorkerGauges`'s arithmetic) are unit-tested
without I/O. Metric names and meanings follow vLLM (``vllm:*`` -> ``actorserve_*``); see
docs/observability.md for the list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from control.policy.numbers import is_number

log = logging.getLogger("actorserve.metrics")

METER_NAME = "actorserve"
#: seconds: lease TTL of a ``/actorserve/metrics/{kind}/{id}`` key
REGISTRATION_TTL = 3
#: period of the event-loop drift probe (s)
LAG_PROBE_S = 0.1
#: distinct tenant label values before the rest are reported as "other"
MAX_TENANT_LABELS = 50
OTHER = "other"

# Bucket boundaries (seconds), after vLLM's; the low end is finer because CPU-tier stages are short.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                   15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_provider: Any = None


def setup_metrics() -> Any:
    """Install (once per process) the OTel ``MeterProvider`` exporting to prometheus_client's default
    registry; return it. Later calls return the same provider."""
    global _provider
    if _provider is None:
        from opentelemetry import metrics
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider

        reader = PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False)
        _provider = MeterProvider(metric_readers=[reader])
        with contextlib.suppress(Exception):  # someone set one already: ours still serves /metrics
            metrics.set_meter_provider(_provider)
    return _provider


def meter() -> Any:
    """The ``actorserve`` meter of this process's provider (set up on first use)."""
    return setup_metrics().get_meter(METER_NAME)


def render_latest() -> bytes:
    """The Prometheus text exposition of this process's metrics (what ``/metrics`` returns), with the
    vLLM-named aliases (actors/metrics_vllm.py)."""
    from prometheus_client import generate_latest

    from actors.metrics_vllm import VllmView

    setup_metrics()
    return generate_latest(VllmView())


def observable_gauge(name: str, description: str, unit: str,
                     fn: Callable[[], Iterable[tuple[float, Mapping[str, str]]]]) -> Any:
    """Register a gauge whose values ``fn()`` returns as ``(value, labels)`` pairs at each scrape.

    ``fn`` runs in the scraping thread: it should only read plain attributes (no awaiting, no locks)."""
    return meter().create_observable_gauge(name, callbacks=[_observe(name, fn)], unit=unit, description=description)


def observable_counter(name: str, description: str, unit: str,
                       fn: Callable[[], Iterable[tuple[float, Mapping[str, str]]]]) -> Any:
    """Register a monotonic counter whose cumulative values ``fn()`` returns as ``(value, labels)`` pairs at
    each scrape (exported with the ``_total`` suffix). Same rules for ``fn`` as :func:`observable_gauge`."""
    return meter().create_observable_counter(name, callbacks=[_observe(name, fn)], unit=unit,
                                             description=description)


def _observe(name: str, fn: Callable[[], Iterable[tuple[float, Mapping[str, str]]]]) -> Callable[[Any], list]:
    """An OTel observable callback returning ``fn()``'s pairs as Observations; a failing ``fn`` yields none
    (a broken reader must not break the scrape)."""
    from opentelemetry.metrics import Observation

    def callback(_options: Any) -> list:
        try:
            return [Observation(v, dict(a)) for v, a in fn()]
        except Exception as exc:
            log.debug("metric %s callback failed: %r", name, exc)
            return []
    return callback


# ---------------------------------------------------------------------------------------------
# Pure helpers


class LabelLimiter:
    """Bounded label cardinality: the first ``max_values`` distinct values pass, later ones map to ``other``.

    ``""`` / None map to ``"none"``. Not thread-safe (call it from one event loop)."""

    def __init__(self, max_values: int = MAX_TENANT_LABELS, other: str = OTHER) -> None:
        if max_values < 0:
            raise ValueError("max_values must be >= 0")
        self.max_values, self.other = int(max_values), other
        self.seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        """The label value to use for ``value``."""
        v = value or "none"
        if v in self.seen:
            return v
        if len(self.seen) < self.max_values:
            self.seen.add(v)
            return v
        return self.other


def record_observations(timing: Mapping[str, Any] | None, completion_tokens: int) -> dict[str, float]:
    """Request-level observations (seconds) from a completion record's ``timing`` (ms) and token count.

    Returns the keys that the record supports: ``queue``, ``prefill``, ``decode`` (the record's stages),
    ``e2e`` (validation + queue + prefill + decode: validator entry to the last token; gateway auth and
    transport are not in the record), ``ttft`` (validation + queue + prefill: the record's estimate of time to
    first token, used when no frontend measured it) and ``itl`` (decode / (completion_tokens - 1): the
    request's mean inter-token latency, only with >= 2 tokens). Missing or non-numeric stages are skipped.
    """
    t: dict[str, float] = {}
    for key in ("validation_ms", "queue_ms", "prefill_ms", "decode_ms"):
        v = (timing or {}).get(key)
        if is_number(v, minimum=0, finite=False):
            t[key] = float(v) / 1e3
    out: dict[str, float] = {}
    for key, name in (("queue_ms", "queue"), ("prefill_ms", "prefill"), ("decode_ms", "decode")):
        if key in t:
            out[name] = t[key]
    if "prefill_ms" in t:
        out["ttft"] = t.get("validation_ms", 0.0) + t.get("queue_ms", 0.0) + t["prefill_ms"]
        if "decode_ms" in t:
            out["e2e"] = out["ttft"] + t["decode_ms"]
    if "decode_ms" in t and completion_tokens >= 2:
        out["itl"] = t["decode_ms"] / (completion_tokens - 1)
    return out


class WorkerGauges:
    """Worker gauges from ``WorkerStats`` messages (``as.int.stats.<worker_id>``), one series per worker.

    ``update(stats, now)`` derives, from consecutive messages of one worker, tokens/s and the mean batch
    size (sequences sampled per engine step); ``rows(now)`` lists the live workers' values (a worker silent
    for ``stale_s`` is dropped). :meth:`register` exposes them as ``actorserve_*`` gauges (labels ``model``,
    ``worker``)."""

    def __init__(self, stale_s: float = 15.0) -> None:
        self.stale_s = stale_s
        self._rows: dict[str, dict[str, Any]] = {}

    def update(self, st: Any, now: float | None = None) -> dict[str, Any]:
        """Take one stats message; return the worker's derived row."""
        now = time.monotonic() if now is None else now
        prev = self._rows.get(st.worker_id)
        total = max(0, int(st.num_total_blocks))
        row: dict[str, Any] = {
            "labels": {"model": f"{st.name}@{st.version}", "worker": st.worker_id},
            "t": now, "steps": int(st.num_steps), "gen": int(st.num_generated_tokens),
            "prompt": int(st.num_prompt_tokens),
            "running": int(st.num_running), "waiting": int(st.num_waiting),
            "kv": (total - int(st.num_free_blocks)) / total if total else 0.0,
            "max_batch": int(st.max_batch_size_seen),
            "gen_tps": 0.0, "prompt_tps": 0.0, "batch": 0.0,
            "constrained_steps": int(getattr(st, "num_constrained_steps", 0)),
            "grammar_ms": float(getattr(st, "grammar_compile_ms_total", 0.0)),
            "grammar_hits": int(getattr(st, "grammar_cache_hits", 0)),
            "grammar_misses": int(getattr(st, "grammar_cache_misses", 0)),
            "prefix_queries": int(getattr(st, "prefix_cache_query_tokens", 0)),
            "prefix_hits": int(getattr(st, "prefix_cache_hit_tokens", 0)),
            "tenant_hits": dict(getattr(st, "prefix_hits_by_tenant", None) or {}),
            "kv_reclaims": int(getattr(st, "num_kv_reclaims", 0)),
        }
        if prev is not None and now > prev["t"] and row["steps"] >= prev["steps"]:
            dt, dsteps = now - prev["t"], row["steps"] - prev["steps"]
            dgen = max(0, row["gen"] - prev["gen"])
            row["gen_tps"] = dgen / dt
            row["prompt_tps"] = max(0, row["prompt"] - prev["prompt"]) / dt
            row["batch"] = dgen / dsteps if dsteps else 0.0
        self._rows[st.worker_id] = row
        return row

    def rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """Rows of the workers heard from within ``stale_s`` (older ones are forgotten)."""
        now = time.monotonic() if now is None else now
        for wid in [w for w, r in self._rows.items() if now - r["t"] > self.stale_s]:
            del self._rows[wid]
        return list(self._rows.values())

    def register(self) -> None:
        """Expose the rows as observable gauges of this process."""
        specs = (
            ("actorserve_num_requests_running", "Requests in the worker's running batch.", "1", "running"),
            ("actorserve_num_requests_waiting", "Requests waiting: the worker engine's own queue (label worker) "
             "or the scheduler's queue (no worker label).", "1", "waiting"),
            ("actorserve_kv_cache_usage_perc", "KV cache usage: fraction of KV blocks in use, 0..1.", "1", "kv"),
            ("actorserve_batch_size", "Mean sequences sampled per engine step over the last stats interval.",
             "1", "batch"),
            ("actorserve_max_batch_size", "Largest running batch the worker has run.", "1", "max_batch"),
            ("actorserve_generation_tokens_per_second", "Tokens generated per second (last stats interval).",
             "1", "gen_tps"),
            ("actorserve_prompt_tokens_per_second", "Prompt tokens prefilled per second (last stats interval).",
             "1", "prompt_tps"),
            ("actorserve_constrained_steps", "Engine steps with at least one grammar-constrained sequence "
             "(structured outputs), since the worker started.", "1", "constrained_steps"),
            ("actorserve_grammar_compile_ms", "Time spent compiling structured-output grammars since the worker "
             "started (cache misses).", "ms", "grammar_ms"),
            ("actorserve_grammar_cache_hits", "Structured-output requests whose compiled grammar was cached.", "1",
             "grammar_hits"),
            ("actorserve_grammar_cache_misses", "Structured-output requests whose grammar was compiled.", "1",
             "grammar_misses"),
        )
        for name, desc, unit, key in specs:
            observable_gauge(name, desc, unit, lambda key=key: [(r[key], r["labels"]) for r in self.rows()])
        for name, desc, key in (  # vLLM's prefix cache counters (tokens), hit rate = rate(hits) / rate(queries)
                ("actorserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries"),
                ("actorserve_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.", "prefix_hits")):
            observable_counter(name, desc, "1", lambda key=key: [(r[key], r["labels"]) for r in self.rows()])
        observable_counter("actorserve_tenant_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache, "
                           "per tenant (a tenant hits only its own or its cache-sharing group's blocks).", "1",
                           lambda: [(n, {**r["labels"], "tenant": t}) for r in self.rows()
                                    for t, n in list(r["tenant_hits"].items())[:50]])
        observable_counter("actorserve_kv_share_preemptions", "Sequences preempted to give a waiting tenant its "
                           "weighted share of the KV blocks.", "1",
                           lambda: [(r["kv_reclaims"], r["labels"]) for r in self.rows()])


async def track_worker(stats_fn: Callable[[], Any], gauges: WorkerGauges, period_s: float = 1.0) -> None:
    """Feed ``gauges`` from ``stats_fn()`` (a ``WorkerStats``) every ``period_s``; runs until cancelled."""
    while True:
        try:
            gauges.update(stats_fn())
        except Exception as exc:  # engine not ready yet, or stopping
            log.debug("worker stats unavailable: %r", exc)
        await asyncio.sleep(period_s)


# ---------------------------------------------------------------------------------------------
# Event-loop lag


class LagProbe:
    """Event-loop lag: how late a periodic ``asyncio.sleep`` wakes up (the max over the last ~second)."""

    def __init__(self, window: int = 10) -> None:
        self.samples: deque[float] = deque(maxlen=window)

    def add(self, lag_s: float) -> None:
        """Record one wake-up delay (negative clamps to 0)."""
        self.samples.append(max(0.0, lag_s))

    @property
    def value(self) -> float:
        """Largest recent lag in seconds (0 before the first sample)."""
        return max(self.samples, default=0.0)


async def loop_lag_task(probe: LagProbe, period_s: float = LAG_PROBE_S) -> None:
    """Sleep ``period_s`` repeatedly and record how late each wake-up is; runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period_s)
        probe.add(loop.time() - t0 - period_s)


# ---------------------------------------------------------------------------------------------
# Per-actor server and etcd registration


def start_metrics_server(port: int, host: str = "127.0.0.1") -> tuple[Any, str]:
    """Serve ``/metrics`` (this process's registry and its vLLM aliases) on ``host:port`` in a daemon thread
    (0 = a free port).

    Returns ``(server, url)``; ``server.shutdown()`` stops it."""
    from prometheus_client import start_http_server

    from actors.metrics_vllm import VllmView

    setup_metrics()
    server, _thread = start_http_server(port, addr=host, registry=VllmView())
    return server, f"http://{host}:{server.server_port}/metrics"


def actor_identity(args: Any, kind: str) -> str:
    """This actor's id for its metrics key: its own id option (worker, gateway, scheduler, jobs) when
    given, else ``<kind>-<pid>``; made a valid name (lower case, ``[a-z0-9_-]``)."""
    ident = None
    for attr in ("worker_id", "gateway_id", "scheduler_id", "jobs_id", "controller_id"):
        ident = ident or getattr(args, attr, None)
    ident = ident or f"{kind}-{os.getpid()}"
    ident = re.sub(r"[^a-z0-9_-]", "-", str(ident).lower()).lstrip("-_") or f"{kind}-{os.getpid()}"
    return ident[:128]


async def keep_metrics_registered(etcd_url: str, kind: str, ident: str, info: Mapping[str, Any],
                                  ttl: int = REGISTRATION_TTL, retry_s: float = 1.0) -> None:
    """Hold ``/actorserve/metrics/{kind}/{ident}`` -> ``info`` under a ``ttl`` s lease until cancelled.

    Connects its own etcd client; re-registers after a lost lease or while etcd is away (every
    ``retry_s``); on cancellation revokes the lease (bounded) so the key goes at once."""
    from control.state.names import metrics_key
    from control.state.registry import OutageLog, Registry

    key = metrics_key(kind, ident)
    reg = lease = None
    outage = OutageLog(log, f"metrics registration {key}")
    try:
        while True:
            try:
                if reg is None:
                    reg = await Registry.open(etcd_url)
                lease = await reg.put_leased(key, info, ttl=ttl)
                outage.ok()
                log.debug("metrics endpoint registered at %s", key)
                await lease.lost.wait()  # set only once etcd answers and no longer knows the lease
                log.warning("metrics registration %s lost its lease; registering again", key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd away: retry quietly (logged once per outage)
                outage.failed(exc)
            lease = None
            await asyncio.sleep(retry_s)
    finally:
        async def _release() -> None:
            if lease is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(lease.revoke(), 2.0)
            if reg is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reg.close(), 2.0)
        await asyncio.shield(_release())


@contextlib.asynccontextmanager
async def actor_metrics(args: Any, kind: str):
    """What every actor process runs alongside its ``main`` (entered by ``actors.runtime``).

    Always: the meter provider and ``actorserve_event_loop_lag_seconds``. Unless ``args.metrics_port`` is
    None or negative: the loopback ``/metrics`` server on that port (0 = free) and its leased etcd
    registration (when ``args.etcd`` is set). Yields the URL served (None when off)."""
    kind = kind.split(":", 1)[0]
    setup_metrics()
    probe = LagProbe()
    observable_gauge("actorserve_event_loop_lag_seconds",
                     "Event-loop lag: delay of a periodic 100 ms asyncio sleep (max over the last second).",
                     "s", lambda: [(probe.value, {})])
    tasks = [asyncio.ensure_future(loop_lag_task(probe))]
    server = url = None
    port = getattr(args, "metrics_port", None)
    if port is not None and port >= 0:
        try:
            server, url = start_metrics_server(port, getattr(args, "metrics_host", None) or "127.0.0.1")
            log.info("metrics on %s", url)
        except OSError as exc:
            log.error("cannot serve metrics on port %s: %s", port, exc)
        etcd_url = getattr(args, "etcd", None)
        if url and etcd_url:
            ident = actor_identity(args, kind)
            info = {"url": url, "kind": kind, "id": ident, "pid": os.getpid()}
            tasks.append(asyncio.ensure_future(keep_metrics_registered(etcd_url, kind, ident, info)))
    try:
        yield url
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.shield(asyncio.wait(tasks, timeout=3.0))
        if server is not None:
            server.shutdown()
            server.server_close()
