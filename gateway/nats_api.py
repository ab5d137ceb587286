"""Public NATS API: ``as.api.v1.chat``, ``as.api.v1.completions`` (queue group "gateways") and ``as.api.v1.cancel``;
``as.api.v1.responses`` (the OpenAI Responses create, docs/responses.md) and ``as.api.v1.responses.get|
input_items|delete|cancel`` (a stored response, ``{"response_id": ...}``) where the gateway has JetStream.

Request: the OpenAI JSON body, published with a reply subject (the caller's inbox). Headers:
``Authorization: Bearer <api key>`` (required when the gateway has a tenancy layer, i.e. always in a
deployed stack: 401 otherwise) and optional ``x-actorserve-deadline-ms``. The reply subject must lie
under the key's tenant inbox prefix ``_INBOX.<tenant>.`` (403 otherwise: a tenant cannot direct output,
or charges, into another tenant's inbox). Model access and quotas apply as over HTTP. Replies, all JSON on the caller's inbox:
- non-streaming: one message, the chat.completion / text_completion object, or
  ``{"error": {...}, "status": N, "final": true}``;
- streaming (``"stream": true``): the same chunk objects as the SSE stream, one per message; the last
  one carries ``"final": true`` (it is the finish chunk, the usage chunk, or an error object).
Cancel: publish ``{"request_id": "<id>"}`` (the id, or the response id ``chatcmpl-<id>``) to
``as.api.v1.cancel`` with the same ``Authorization`` header; the cancel carries the tenant, and a
worker ignores a cancel from another tenant.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from bus import subjects, tracing
from bus.base import BusError, Msg
from gateway import pipeline
from gateway.frontend import Frontend, Submitted, new_request_id, parse_deadline_ms
from gateway.http import invalid_json
from gateway.merge import ChoiceMerger
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)


def error_reply(err: ApiError) -> bytes:
    """Error message for the NATS API: OpenAI error object plus status and final marker."""
    return orjson.dumps({**err.body(), "status": err.status, "retry_after": err.retry_after, "final": True})


def _header(msg: Msg, name: str) -> str | None:
    headers = msg.headers or {}
    return headers.get(name) or headers.get(name.lower()) or headers.get(name.title())


def forbidden_reply_subject(tenant: str) -> ApiError:
    """403 for a reply subject outside the tenant's inbox prefix. The reply goes to that foreign inbox, so
    it names no tenant."""
    return ApiError(403, "the reply subject must lie under your tenant's inbox prefix _INBOX.<tenant>. "
                    "(nats-py: connect with inbox_prefix=\"_INBOX.<tenant>\")",
                    type="permission_error", param="reply", code="reply_subject_not_allowed")


class NatsApi:
    """Serves the public NATS API on one Frontend; ``tenancy`` (gateway.tenancy.Tenancy) authenticates
    and admits like the HTTP front (None: single-tenant ``dev``, for tests without etcd)."""

    def __init__(self, frontend: Frontend, tenancy=None) -> None:
        self.fe = frontend
        self.tenancy = tenancy
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        self.responses = None  # gateway.responses_api.ResponsesApi once started with JetStream

    async def start(self) -> None:
        """Subscribe to the API subjects (queue group ``gateways``)."""
        bus, q = self.fe.bus, subjects.GATEWAYS_QUEUE
        self._subs = [await bus.subscribe(subjects.API_CHAT, self._spawn("chat"), queue=q),
                      await bus.subscribe(subjects.API_COMPLETIONS, self._spawn("completions"), queue=q),
                      await bus.subscribe(subjects.API_CANCEL, self._on_cancel, queue=q)]
        if self.tenancy is not None and self.tenancy.quotas is not None:  # JetStream: the Responses API
            from gateway.responses_api import ResponsesApi
            self.responses = ResponsesApi(self.fe, self.tenancy, bus.js())
            self._subs.append(await bus.subscribe(subjects.API_RESPONSES, self._spawn("responses"), queue=q))
            for subject, op in subjects.API_RESPONSES_OPS.items():
                self._subs.append(await bus.subscribe(subject, self._spawn("responses." + op), queue=q))

    async def stop(self) -> None:
        """Unsubscribe; requests in flight are cancelled."""
        for s in self._subs:
            await s.unsubscribe()
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, endpoint: str):
        async def handler(msg: Msg) -> None:
            if endpoint.startswith("responses."):
                work = self._handle_response_op(endpoint.split(".", 1)[1], msg)
            else:
                work = self._handle_responses(msg) if endpoint == "responses" else self._handle(endpoint, msg)
            task = asyncio.create_task(tracing.traced("request", work,
                                                      {"actorserve.endpoint": endpoint, "actorserve.front": "nats"}))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return handler

    async def _reply(self, msg: Msg, data: bytes) -> None:
        try:
            await self.fe.bus.publish(msg.reply, data)
        except BusError as exc:
            log.warning("NATS API reply to %s failed: %s", msg.reply, exc)

    def _tenant(self, msg: Msg, check_reply: bool = True) -> str:
        """Tenant id of the message's key (ApiError 401) whose inbox holds the reply subject (403)."""
        if self.tenancy is None:
            return pipeline.DEV_TENANT
        tenant = self.tenancy.cache.authenticate(_header(msg, "Authorization")).id
        if check_reply and not (msg.reply or "").startswith(subjects.tenant_inbox_prefix(tenant) + "."):
            raise forbidden_reply_subject(tenant)
        return tenant

    def _request(self, endpoint: str, msg: Msg, rid: str, marks: dict) -> pipeline.Request:
        """The pipeline request of an API message: tenant (ApiError 401 / 403), JSON body and deadline (400;
        orjson.JSONDecodeError for a body that is not JSON)."""
        tenant = self._tenant(msg)
        marks["auth_done"] = time.time()
        body = orjson.loads(msg.data)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        deadline_ms = parse_deadline_ms(body.get("deadline_ms"), _header(msg, "x-actorserve-deadline-ms"),
                                        self.fe.cfg)
        record = self.tenancy.cache.tenants[tenant] if self.tenancy is not None else None
        return pipeline.Request(tenant, endpoint, body, rid, deadline_ms, marks, record)

    async def _handle(self, endpoint: str, msg: Msg) -> None:
        if not msg.reply:
            return
        marks = {"gateway_in": time.time()}
        try:
            req = self._request(endpoint, msg, new_request_id(), marks)
            async with pipeline.admitted(self.fe, req, self.tenancy) as sub:  # 404 not allowed, 429 quota, 503
                await self._serve(msg, sub, req.body)
        except orjson.JSONDecodeError as exc:
            await self._reply(msg, error_reply(invalid_json(exc)))
        except ApiError as err:
            await self._reply(msg, error_reply(err))

    async def _handle_responses(self, msg: Msg) -> None:
        """``as.api.v1.responses``: a Responses create (docs/responses.md); replies as for chat, the
        streamed events one per message, the terminal one (completed / incomplete / failed) ``final``."""
        if not msg.reply:
            return
        from gateway import responses_format as rf
        marks = {"gateway_in": time.time()}
        try:
            tenant = self.tenancy.cache.tenants[self._tenant(msg)]
            marks["auth_done"] = time.time()
            preq, req, rec = await self.responses.prepare(tenant, orjson.loads(msg.data),
                                                          _header(msg, "x-actorserve-deadline-ms"), marks, {})

            async def send(ev: dict) -> None:
                final = ev["type"] in ("response.completed", "response.incomplete", "response.failed")
                await self._reply(msg, orjson.dumps({**ev, "final": True} if final else ev))
            if req["background"]:  # streamed: the run's events (it goes on whatever the caller does)
                await self.responses.background(preq, rec, send=send if req["stream"] else None)
                if not req["stream"]:
                    await self._reply(msg, orjson.dumps({**rf.response_object(rec), "final": True}))
                return
            rec = await self.responses.execute(preq, req, rec, send=send if req["stream"] else None)
            if not req["stream"]:
                await self._reply(msg, orjson.dumps(rf.response_object(rec)))
        except orjson.JSONDecodeError as exc:
            await self._reply(msg, error_reply(invalid_json(exc)))
        except ApiError as err:
            await self._reply(msg, error_reply(err))

    async def _handle_response_op(self, op: str, msg: Msg) -> None:
        """``as.api.v1.responses.<op>`` (get, input_items, delete, cancel): body ``{"response_id": ...}``
        (input_items also ``limit`` / ``order`` / ``after``); one reply, the JSON object the HTTP route
        answers, or an error reply (404 for another tenant's id, as over HTTP)."""
        if not msg.reply:
            return
        try:
            tenant = self._tenant(msg)
            body = orjson.loads(msg.data)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            await self._reply(msg, orjson.dumps(await self.responses.operate(op, tenant, body)))
        except orjson.JSONDecodeError as exc:
            await self._reply(msg, error_reply(invalid_json(exc)))
        except ApiError as err:
            await self._reply(msg, error_reply(err))

    async def _serve(self, msg: Msg, sub: Submitted, body: dict) -> None:
        """Run the submitted request to its end: one reply, or one per streamed object (the last ``final``)."""
        stream = body.get("stream") is True
        out = await pipeline.run(self.fe, sub, body, _Replies(self, msg) if stream else None)
        if out.error is not None:
            await self._reply(msg, error_reply(out.error))
        elif not stream:
            await self._reply(msg, orjson.dumps(out.merger.body()))

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            tenant = self._tenant(msg, check_reply=bool(msg.reply))
        except ApiError as err:
            if msg.reply:
                await self._reply(msg, error_reply(err))
            return
        try:
            rid = orjson.loads(msg.data).get("request_id", "")
        except (orjson.JSONDecodeError, AttributeError):
            rid = ""
        rid = rid if isinstance(rid, str) else ""  # 5 or null is malformed, not the id "5" / "None"
        rid = rid.split("-", 1)[1] if rid.startswith(("chatcmpl-", "cmpl-")) else rid
        try:
            subjects.cancel(rid)
        except ValueError:
            ok = False
        else:
            await self.fe.cancel(rid, "client", tenant=tenant)
            ok = True
        if msg.reply:
            await self._reply(msg, orjson.dumps({"cancelled": ok}))


class _Replies:
    """The pipeline sink of a streamed NATS API request: one reply per object, the very last one marked
    ``"final": true``."""

    def __init__(self, api: NatsApi, msg: Msg) -> None:
        self.api, self.msg = api, msg

    async def emit(self, events: list[dict], merger: ChoiceMerger) -> None:
        """Publish one chunk's objects to the caller's inbox."""
        for j, ev in enumerate(events):
            last = merger.done and j == len(events) - 1
            await self.api._reply(self.msg, orjson.dumps({**ev, "final": True} if last else ev))
