"""The gateway's request-level and fleet metrics (served on its public ``GET /metrics``).

* Time to first token is measured here, client-side-like: from the gateway's receipt of the request
  (``marks["gateway_in"]``) to the arrival of the request's first non-error chunk at this gateway
  (:meth:`GatewayMetrics.on_submit` / :meth:`GatewayMetrics.on_chunk`, called by ``Frontend``).
  Requests this process did not serve (async jobs, another gateway's) are not in this gateway's TTFT;
  see docs/observability.md.
* Every other request-level metric comes from completion records, each counted by exactly one gateway: the
  records this gateway's usage meter applies (gateway/usage.py ``on_records``: the gateways share one durable
  consumer of ``AS_DONE``), or, in a gateway without JetStream, the records heard on ``as.int.done.*.*`` in the
  queue group ``gateway-metrics``. With several gateways, ``sum()`` over them is the deployment's total; with
  one, it is all of it.
* The same records give ``actorserve_request_success_total{finished_reason}`` and the per-request prompt /
  generated token histograms, the sources of vLLM's names (every ``/metrics`` also serves ``vllm:*``
  aliases of these series, actors/metrics_vllm.py).
* Worker gauges (KV cache usage, running/waiting, batch size, tokens/s) come from every worker's
  statistics (``as.int.stats.*``), one series per worker.
* ``actorserve_gateway_shed_total{model, code}`` counts requests refused here from a refusal hint
  (gateway/shed.py: a scheduler refused the same kind of request within the last 0.25 s).
* ``actorserve_nats_api_dropped_total{reason, endpoint}`` counts NATS API requests answered with nothing
  at all, because their reply subject is one the caller may not subscribe to (gateway/nats_api.py).

``GET /metrics`` needs the operator token when the gateway has one; without one it serves
:func:`render_without_tenants` (docs/observability.md).
"""

from __future__ import annotations

import copy
import logging
import re
import time
from collections import OrderedDict

from actors import metrics as m
from bus import subjects
from bus.base import Bus, Msg
from bus.messages import Chunk, CompletionRecord, WorkerStats

log = logging.getLogger(__name__)

METRICS_QUEUE = "gateway-metrics"
TENANT_LABEL = "tenant"  # the per-tenant label that the public, token-less /metrics sums away
_CHILD = re.compile(r"^(.+)-(\d+)$")
MAX_PENDING = 10_000  # requests awaiting their first chunk that we remember (oldest dropped first)
# tokens per request: the 1-2-5 series of vLLM's build_1_2_5_buckets, up to 100k
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))[:-2]


