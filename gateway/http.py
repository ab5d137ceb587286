"""aiohttp HTTP front: OpenAI-compatible endpoints, health and readiness.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{model}, GET /healthz, GET /readyz,
GET /metrics (Prometheus text: ``Authorization: Bearer <operator token>`` when the gateway has one, else
only series without a tenant label; no API key), GET /dashboard and /dashboard/data (the operator dashboard,
gateway/dashboard.py, same credential); with a tenancy layer on JetStream also /v1/usage, /v1/jobs and
/v1/responses (gateway/responses_api.py).
Errors use the OpenAI error shape. A streamed request waits for its first chunk before sending any
byte, so errors found by the validator (e.g. context length) are real HTTP statuses. aiohttp does not
cancel handlers when a client goes away, so waits poll the transport and turn a disconnect into a
cancel on ``as.int.cancel.<id>``.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time

import orjson
from aiohttp import web

from bus import subjects
from bus.base import BusError
from bus.messages import ValidatorPing
from bus.nats_auth import OPERATOR_TOKEN_ENV
from gateway import pipeline, sse
from gateway import tracing as gw_tracing
from gateway.frontend import Frontend, Submitted, new_request_id, parse_deadline_ms
from gateway.merge import ChoiceMerger
from gateway.openapi import openapi_document
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def error_response(err: ApiError, extra_headers: dict | None = None) -> web.Response:
    """JSON error response with the OpenAI shape and Retry-After when set."""
    return web.json_response(err.body(), status=err.status, headers={**err.http_headers(), **(extra_headers or {})},
                             dumps=lambda o: orjson.dumps(o).decode())


def invalid_json(exc: Exception) -> ApiError:
    """The 400 of a body that is not JSON (same message on HTTP and NATS)."""
    return ApiError(400, f"We could not parse the JSON body of your request: {exc}", code="invalid_json")


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Turn aiohttp's own HTTP errors (404 route, 405, 413 body too large) into OpenAI-shaped errors."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(exc.status)
        return error_response(ApiError(exc.status, exc.reason or "error", code=code))


def client_gone(request: web.Request) -> bool:
    """True once the client's connection is closed or closing."""
    tr = request.transport
    return tr is None or tr.is_closing()


_FROM_ENV = object()


def operator_unauthorized() -> ApiError:
    """The 401 of ``GET /metrics`` without the operator's bearer token."""
    return ApiError(401, "GET /metrics needs the operator token: send Authorization: Bearer <token> with the "
                    "token of <state-dir>/operator-token (API keys are not accepted here)",
                    type="invalid_request_error", code="invalid_operator_token")


