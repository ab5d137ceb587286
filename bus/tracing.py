"""OpenTelemetry tracing across NATS hops: one connected trace per request (docs/observability.md).

Tracing is a hook around message handling, not code inside the actors' handlers (like dramatiq's
middleware): the buses inject the current trace context into the headers of every message they send
(W3C ``traceparent``) and run every handler with the context extracted from the received message's
headers attached. Actors only open their own spans (gateway ``request`` + ``auth``, validator
``validation``, scheduler ``queue``, worker ``prefill`` + ``decode``); spans of work that is not one
coroutine (queue wait, prefill and decode inside shared engine steps) are recorded afterwards with
explicit start and end times taken from the timing marks the actors keep anyway.

Off by default: until :func:`setup` enables an exporter every helper returns at its first line
(OpenTelemetry is not even imported), so disabled tracing costs one function call per message.

Exporter spec (``--traces`` or ``ACTORSERVE_TRACES``): ``none`` (default), ``console`` (spans on
stdout), ``otlp`` (OTLP over HTTP; endpoint from the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), ``file:<path>`` (one JSON object per finished span, appended
with O_APPEND so several processes may share one file: tests and offline inspection).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from typing import Any, Awaitable, Iterator, Mapping

from bus import jsonline

ENV_TRACES = "ACTORSERVE_TRACES"
EXPORTERS = ("none", "console", "otlp", "file:<path>")
TRACEPARENT = "traceparent"


class _State:
    enabled = False
    provider = None  # opentelemetry.sdk.trace.TracerProvider
    tracer = None
    trace = None  # the opentelemetry.trace module
    context = None  # the opentelemetry.context module
    propagate = None  # the opentelemetry.propagate module


_S = _State()


def parse_exporter(spec: str | None) -> str:
    """Normalise an exporter spec (None/"" -> "none"); ValueError naming the accepted values."""
    s = (spec or "none").strip()
    if s.lower() in ("none", "console", "otlp"):
        return s.lower()
    if s.startswith("file:") and len(s) > len("file:"):
        return s
    raise ValueError(f"traces exporter must be one of {', '.join(EXPORTERS)}, not {spec!r}")


def setup(service_name: str, exporter: str | None = None) -> bool:
    """Enable tracing for this process as ``service_name`` with ``exporter`` (else ``ACTORSERVE_TRACES``).

    Returns whether tracing is on. "none" leaves everything disabled (no provider, no imports). Call once
    per process, before the bus connects; :func:`shutdown` flushes at exit. ValueError on a bad spec.
    """
    spec = parse_exporter(exporter if exporter is not None else os.environ.get(ENV_TRACES))
    if spec == "none":
        return False
    from opentelemetry import context, propagate, trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if spec == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif spec == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(__getattr__("JsonLinesExporter")(spec[len("file:"):])))
    _S.provider, _S.tracer = provider, provider.get_tracer("actorserve")
    _S.trace, _S.context, _S.propagate = trace, context, propagate
    _S.enabled = True
    return True


def shutdown() -> None:
    """Flush and stop the exporter (no-op when tracing is off). Tracing is off afterwards."""
    if _S.enabled:
        _S.enabled = False
        _S.provider.shutdown()


def enabled() -> bool:
    """Whether :func:`setup` enabled tracing in this process."""
    return _S.enabled


# ---- propagation (used by the buses) ------------------------------------------------------------
def inject(headers: dict[str, str] | None = None, ctx: Any = None) -> dict[str, str] | None:
    """``headers`` plus the trace context of ``ctx`` (default: the current one) as W3C ``traceparent``.

    Returns ``headers`` itself when tracing is off, when there is no active span, or when the headers
    already carry a ``traceparent`` (an explicit parent wins); otherwise a new dict."""
    if not _S.enabled or (headers and TRACEPARENT in headers):
        return headers
    carrier: dict[str, str] = {}
    _S.propagate.inject(carrier, context=ctx)
    if not carrier:
        return headers
    return {**(headers or {}), **carrier}


def extract(headers: Mapping[str, str] | None) -> Any:
    """The trace context carried by message ``headers`` (a bus ``Msg.headers``), None when off or absent."""
    if not _S.enabled or not headers or TRACEPARENT not in headers:
        return None
    return _S.propagate.extract(dict(headers))


_NULL = contextlib.nullcontext()


def attached(headers: Mapping[str, str] | None) -> contextlib.AbstractContextManager:
    """Run the block with the context of ``headers`` current (the bus hook around every handler).

    Tasks the handler creates inherit it (asyncio copies context variables), so a handler that spawns
    its processing keeps the request's trace. Without a context (or with tracing off): a shared no-op."""
    ctx = extract(headers)
    return _NULL if ctx is None else _attached(ctx)


@contextlib.contextmanager
def _attached(ctx: Any) -> Iterator[None]:
    token = _S.context.attach(ctx)
    try:
        yield
    finally:
        _S.context.detach(token)