class GatewayMetrics:
    """Histograms and counters of the gateway (see the module doc and docs/observability.md)."""

    def __init__(self, bus: Bus, max_tenants: int = m.MAX_TENANT_LABELS) -> None:
        self.bus = bus
        self.tenants = m.LabelLimiter(max_tenants)
        self.models = m.LabelLimiter(max_tenants)
        self.pending: OrderedDict[str, tuple[float, str, str]] = OrderedDict()  # rid -> (t0, tenant, model)
        self.workers = m.WorkerGauges()
        self._subs: list = []
        mt = m.meter()

        def hist(name: str, desc: str, buckets) -> object:
            return mt.create_histogram(name, unit="s", description=desc, explicit_bucket_boundaries_advisory=buckets)

        self.ttft = hist("actorserve_time_to_first_token_seconds",
                         "Time to first token: gateway receipt to the first chunk at the gateway.", m.TTFT_BUCKETS)
        self.itl = hist("actorserve_inter_token_latency_seconds",
                        "Inter-token latency (time per output token): decode time / (output tokens - 1), "
                        "one observation per request.", m.ITL_BUCKETS)
        self.e2e = hist("actorserve_e2e_request_latency_seconds",
                        "End-to-end request latency: validation + queue + prefill + decode.", m.LATENCY_BUCKETS)
        self.queue = hist("actorserve_request_queue_time_seconds",
                          "Time in the scheduler queue (validator out to worker in).", m.LATENCY_BUCKETS)
        self.prefill = hist("actorserve_request_prefill_time_seconds",
                            "Prefill: worker receipt to the first token.", m.LATENCY_BUCKETS)
        self.decode = hist("actorserve_request_decode_time_seconds",
                           "Decode: first token to the last.", m.LATENCY_BUCKETS)
        self.requests = mt.create_counter("actorserve_requests_total",
                                          description="Finished requests by status (ok, error, cancelled).")
        self.prompt_tokens = mt.create_counter("actorserve_prompt_tokens", unit="1",
                                               description="Prompt tokens of finished requests.")
        self.generation_tokens = mt.create_counter("actorserve_generation_tokens", unit="1",
                                                   description="Generated tokens of finished requests.")
        # vLLM's request_success (by finished_reason) and per-request token histograms (actors/metrics_vllm.py)
        self.success = mt.create_counter("actorserve_request_success", description="Finished requests by "
                                         "finished_reason (stop, length, abort, error), as vLLM counts them.")
        self.req_prompt = mt.create_histogram("actorserve_request_prompt_tokens", unit="1",
                                              description="Prompt tokens per finished request.",
                                              explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.req_generation = mt.create_histogram("actorserve_request_generation_tokens", unit="1",
                                                  description="Generated tokens per finished request (all choices).",
                                                  explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.workers.register()

    async def start(self, hear_done: bool = True) -> None:
        """Subscribe to worker statistics and, with ``hear_done``, to completion records (queue group); without
        it the records come through :meth:`apply_many` (the usage meter's ``on_records`` hook)."""
        self._subs = [await self.bus.subscribe(subjects.stats_all(), self._on_stats)]
        if hear_done:
            await self.hear_done()

    async def hear_done(self) -> None:
        """Subscribe to completion records in the queue group ``gateway-metrics`` (a gateway without a usage meter)."""
        self._subs.append(await self.bus.subscribe(subjects.done_all(), self._on_done, queue=METRICS_QUEUE))

    def apply_many(self, records: list[CompletionRecord]) -> None:
        """Observe completion records applied elsewhere (the usage meter's hook), each once."""
        for rec in records:
            self.apply(rec)

    async def stop(self) -> None:
        """Unsubscribe."""
        for s in self._subs:
            try:
                await s.unsubscribe()
            except Exception:
                pass
        self._subs = []

    # -- time to first token (called by Frontend) ------------------------------------------

    def on_submit(self, request_id: str, tenant: str, model: str, t0: float | None) -> None:
        """A request handed to a validator; ``t0`` is its receipt time (epoch s)."""
        self.pending[request_id] = (t0 or time.time(), tenant, model)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)

    def on_chunk(self, chunk: Chunk) -> None:
        """A chunk arrived: the first one of a request (any of its choices) observes its TTFT."""
        rid = chunk.request_id
        if rid not in self.pending:
            mm = _CHILD.match(rid)
            rid = mm.group(1) if mm else rid
        got = self.pending.pop(rid, None)
        if got is None or chunk.error:
            return
        t0, tenant, model = got
        self.ttft.record(max(0.0, time.time() - t0),
                         {"model": self.models(chunk.model or model), "tenant": self.tenants(tenant)})

    def forget(self, request_id: str) -> None:
        """Drop a request that ended without a first chunk."""
        self.pending.pop(request_id, None)

    # -- completion records and worker statistics --------------------------------------------

    def apply(self, rec: CompletionRecord) -> None:
        """Observe one completion record (request-level histograms, counters)."""
        mm = _CHILD.match(rec.request_id)
        primary = mm is None or mm.group(2) == "0"
        labels = {"model": self.models(f"{rec.name}@{rec.version}"), "tenant": self.tenants(rec.tenant)}
        self.generation_tokens.add(max(0, int(rec.completion_tokens or 0)), labels)
        if not primary:
            return
        self.requests.add(1, {**labels, "status": rec.status or "unknown"})
        self.prompt_tokens.add(max(0, int(rec.prompt_tokens or 0)), labels)
        self.success.add(1, {**labels, "finished_reason": finished_reason(rec)})
        self.req_prompt.record(max(0, int(rec.prompt_tokens or 0)), labels)
        self.req_generation.record(max(0, int(rec.completion_tokens or 0)), labels)
        if rec.status != "ok":
            return  # latency histograms describe served requests only
        obs = m.record_observations(rec.timing, int(rec.completion_tokens or 0))
        for key, hist in (("e2e", self.e2e), ("queue", self.queue), ("prefill", self.prefill),
                          ("decode", self.decode), ("itl", self.itl)):
            if key in obs:
                hist.record(obs[key], labels)

    async def _on_done(self, msg: Msg) -> None:
        try:
            self.apply(CompletionRecord.decode(msg.data))
        except (ValueError, TypeError) as exc:
            log.debug("undecodable completion record: %s", exc)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            self.workers.update(WorkerStats.decode(msg.data))
        except (ValueError, TypeError) as exc:
            log.debug("undecodable worker stats: %s", exc)


def finished_reason(rec: CompletionRecord) -> str:
    """vLLM's ``finished_reason`` of a record: its finish reason (``stop``, ``length``, ...), else ``abort`` for
    a cancelled request and ``error`` for a failed one."""
    if rec.finish_reason:
        return str(rec.finish_reason)
    return {"cancelled": "abort"}.get(rec.status, "error" if rec.status != "ok" else "stop")


_counters: dict = {}  # name -> OTel counter of the process-wide counters below (created on first use)


def _count(name: str, description: str, attributes: dict) -> None:
    """Add 1 to the process-wide counter ``name`` (created on first use) with ``attributes``."""
    if name not in _counters:
        _counters[name] = m.meter().create_counter(name, description=description)
    _counters[name].add(1, attributes)


def count_dropped(reason: str, endpoint: str) -> None:
    """Count one NATS API request dropped without any reply (``actorserve_nats_api_dropped_total``):
    ``reason`` ``reply_outside_inbox`` (a valid key, a reply subject outside its tenant's inbox) or
    ``unauthenticated`` (no valid key, a reply subject inside some tenant's or role's inbox); ``endpoint``
    the API operation (``chat``, ``cancel``, ``responses.get``, ...). No tenant label: the caller
    chooses it."""
    _count("actorserve_nats_api_dropped_total", "NATS API requests dropped without a reply: their reply subject "
           "lies outside what the caller may subscribe to.", {"reason": reason, "endpoint": endpoint})


def count_shed(model: str, code: str) -> None:
    """Count one request refused at the gateway from a refusal hint, with no bus hop
    (``actorserve_gateway_shed_total{model, code}``, gateway/shed.py); ``code``: ``queue_full``,
    ``tenant_queue_full`` or ``deadline_unmeetable``. The scheduler's own refusals are not in it."""
    _count("actorserve_gateway_shed_total", "Requests refused by the gateway from a scheduler's recent refusal "
           "(a refusal hint), without reaching a validator or scheduler.", {"model": model, "code": code})


class _WithoutTenants:
    """A prometheus_client collector view of the default registry (and its vLLM aliases) with the ``tenant``
    label summed away: each series that differed only by tenant becomes one (counters and histogram buckets,
    sums and counts add up exactly; a gauge with a tenant label becomes the sum over tenants)."""

    def collect(self):
        from actors.metrics_vllm import VllmView

        for fam in VllmView().collect():
            if not any(TENANT_LABEL in s.labels for s in fam.samples):
                yield fam
                continue
            sums: dict = {}  # (sample name, labels) -> (first sample, value), first-seen order
            for s in fam.samples:
                labels = {k: v for k, v in s.labels.items() if k != TENANT_LABEL}
                key = (s.name, tuple(labels.items()))
                first, total = sums.get(key, (s._replace(labels=labels, exemplar=None), 0.0))
                sums[key] = (first, total + s.value)
            out = copy.copy(fam)
            out.samples = [first._replace(value=total) for first, total in sums.values()]
            yield out


def render_without_tenants() -> bytes:
    """This process's Prometheus text with no per-tenant label (:class:`_WithoutTenants`): what the
    gateway's ``GET /metrics`` serves when no operator token is configured."""
    from prometheus_client import generate_latest

    m.setup_metrics()
    return generate_latest(_WithoutTenants())
