"""vLLM-named metrics (actors/metrics_vllm.py): every ``vllm:*`` alias carries exactly the values of its
``actorserve_*`` source, with ``model_name`` for ``model`` and the tenant summed away; the token-less gateway
view and the per-actor server's ``name[]`` filter include them; a scrape with aliases stays cheap."""

from __future__ import annotations

import time
from collections import defaultdict

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from actors import metrics as m
from actors.metrics_vllm import VLLM_ALIASES, VllmView, aliases_of, vllm_labels
from bus.memory import MemoryBus
from bus.messages import CompletionRecord, WorkerStats
from gateway.metrics import GatewayMetrics, render_without_tenants

MODEL = "vtest@1"
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _samples(text: str, model_label: str, model: str) -> dict:
    """``{sample name: {labels without the model label: value}}`` of one model's samples."""
    out: dict = defaultdict(dict)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get(model_label) == model:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != model_label))
                out[s.name][labels] = s.value
    return out


def _summed_over_tenants(samples: dict) -> dict:
    out: dict = defaultdict(lambda: defaultdict(float))
    for name, rows in samples.items():
        for labels, v in rows.items():
            out[name][tuple(kv for kv in labels if kv[0] != "tenant")] += v
    return {k: dict(v) for k, v in out.items()}


def _feed() -> None:
    gm = GatewayMetrics(MemoryBus())
    for i, (tenant, reason, status) in enumerate([("acme", "stop", "ok"), ("globex", "length", "ok"),
                                                  ("acme", None, "cancelled"), ("globex", "stop", "ok")]):
        gm.apply(CompletionRecord(f"q{i}", tenant, "vtest", "1", status, reason, 10 + i, 4 + i,
                                  {"validation_ms": 1, "queue_ms": 2, "prefill_ms": 30 + i, "decode_ms": 60}))
        gm.on_submit(f"t{i}", tenant, MODEL, time.time() - 0.05 * (i + 1))
        gm.on_chunk(type("C", (), {"request_id": f"t{i}", "error": None, "model": MODEL})())
    gm.workers.update(WorkerStats("wv0", "vtest", "1", 10, 40, 100, 2, 1, 25, 100, 3,
                                  prefix_cache_hit_tokens=16, prefix_cache_query_tokens=64))


def test_every_alias_has_its_source_s_values_by_model_name_without_tenant():
    _feed()
    text = m.render_latest().decode()
    ours = _summed_over_tenants(_samples(text, "model", MODEL))
    theirs = _samples(text, "model_name", MODEL)
    checked = 0
    for source, aliases in VLLM_ALIASES.items():
        src = {n: rows for n, rows in ours.items() if n in {source, *(source + x for x in SUFFIXES)}}
        assert src, f"{source} not exported"
        for alias in aliases:
            for name, rows in src.items():
                got = theirs.get(alias + name[len(source):])
                assert got == rows, (alias, name)
                checked += 1
    assert checked >= 38  # 10 histogram aliases x (bucket, count, sum), 3 gauges, 5 counters
    assert theirs["vllm:request_success_total"] == {(("finished_reason", "stop"),): 2.0,
                                                    (("finished_reason", "length"),): 1.0,
                                                    (("finished_reason", "abort"),): 1.0}
    assert theirs["vllm:kv_cache_usage_perc"] == {(("worker", "wv0"),): 0.75}
    assert theirs["vllm:prefix_cache_hits_total"] == {(("worker", "wv0"),): 16.0}
    assert theirs["vllm:time_to_first_token_seconds_count"] == {(): 4.0}
    assert not any("tenant" in dict(k) for rows in theirs.values() for k in rows)


def test_label_mapping_and_families():
    assert vllm_labels({"model": "a@1", "tenant": "t", "worker": "w", "le": "0.5"}) == \
        {"model_name": "a@1", "worker": "w", "le": "0.5"}
    fam = next(f for f in REGISTRY.collect() if f.name == "actorserve_inter_token_latency_seconds")
    names = [a.name for a in aliases_of(fam)]
    assert names == ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
                     "vllm:request_time_per_output_token_seconds"]
    assert all(a.type == "histogram" for a in aliases_of(fam))
    assert aliases_of(next(f for f in REGISTRY.collect() if f.name.startswith("process_"))) == []


def test_tokenless_view_and_name_filter_carry_the_aliases():
    _feed()
    text = render_without_tenants().decode()
    assert "vllm:e2e_request_latency_seconds_bucket{" in text and "tenant=" not in text
    only = generate_latest(VllmView().restricted_registry(["vllm:generation_tokens_total"])).decode()
    lines = [ln for ln in only.splitlines() if not ln.startswith("#")]
    assert lines and all(ln.startswith("vllm:generation_tokens_total{") for ln in lines)


def test_a_scrape_with_aliases_stays_cheap():
    """Aliases are built at scrape time only (nothing per step or request): a scrape with them costs at most
    a few times one without (measured here; 2 shared cores, noisy)."""
    _feed()
    def best(fn, n=10):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)
    plain = best(lambda: generate_latest(REGISTRY))
    with_aliases = best(lambda: generate_latest(VllmView()))
    print(f"\nscrape: {plain * 1e3:.2f} ms plain, {with_aliases * 1e3:.2f} ms with vLLM aliases")
    assert with_aliases < 4 * plain + 0.005


async def test_request_metrics_hear_records_from_the_meter_or_the_queue_group():
    """Decision 0052: a gateway with a usage meter takes its records from the meter's hook (no subscription to
    ``as.int.done``, so no second delivery of each record); without one it hears them in the queue group."""
    from bus import subjects
    from gateway.metrics import METRICS_QUEUE

    bus = MemoryBus()
    gm = GatewayMetrics(bus)
    await gm.start(hear_done=False)
    assert [(s.subject, s.queue) for s in bus._subs] == [(subjects.stats_all(), "")]
    seen = []
    gm.apply = seen.append
    recs = [CompletionRecord(f"h{i}", "acme", "vtest", "1", "ok", "stop", 1, 1, {}) for i in range(3)]
    gm.apply_many(recs)
    assert seen == recs
    await gm.hear_done()
    assert (subjects.done_all(), METRICS_QUEUE) in [(s.subject, s.queue) for s in bus._subs]
    await gm.stop()