def current() -> Any:
    """The current trace context (to resume later, e.g. at dispatch), None when tracing is off."""
    return _S.context.get_current() if _S.enabled else None


# ---- spans --------------------------------------------------------------------------------------
def _ns(t: float | None) -> int | None:
    return None if t is None else int(t * 1e9)


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None, parent: Any = None,
         start: float | None = None) -> Iterator[Any]:
    """Open span ``name`` as the current span for the block (child of ``parent``, default the current
    context; ``start``: epoch seconds, default now). Yields the span (None when off). An exception
    leaving the block is recorded and sets the span's status to error."""
    if not _S.enabled:
        yield None
        return
    with _S.tracer.start_as_current_span(name, context=parent, attributes=_clean(attributes),
                                         start_time=_ns(start)) as s:
        yield s


def traced(name: str, coro: Awaitable, attributes: Mapping[str, Any] | None = None) -> Awaitable:
    """``coro`` run inside span ``name`` (a handler-level hook: wrap a task's coroutine); ``coro`` itself
    when tracing is off."""
    return _traced(name, coro, attributes) if _S.enabled else coro


async def _traced(name: str, coro: Awaitable, attributes: Mapping[str, Any] | None) -> Any:
    with span(name, attributes):
        return await coro


def record_span(name: str, start: float, end: float, parent: Any = None,
                attributes: Mapping[str, Any] | None = None) -> dict[str, str] | None:
    """Record a finished span from ``start`` to ``end`` (epoch seconds) under ``parent`` (default: the
    current context). Returns headers carrying the new span as parent (for the next hop), None when off."""
    if not _S.enabled:
        return None
    s = _S.tracer.start_span(name, context=parent, attributes=_clean(attributes), start_time=_ns(start))
    s.end(end_time=_ns(max(start, end)))
    carrier: dict[str, str] = {}
    _S.propagate.inject(carrier, context=_S.trace.set_span_in_context(s))
    return carrier


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """Set attributes on the current span (no-op when off or outside a span)."""
    if _S.enabled:
        _S.trace.get_current_span().set_attributes(_clean(attributes))


def set_error(message: str) -> None:
    """Mark the current span as failed with ``message`` (no-op when off)."""
    if _S.enabled:
        from opentelemetry.trace import Status, StatusCode
        _S.trace.get_current_span().set_status(Status(StatusCode.ERROR, message))


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Drop None values (OpenTelemetry refuses them)."""
    return None if not attributes else {k: v for k, v in attributes.items() if v is not None}


class ContextStore:
    """Trace contexts of requests held for later (scheduler: from submit to dispatch), bounded (oldest
    dropped first: a request that never ends only loses its trace). Stores nothing when tracing is off."""

    def __init__(self, max_items: int = 65536) -> None:
        self._items: OrderedDict[str, Any] = OrderedDict()
        self.max_items = max_items

    def put(self, key: str, ctx: Any) -> None:
        """Remember ``ctx`` (e.g. :func:`current`) under ``key``; None is ignored."""
        if ctx is None:
            return
        self._items[key] = ctx
        self._items.move_to_end(key)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, key: str) -> Any:
        """The context stored under ``key``, or None."""
        return self._items.get(key)

    def pop(self, key: str) -> Any:
        """Forget ``key``; returns its context or None."""
        return self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


# ---- exporter for tests and offline inspection --------------------------------------------------
def _json_lines_exporter_class() -> type:
    """Define :class:`JsonLinesExporter` on first use (keeps the SDK unimported while tracing is off)."""
    from opentelemetry.sdk.trace.export import SpanExporter

    class JsonLinesExporter(SpanExporter):
        """Writes finished spans as JSON lines to ``path`` (O_APPEND: processes may share the file).

        Each line: name, service, trace_id, span_id, parent_span_id (hex; "" for a root), start and end
        (epoch seconds), status and attributes."""

        def __init__(self, path: str) -> None:
            self.path = path

        def export(self, spans) -> Any:
            """Append ``spans``, one write per batch; FAILURE when the file cannot be written."""
            from opentelemetry.sdk.trace.export import SpanExportResult
            lines = []
            for s in spans:
                ctx, parent = s.get_span_context(), s.parent
                lines.append(jsonline.line({
                    "name": s.name, "service": s.resource.attributes.get("service.name", ""),
                    "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                    "parent_span_id": f"{parent.span_id:016x}" if parent is not None else "",
                    "start": s.start_time / 1e9, "end": (s.end_time or time.time_ns()) / 1e9,
                    "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
                }, default=str))
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, b"".join(lines))
                finally:
                    os.close(fd)
            except OSError:
                return SpanExportResult.FAILURE
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            """Nothing to release (the file is opened per batch)."""

    return JsonLinesExporter


def __getattr__(name: str) -> Any:
    """Module attribute hook: builds ``JsonLinesExporter`` lazily."""
    if name == "JsonLinesExporter":
        cls = globals()["JsonLinesExporter"] = _json_lines_exporter_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