def operator_authorized(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (constant-time comparison)."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class HttpFront:
    """Handlers bound to one Frontend. ``operator_token``: the bearer token ``GET /metrics`` requires
    (default: ``$ACTORSERVE_OPERATOR_TOKEN``; None or "": no token, /metrics without per-tenant labels)."""

    def __init__(self, frontend: Frontend, tenancy=None, operator_token=_FROM_ENV) -> None:
        self.fe = frontend
        self.tenancy = tenancy  # gateway.tenancy.Tenancy; None = single tenant "dev" without keys
        if operator_token is _FROM_ENV:
            operator_token = os.environ.get(OPERATOR_TOKEN_ENV)
        self.operator_token = (operator_token or "").strip() or None

    def app(self, max_body_bytes: int = 4 * 1024 * 1024) -> web.Application:
        """The aiohttp application (``client_max_size`` = body limit, 413 above it)."""
        app = web.Application(client_max_size=max_body_bytes,
                              middlewares=[*gw_tracing.middlewares(), errors_middleware])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        if self.tenancy is not None:
            self.tenancy.add_routes(app)  # /v1/usage, /v1/jobs
            if self.tenancy.quotas is not None:  # JetStream is there: /v1/responses (docs/responses.md)
                from gateway.responses_api import ResponsesApi
                ResponsesApi(self.fe, self.tenancy, self.fe.bus.js()).add_routes(app)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/metrics", self.metrics)
        self._add_dashboard(app)
        return app

    def _add_dashboard(self, app: web.Application) -> None:
        """``/dashboard`` and ``/dashboard/data`` behind the operator token (gateway/dashboard.py)."""
        from gateway.dashboard import Dashboard
        from gateway.dashboard_feed import DashboardFeed

        workers = getattr(getattr(self.fe, "observer", None), "workers", None)
        feed = DashboardFeed(self.fe.bus, getattr(getattr(self.fe, "resolver", None), "registry", None), workers)
        Dashboard(feed, self.operator_token, operator_authorized).add_routes(app)

    async def metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: this process's Prometheus metrics (docs/observability.md). With an operator
        token configured it needs ``Authorization: Bearer <token>`` (401 otherwise) and serves everything;
        without one it serves the series with the ``tenant`` label summed away (no per-tenant traffic)."""
        from prometheus_client import CONTENT_TYPE_LATEST

        from actors.metrics import render_latest
        from gateway.metrics import render_without_tenants

        if self.operator_token is None:
            body = render_without_tenants()
        elif operator_authorized(request.headers.get("Authorization"), self.operator_token):
            body = render_latest()
        else:
            return error_response(operator_unauthorized(), {"WWW-Authenticate": "Bearer"})
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the process answers."""
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: bus connected, a validator answers, every active model version has a live worker."""
        checks = {"bus": self.fe.bus.is_connected, "models": self.fe.resolver.snapshot.all_versions_served()}
        try:
            await self.fe.bus.request(subjects.VALIDATE, ValidatorPing().encode(), 1.0)
            checks["validator"] = True
        except BusError:
            checks["validator"] = False
        return web.json_response({"ready": all(checks.values()), "checks": checks},
                                 status=200 if all(checks.values()) else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        """``GET /openapi.json``: OpenAPI 3.1 document of the public endpoints."""
        models = [m["id"] for m in self.fe.resolver.snapshot.model_list()]
        return web.json_response(openapi_document(models, f"{request.scheme}://{request.host}"))

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: registered models (``name`` and ``name@version``) and the LoRA adapters the
        caller may use (``name:adapter`` with ``parent``)."""
        data = self.fe.resolver.snapshot.model_list(self._tenant_id(request))
        if self.tenancy is not None:
            data = self.tenancy.visible_models(request, data)
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (OpenAI's retrieve model): the :meth:`models` entry of that id; 404
        ``model_not_found`` for an id unknown or not allowed to the caller (indistinguishable by design)."""
        from gateway.models import not_found

        want = request.match_info["model"]
        data = self.fe.resolver.snapshot.model_list(self._tenant_id(request))
        if self.tenancy is not None:
            data = self.tenancy.visible_models(request, data)
        entry = next((m for m in data if m.get("id") == want), None)
        return web.json_response(entry) if entry is not None else error_response(not_found(want))

    def _tenant_id(self, request: web.Request) -> str | None:
        """The caller's tenant id (401 without a valid key), None without tenancy."""
        return self.tenancy.authenticate(request).id if self.tenancy is not None else None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``."""
        return await self._generate(request, "completions")

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        marks = {"gateway_in": time.time()}
        client_rid = request.headers.get("X-Request-Id", "")
        rid = new_request_id()
        echo = {"X-Request-Id": client_rid if _REQUEST_ID.match(client_rid) else rid}
        try:
            req = await self._request(request, endpoint, rid, echo, marks)  # 400, 401
            idem_key = request.headers.get("Idempotency-Key")
            if req.tenant is not None and idem_key is not None and self.tenancy.idempotency is not None:
                return await self.tenancy.idempotency.handle(self, request, req, idem_key)
            async with pipeline.admitted(self.fe, req, self.tenancy) as sub:  # 404 not allowed, 429 quota, 503
                return await self._respond(request, sub, echo)
        except ApiError as err:
            return error_response(err, echo)

    async def _request(self, request: web.Request, endpoint: str, rid: str, echo: dict,
                       marks: dict) -> pipeline.Request:
        """The pipeline request of an HTTP call: tenant (ApiError 401), JSON body and deadline (400)."""
        tenant = self.tenancy.authenticate(request) if self.tenancy is not None else None
        body = await self._json_body(request)
        marks["auth_done"] = time.time()
        deadline_ms = parse_deadline_ms(body.get("deadline_ms"), request.headers.get("x-actorserve-deadline-ms"),
                                        self.fe.cfg)
        return pipeline.Request(tenant.id if tenant else pipeline.DEV_TENANT, endpoint, body, rid, deadline_ms, marks,
                                tenant, echo)

    async def _json_body(self, request: web.Request) -> dict:
        raw = await request.read()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid_json(exc) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def _respond(self, request: web.Request, sub: Submitted, echo: dict) -> web.StreamResponse:
        """Run the submitted request to its end and answer it (JSON or SSE); 499 when the client left."""
        writer = SseWriter(request, echo) if sub.body.stream else None
        out = await pipeline.run(self.fe, sub, sink=writer, gone=lambda: client_gone(request))
        if writer is not None:
            return await writer.finish(out)
        if out.disconnected:
            return web.Response(status=499)
        if out.error is not None:
            return error_response(out.error, echo)
        headers = {**echo, "x-actorserve-model-version": out.merger.model,
                   "x-actorserve-timing": orjson.dumps(out.merger.final_timing()).decode()}
        return web.json_response(out.merger.body(), headers=headers, dumps=lambda o: orjson.dumps(o).decode())


def inband_error(err: ApiError) -> dict:
    """The SSE error event for an error met after streaming began (no HTTP status can be sent any more):
    the OpenAI error object plus the extension fields ``status`` (what the HTTP status would have been, as the
    hop that found it said), ``retryable`` and ``retry_after`` (s), so a client can tell e.g. ``worker_lost``
    (retry) from a bad request."""
    body = err.body()
    body["error"].update(status=err.status, retryable=err.retryable, retry_after=err.retry_after)
    return body


class SseWriter:
    """The pipeline sink of a streamed HTTP request: OpenAI SSE events, ending with ``data: [DONE]``.

    No byte is sent before the first chunk, so an error found before it (e.g. the validator's context
    length check) is a real HTTP status; after it an error is an in-band event (:func:`inband_error`)."""

    def __init__(self, request: web.Request, headers: dict) -> None:
        self.request, self.headers = request, headers
        self.resp: web.StreamResponse | None = None  # prepared at the first chunk

    async def send(self, obj: dict) -> None:
        """One ``data:`` event (raises ConnectionResetError if the client is gone)."""
        await self.resp.write(sse.data_event(sse.json_payload(obj)))

    async def emit(self, events: list[dict], merger: ChoiceMerger) -> None:
        """Send one chunk's objects, the response headers first (the model version that serves it)."""
        if self.resp is None:
            resp = web.StreamResponse(headers={**self.headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", "x-actorserve-model-version": merger.model})
            await resp.prepare(self.request)
            self.resp = resp
        for ev in events:
            await self.send(ev)

    async def finish(self, out: pipeline.Outcome) -> web.StreamResponse:
        """The response: an error status before streaming began, else the stream's tail (error event, DONE)."""
        if self.resp is None:
            return web.Response(status=499) if out.disconnected else error_response(out.error, self.headers)
        if out.disconnected:
            return self.resp
        try:
            if out.failure is not None:
                await self.send(inband_error(out.failure))
            await self.resp.write(sse.DONE)
        except ConnectionResetError:
            pass  # the generation has ended already: nothing to cancel
        return self.resp
