"""Gateway tracing hooks: the root ``request`` span of each generation request (docs/observability.md).

``middleware`` wraps the HTTP generation endpoints in a ``request`` span (child of a W3C ``traceparent``
sent by the client, else a new trace); ``annotate`` (called by ``Frontend.submit``, so the NATS API front
gets it too) adds the request's attributes and its ``auth`` child span. Everything is a no-op while
tracing is off (``bus.tracing``).
"""

from __future__ import annotations

from aiohttp import web

from bus import tracing

TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def middlewares() -> list:
    """The aiohttp middlewares to install first (outermost): none while tracing is off."""
    return [middleware] if tracing.enabled() else []


@web.middleware
async def middleware(request: web.Request, handler):
    """Run a generation request inside its root ``request`` span; record the HTTP status (and error)."""
    if request.path not in TRACED_PATHS or request.method != "POST":
        return await handler(request)
    parent = tracing.extract({"traceparent": request.headers["traceparent"]}) \
        if "traceparent" in request.headers else None
    if parent is None:
        from opentelemetry.context import Context
        parent = Context()  # a new trace, never a leftover of the serving task
    endpoint = "chat" if request.path.endswith("chat/completions") else "completions"
    with tracing.span("request", {"actorserve.endpoint": endpoint, "http.request.method": "POST",
                                  "url.path": request.path}, parent=parent) as span:
        resp = await handler(request)
        span.set_attributes({"http.response.status_code": resp.status,
                             "actorserve.status": "ok" if resp.status < 400 else "error"})
        if resp.status >= 400:
            tracing.set_error(f"HTTP {resp.status}")
        return resp


def annotate(*, request_id: str, tenant: str, name: str, version: str, endpoint: str, marks: dict) -> None:
    """Attributes of the current ``request`` span, and its ``auth`` child (marks ``gateway_in`` to
    ``auth_done``: the key check and body read, i.e. ``auth_ms``). No-op when tracing is off."""
    if not tracing.enabled():
        return
    tracing.set_attributes({"actorserve.request_id": request_id, "actorserve.tenant": tenant,
                            "actorserve.model": name, "actorserve.model_version": f"{name}@{version}",
                            "actorserve.endpoint": endpoint})
    if "gateway_in" in marks and "auth_done" in marks:
        tracing.record_span("auth", marks["gateway_in"], marks["auth_done"], attributes={"actorserve.tenant": tenant})
