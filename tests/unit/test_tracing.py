"""bus.tracing: off by default (no-op), W3C propagation through message headers, explicit-time spans,
the JSON-lines exporter, and the bus hook (MemoryBus) that carries the context across a hop."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bus import tracing
from bus.memory import MemoryBus


@pytest.fixture
def spans_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    assert tracing.setup("test-svc", f"file:{path}")
    try:
        yield path
    finally:
        tracing.shutdown()


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_off_by_default_is_a_no_op(monkeypatch):
    monkeypatch.delenv(tracing.ENV_TRACES, raising=False)
    assert not tracing.setup("x") and not tracing.enabled()
    h = {"Nats-Msg-Id": "1"}
    assert tracing.inject(h) is h and tracing.inject(None) is None
    assert tracing.extract({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    assert tracing.current() is None
    assert tracing.record_span("queue", 1.0, 2.0) is None
    with tracing.span("x") as s:
        assert s is None
    with tracing.attached({"traceparent": "whatever"}):
        pass
    store = tracing.ContextStore()
    store.put("r", tracing.current())
    assert len(store) == 0
    t0 = time.perf_counter()
    for _ in range(20_000):  # the per-message cost of the bus hooks when off (~0.1-0.3 us each here)
        tracing.inject(None)
        with tracing.attached(h):
            pass
    assert (time.perf_counter() - t0) / 20_000 < 20e-6


def test_exporter_specs():
    assert tracing.parse_exporter(None) == "none"
    assert tracing.parse_exporter("CONSOLE") == "console"
    assert tracing.parse_exporter("otlp") == "otlp"
    assert tracing.parse_exporter("file:/tmp/x.jsonl") == "file:/tmp/x.jsonl"
    for bad in ("jaeger", "file:", "zipkin"):
        with pytest.raises(ValueError, match="none, console, otlp"):
            tracing.parse_exporter(bad)


def test_otlp_exporter_builds(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing sent: no span ends
    assert tracing.setup("test-svc", "otlp")
    tracing.shutdown()
    assert not tracing.enabled()


def test_inject_extract_round_trip_and_explicit_spans(spans_file):
    with tracing.span("root", {"a": 1, "skip": None}) as root:
        h = tracing.inject({"Nats-Msg-Id": "m"})
        assert h["Nats-Msg-Id"] == "m" and h["traceparent"].startswith("00-")
        ctx = tracing.extract(h)
        child_headers = tracing.record_span("queue", 10.0, 12.5, ctx, {"k": "v"})
    assert tracing.inject(child_headers) is child_headers  # an explicit parent is never overwritten
    tracing.record_span("prefill", 12.5, 13.0, tracing.extract(child_headers))
    spans = {s["name"]: s for s in read(spans_file)}
    assert set(spans) == {"root", "queue", "prefill"}
    tid = f"{root.get_span_context().trace_id:032x}"
    assert {s["trace_id"] for s in spans.values()} == {tid}
    assert spans["root"]["parent_span_id"] == "" and spans["root"]["attributes"] == {"a": 1}
    assert spans["queue"]["parent_span_id"] == spans["root"]["span_id"]
    assert spans["prefill"]["parent_span_id"] == spans["queue"]["span_id"]
    assert spans["queue"]["start"] == 10.0 and spans["queue"]["end"] == 12.5
    assert spans["queue"]["service"] == "test-svc" and spans["queue"]["attributes"] == {"k": "v"}


def test_span_records_errors(spans_file):
    with pytest.raises(RuntimeError):
        with tracing.span("boom"):
            raise RuntimeError("x")
    with tracing.span("failed"):
        tracing.set_error("no scheduler")
    assert {s["name"]: s["status"] for s in read(spans_file)} == {"boom": "ERROR", "failed": "ERROR"}


def test_context_store_is_bounded(spans_file):
    store = tracing.ContextStore(max_items=2)
    with tracing.span("s"):
        for rid in ("a", "b", "c"):
            store.put(rid, tracing.current())
    assert len(store) == 2 and store.get("a") is None and store.pop("c") is not None and store.pop("c") is None


async def test_memory_bus_carries_the_context_to_handlers_and_their_tasks(spans_file):
    bus = MemoryBus()
    seen: list = []
    done = asyncio.Event()

    async def later():
        with tracing.span("validation"):
            await bus.publish("next", b"")

    async def on_first(msg):
        assert "traceparent" in msg.headers
        seen.append(asyncio.create_task(later()))  # tasks created by a handler inherit its trace

    async def on_next(msg):
        with tracing.span("queue"):
            pass
        done.set()
    await bus.subscribe("first", on_first)
    await bus.subscribe("next", on_next)
    with tracing.span("request"):
        await bus.publish("first", b"")
    await asyncio.wait_for(done.wait(), 2)
    await bus.publish("untraced", b"")  # outside any span: no header added
    spans = {s["name"]: s for s in read(spans_file)}
    assert len({s["trace_id"] for s in spans.values()}) == 1
    assert spans["validation"]["parent_span_id"] == spans["request"]["span_id"]
    assert spans["queue"]["parent_span_id"] == spans["validation"]["span_id"]
    await bus.close()
