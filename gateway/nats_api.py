"""Public NATS API: ``as.api.v1.chat``, ``as.api.v1.completions`` (queue group "gateways") and ``as.api.v1.cancel``;
``as.api.v1.responses`` (the OpenAI Responses create, docs/responses.md) and ``as.api.v1.responses.get|
input_items|delete|cancel`` (a stored response, ``{"response_id": ...}``) where the gateway has JetStream.

Request: the OpenAI JSON body, published with a reply subject (the caller's inbox). Headers:
``Authorization: Bearer <api key>`` (required when the gateway has a tenancy layer, i.e. always in a
deployed stack: 401 otherwise) and optional ``x-actorserve-deadline-ms``. The reply subject must lie
under the key's tenant inbox prefix ``_INBOX.<tenant>.``: otherwise the request is dropped with no reply
at all (logged, counted in ``actorserve_nats_api_dropped_total``), since the gateway never publishes to a
subject the caller may not subscribe to; a request without a valid key gets its 401 only on an inbox that
is no tenant's or role's (else it is dropped the same way). Model access and quotas apply as over HTTP.
Replies, all JSON on the caller's inbox:
- non-streaming: one message, the chat.completion / text_completion object, or
  ``{"error": {...}, "status": N, "final": true}``;
- streaming (``"stream": true``): the same chunk objects as the SSE stream, one per message; the last
  one carries ``"final": true`` (it is the finish chunk, the usage chunk, or an error object).
Cancel: publish ``{"request_id": "<id>"}`` (the id, or the response id ``chatcmpl-<id>``) to
``as.api.v1.cancel`` with the same ``Authorization`` header. The gateway that receives it finds the
gateway holding the request (its own table, else a request on ``as.int.gwcancel.<id>`` that only the
holder answers, within :data:`CANCEL_LOOKUP_S`), cancels it when it belongs to the caller's tenant, and
replies ``{"request_id", "found", "cancelled"}``; a ``request_id`` that is missing or not a string is a 400.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson

from bus import subjects, tracing
from bus.base import BusError, Msg
from bus.messages import Cancel
from gateway import metrics as gw_metrics
from gateway import pipeline
from gateway.frontend import Frontend, Submitted, new_request_id, parse_deadline_ms
from gateway.http import invalid_json
from gateway.merge import ChoiceMerger
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

CANCEL_LOOKUP_S = 0.5  # how long a cancel waits for the gateway holding the request to answer (s)
DROP_LOG_EVERY_S = 5.0  # at most one log line per drop reason in this many seconds (the rest are counted)


class DroppedRequest(Exception):
    """A NATS API request that gets no reply at all: its reply subject is one the caller may not
    subscribe to. ``reason``: the ``actorserve_nats_api_dropped_total`` label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def reply_allowed(tenant: str, reply: str | None) -> bool:
    """Whether ``reply`` is a concrete subject under the tenant's inbox prefix ``_INBOX.<tenant>.``
    (what that tenant's NATS users may subscribe to)."""
    prefix = subjects.tenant_inbox_prefix(tenant) + "."
    return bool(reply) and reply.startswith(prefix) and _concrete(reply[len(prefix):])


def _concrete(subject: str) -> bool:
    """A subject with non-empty tokens and no wildcard or white space."""
    return all(t and t not in ("*", ">") and not any(c.isspace() for c in t) for t in subject.split("."))


def unowned_inbox(reply: str | None, tenants) -> bool:
    """Whether ``reply`` is an inbox ``_INBOX.<token>[.…]`` whose token is no tenant id in ``tenants``
    (a container of ids): a default nats-py inbox, where a 401 tells no tenant anything. Role inboxes
    (``_INBOX_<role>``) and every other subject are not."""
    head, _, rest = (reply or "").partition(".")
    token = rest.split(".", 1)[0]
    return head == subjects.INBOX and _concrete(rest) and token not in tenants


def error_reply(err: ApiError) -> bytes:
    """Error message for the NATS API: OpenAI error object plus status and final marker."""
    return orjson.dumps({**err.body(), "status": err.status, "retry_after": err.retry_after, "final": True})


def _header(msg: Msg, name: str) -> str | None:
    headers = msg.headers or {}
    return headers.get(name) or headers.get(name.lower()) or headers.get(name.title())


class NatsApi:
    """Serves the public NATS API on one Frontend; ``tenancy`` (gateway.tenancy.Tenancy) authenticates
    and admits like the HTTP front (None: single-tenant ``dev``, for tests without etcd)."""

    def __init__(self, frontend: Frontend, tenancy=None) -> None:
        self.fe = frontend
        self.tenancy = tenancy
        self._subs: list = []
        self._tasks: set[asyncio.Task] = set()
        self.responses = None  # gateway.responses_api.ResponsesApi once started with JetStream
        self._last_drop_log: dict[str, float] = {}  # reason -> time of its last log line (monotonic s)
        self._unlogged: dict[str, int] = {}  # reason -> drops not logged since then

    async def start(self) -> None:
        """Subscribe to the API subjects (queue group ``gateways``)."""
        bus, q = self.fe.bus, subjects.GATEWAYS_QUEUE
        self._subs = [await bus.subscribe(subjects.API_CHAT, self._spawn("chat"), queue=q),
                      await bus.subscribe(subjects.API_COMPLETIONS, self._spawn("completions"), queue=q),
                      await bus.subscribe(subjects.API_CANCEL, self._spawn("cancel"), queue=q),
                      await bus.subscribe(subjects.gateway_cancel_all(), self._on_cancel_lookup)]  # every gateway
        if self.tenancy is not None and self.tenancy.quotas is not None:  # JetStream: the Responses API
            from gateway.responses_api import ResponsesApi
            self.responses = ResponsesApi(self.fe, self.tenancy, bus.js())
            self._subs.append(await bus.subscribe(subjects.API_RESPONSES, self._spawn("responses"), queue=q))
            for subject, op in subjects.API_RESPONSES_OPS.items():
                self._subs.append(await bus.subscribe(subject, self._spawn("responses." + op), queue=q))
            for kind, ops in (("files", subjects.API_FILES_OPS), ("batches", subjects.API_BATCHES_OPS)):
                for subject, op in ops.items():  # OpenAI Files and Batch (docs/batch.md)
                    self._subs.append(await bus.subscribe(subject, self._spawn(f"{kind}.{op}"), queue=q))

    async def stop(self) -> None:
        """Unsubscribe; requests in flight are cancelled."""
        for s in self._subs:
            await s.unsubscribe()
        for t in list(self._tasks):
            t.cancel()

    def _spawn(self, endpoint: str):
        async def handler(msg: Msg) -> None:
            if endpoint.startswith(("responses.", "files.", "batches.")):
                work = self._handle_op(*endpoint.split(".", 1), msg)
            elif endpoint == "cancel":
                work = self._on_cancel(msg)
            else:
                work = self._handle_responses(msg) if endpoint == "responses" else self._handle(endpoint, msg)
            task = asyncio.create_task(tracing.traced("request", self._guarded(endpoint, msg, work),
                                                      {"actorserve.endpoint": endpoint, "actorserve.front": "nats"}))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return handler

    async def _guarded(self, endpoint: str, msg: Msg, work) -> None:
        """Run one request's handler; a :class:`DroppedRequest` ends it with no reply, logged (rate-limited,
        no key or body) and counted."""
        try:
            await work
        except DroppedRequest as drop:
            gw_metrics.count_dropped(drop.reason, endpoint)
            now = time.monotonic()
            if now - self._last_drop_log.get(drop.reason, -DROP_LOG_EVERY_S) < DROP_LOG_EVERY_S:
                self._unlogged[drop.reason] = self._unlogged.get(drop.reason, 0) + 1
                return
            self._last_drop_log[drop.reason] = now
            more = self._unlogged.pop(drop.reason, 0)
            log.warning("NATS API %s request on %s dropped without a reply (%s): %s%s", endpoint, msg.subject,
                        drop.reason, drop, f" ({more} more since the last such line)" if more else "")

    async def _reply(self, msg: Msg, data: bytes) -> None:
        try:
            await self.fe.bus.publish(msg.reply, data)
        except BusError as exc:
            log.warning("NATS API reply to %s failed: %s", msg.reply, exc)

    def _tenant(self, msg: Msg, check_reply: bool = True) -> str:
        """Tenant id of the message's key whose inbox holds the reply subject. Raises ApiError 401 (no valid
        key, and a reply subject that is no tenant's or role's inbox) or :class:`DroppedRequest` (a reply
        subject the caller may not subscribe to: nothing may be published there)."""
        if self.tenancy is None:
            return pipeline.DEV_TENANT
        try:
            tenant = self.tenancy.cache.authenticate(_header(msg, "Authorization")).id
        except ApiError:
            if msg.reply and not unowned_inbox(msg.reply, self.tenancy.cache.tenants):
                raise DroppedRequest("unauthenticated", f"no valid API key, and the reply subject {msg.reply!r} "
                                     "may belong to someone else") from None
            raise
        if check_reply and not reply_allowed(tenant, msg.reply):
            raise DroppedRequest("reply_outside_inbox", f"tenant {tenant}'s reply subject {msg.reply!r} lies outside "
                                 f"{subjects.tenant_inbox_prefix(tenant)}.>")
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
                await self._serve(msg, sub)
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

    async def _handle_op(self, kind: str, op: str, msg: Msg) -> None:
        """``as.api.v1.<kind>.<op>`` for the stored objects: ``responses`` (get, input_items, delete, cancel; body
        ``{"response_id"}``, input_items also ``limit`` / ``order`` / ``after``), ``files`` and ``batches``
        (gateway/files_api.py and gateway/batches_api.py ``operate`` say what each operation takes). A JSON
        body, one reply: the object the HTTP route answers, or an error reply (404 for another tenant's id, as
        over HTTP)."""
        if not msg.reply:
            return
        try:
            tenant = self._tenant(msg)
            body = orjson.loads(msg.data)
            if not isinstance(body, dict):
                raise ApiError(400, "the request body must be a JSON object")
            await self._reply(msg, orjson.dumps(await self._operate(kind, op, tenant, body)))
        except orjson.JSONDecodeError as exc:
            await self._reply(msg, error_reply(invalid_json(exc)))
        except ApiError as err:
            await self._reply(msg, error_reply(err))

    async def _operate(self, kind: str, op: str, tenant: str, body: dict) -> dict:
        if kind == "responses":
            return await self.responses.operate(op, tenant, body)
        if kind == "files":  # a file travels whole in one message: the connection's limit bounds it
            return await self.tenancy.files.operate(op, tenant, body, max_payload=_max_payload(self.fe.bus))
        return await self.tenancy.batches.operate(op, tenant, body)

    async def _serve(self, msg: Msg, sub: Submitted) -> None:
        """Run the submitted request to its end: one reply, or one per streamed object (the last ``final``)."""
        stream = sub.body.stream
        out = await pipeline.run(self.fe, sub, sink=_Replies(self, msg) if stream else None)
        if out.error is not None:
            await self._reply(msg, error_reply(out.error))
        elif not stream:
            await self._reply(msg, orjson.dumps(out.merger.body()))

    async def _on_cancel(self, msg: Msg) -> None:
        """``as.api.v1.cancel``: find the request (this gateway's table, else the gateway that holds it),
        cancel it when it is the caller's tenant's, reply ``{"request_id", "found", "cancelled"}`` (or an
        error: 400 for a body without a string ``request_id``, 401)."""
        try:
            tenant = self._tenant(msg, check_reply=bool(msg.reply))
        except ApiError as err:
            if msg.reply:
                await self._reply(msg, error_reply(err))
            return
        try:
            given = cancel_request_id(msg.data)
            rid = given.split("-", 1)[1] if given.startswith(("chatcmpl-", "cmpl-")) else given
            held, choices = await self._find(rid, tenant)
            if held is not None:
                await self.fe.cancel(held, "client", tenant=tenant, num_choices=choices)
            data = orjson.dumps({"request_id": given, "found": held is not None, "cancelled": held is not None})
        except orjson.JSONDecodeError as exc:
            data = error_reply(invalid_json(exc))
        except ApiError as err:
            data = error_reply(err)
        if msg.reply:
            await self._reply(msg, data)

    async def _find(self, rid: str, tenant: str) -> tuple[str | None, int]:
        """``(request id, choices)`` of the in-flight request ``rid`` of ``tenant`` at this gateway or the
        one that answers ``as.int.gwcancel.<rid>`` within CANCEL_LOOKUP_S; ``(None, 0)`` when none holds it
        (unknown, finished, another tenant's, or a malformed id)."""
        entry = self.fe.table.get(rid)
        if entry is not None:  # ids are unique: held here, by this tenant or not at all
            return (entry.request_id, entry.children) if entry.tenant == tenant else (None, 0)
        try:
            reply = await self.fe.bus.request(subjects.gateway_cancel(rid), Cancel(rid, "client", tenant).encode(),
                                              CANCEL_LOOKUP_S)
            found = orjson.loads(reply.data)
            return str(found["request_id"]), max(1, int(found.get("choices") or 1))
        except (ValueError, BusError, KeyError, TypeError, orjson.JSONDecodeError):
            return None, 0  # ValueError: not a request id at all; BusError: nobody holds it (timeout)

    async def _on_cancel_lookup(self, msg: Msg) -> None:
        """``as.int.gwcancel.<id>`` from another gateway: answer only when this gateway holds the request
        and it is the asking tenant's (silence otherwise: the asker times out to "not found")."""
        try:
            ask = Cancel.decode(msg.data)
        except ValueError:
            return
        entry = self.fe.table.get(ask.request_id)
        if entry is None or entry.tenant != ask.tenant or not msg.reply:
            return
        try:
            await msg.respond(orjson.dumps({"found": True, "request_id": entry.request_id, "choices": entry.children}))
        except BusError as exc:
            log.warning("cancel look-up answer for %s failed: %s", ask.request_id, exc)


def cancel_request_id(data: bytes) -> str:
    """The ``request_id`` of a cancel body. Raises orjson.JSONDecodeError (not JSON) or ApiError 400
    naming ``request_id`` (not an object, missing, not a string)."""
    body = orjson.loads(data)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", param="request_id")
    rid = body.get("request_id")
    if rid is None:
        raise ApiError(400, "you must provide request_id (the id, or the response id chatcmpl-<id>)",
                       param="request_id", code="missing_required_parameter")
    if not isinstance(rid, str):
        raise ApiError(400, f"request_id must be a string, got {type(rid).__name__}", param="request_id",
                       code="invalid_type")
    return rid


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


def _max_payload(bus) -> int | None:
    """The connection's NATS max_payload in bytes (None on a bus without one, e.g. the in-memory bus)."""
    limit = getattr(bus, "max_payload", None)  # NatsBus.max_payload: a property
    return limit if isinstance(limit, int) and limit > 0 else None
