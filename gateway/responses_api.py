"""OpenAI Responses API on the gateway (docs/responses.md): HTTP routes and the core the NATS API shares.

* ``POST /v1/responses`` — create: the request is translated into a chat-completions body
  (gateway/responses_format.py) and run through the gateway pipeline (tenancy, quotas, priority,
  deadlines as for ``/v1/chat/completions``). ``stream: true``: SSE events ``event: <type>`` /
  ``data: {...}`` (``response.created`` ... ``response.completed``). ``background: true``: answered at
  once with status ``queued`` (with ``stream``: the run's events); the run goes on in a gateway task,
  independent of the client. The stored-response operations (:meth:`ResponsesApi.operate`) serve both
  the HTTP routes below and the NATS subjects ``as.api.v1.responses.<op>`` (gateway/nats_api.py).
* ``GET /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``DELETE /v1/responses/{id}``,
  ``POST /v1/responses/{id}/cancel`` (background responses only) — own tenant only: another tenant's
  id is a 404, indistinguishable from an unknown one.

Storage (``store`` defaults to true): JetStream KV bucket ``as_responses`` (bus/streams.py, file, TTL 30
days after the last write), key ``r.<tenant>.<response id>``, value the record of :func:`record`. The
response id is ``resp_<request id>``, so a cancel from any gateway replica reaches the generation.
``previous_response_id`` (same tenant, status completed or incomplete): that response's history, input
and output items become the history of the new one (its ``instructions`` are not carried over).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import orjson
from aiohttp import web

from bus import streams
from bus.kv import KvConflict, KvError
from gateway import pipeline, sse
from gateway import responses_format as rf
from gateway.frontend import Frontend, new_request_id, parse_deadline_ms
from gateway.merge import ChoiceMerger
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

TTL_S = streams.RESPONSES_TTL_S
POLL_S = 0.1  # how often a repeated Idempotency-Key polls the record of a run still going (s)


def response_key(tenant: str, response_id: str) -> str:
    """KV key of a stored response, scoped by tenant."""
    return f"r.{tenant}.{response_id}"


def idempotent_request_id(tenant: str, idem_key: str) -> str:
    """The request id (32 hex) of a tenant's ``Idempotency-Key``: every retry maps to one response id
    (``resp_<request id>``). ApiError 400 for an empty key or one over 255 characters."""
    if not 0 < len(idem_key) <= 255:
        raise ApiError(400, "Idempotency-Key must have 1 to 255 characters", param="Idempotency-Key")
    return hashlib.sha256(f"{tenant}\0{idem_key}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


def not_found(response_id: str) -> ApiError:
    """404 of an unknown (or another tenant's) response id."""
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _unavailable() -> ApiError:
    return ApiError(503, "response storage is unavailable; retry later", type="unavailable",
                    code="responses_unavailable", retry_after=1.0)


def _mapped(err: ApiError) -> ApiError:
    """A chat-pipeline error with its field named as the Responses field."""
    return ApiError(err.status, err.message, rf.response_param(err.param), err.code, err.type, err.retry_after,
                    err.headers)


def record(resp_id: str, rid: str, tenant: str, req: dict, history: list[dict], deadline_ms: int,
           status: str) -> dict:
    """A stored response: ids, tenant, status, the echoed request, ``history`` + ``input_items`` (what
    a chained response builds on), ``output``, ``usage``, timestamps (``deadline_at`` epoch s)."""
    now = time.time()
    return {"id": resp_id, "request_id": rid, "tenant": tenant, "created_at": int(now), "status": status,
            "model": req["model"], "request": rf.public_request(req), "history": history,
            "input_items": req["_items"], "output": [], "usage": None, "error": None, "incomplete_details": None,
            "completed_at": None, "deadline_at": now + deadline_ms / 1e3}


def finished(rec: dict, out: pipeline.Outcome, output: list[dict] | None = None) -> dict:
    """``rec`` after its run's Outcome: output items, usage, status (completed / incomplete / failed /
    cancelled), error. ``output``: the streamed items (None: taken from the merged body)."""
    rec = {**rec, "model": out.merger.model or rec["model"], "completed_at": rf.now_s()}
    if out.ok:
        body = out.merger.body()
        items, finish = rf.output_from_chat(body)
        rec["status"], rec["incomplete_details"] = rf.status_of(finish)
        rec["output"] = output if output is not None else items
        rec["usage"] = rf.usage(body.get("usage"))
    else:
        err = out.error
        cancelled = out.disconnected or (err is not None and err.status == 408 and err.code == "cancelled")
        rec["status"] = "cancelled" if cancelled else "failed"
        rec["output"] = output or []
        rec["error"] = None if err is None else {"code": err.code or err.type, "message": err.message}
    return rec


class EventSink:
    """Pipeline sink of a streamed response: translates chat chunks into Responses events and hands each
    to ``send`` (an ``async (event: dict) -> None``; ConnectionResetError = the client left). The
    ``response.created`` / ``response.in_progress`` events go out with the first chunk."""

    def __init__(self, send, rec: dict) -> None:
        self.send, self.rec, self.tr, self.started = send, rec, rf.StreamTranslator(), False

    async def emit(self, events: list[dict], merger: ChoiceMerger) -> None:
        """Send the Responses events of one chunk's chat objects."""
        out = []
        if not self.started:
            self.started = True
            self.rec["model"] = merger.model or self.rec["model"]
            out += self.tr.start(rf.response_object({**self.rec, "status": "in_progress"}))
        for ev in events:
            out += self.tr.chunk(ev)
        for ev in out:
            await self.send(ev)

    def closing(self, rec: dict) -> list[dict]:
        """The events that end the stream of the finished ``rec``: its open items closed (so the items in
        ``rec["output"]``, the translator's own, get their final status) and the terminal event."""
        return self.tr.finish(rf.response_object(rec))


class ResponsesApi:
    """The Responses API of one gateway. ``tenancy``: gateway.tenancy.Tenancy; ``js``: a
    bus.jetstream.JetStream (the bucket is opened on first use)."""

    def __init__(self, frontend: Frontend, tenancy, js) -> None:
        self.fe, self.tenancy, self.js = frontend, tenancy, js
        self._kv = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def kv(self):
        """The ``as_responses`` bucket (ApiError 503 while JetStream does not answer)."""
        async with self._lock:
            if self._kv is None:
                try:
                    self._kv = await self.js.bucket(streams.RESPONSES)
                except KvError as exc:
                    log.warning("responses bucket unavailable: %r", exc)
                    raise _unavailable() from None
        return self._kv

    async def _read(self, tenant: str, resp_id: str) -> dict:
        if not (resp_id.startswith("resp_") and resp_id.isascii() and resp_id[5:].isalnum() and len(resp_id) <= 69):
            raise not_found(resp_id)
        try:
            e = await (await self.kv()).get(response_key(tenant, resp_id))
        except KvError:
            raise _unavailable() from None
        if e is None or not e.value:
            raise not_found(resp_id)
        return rf.lost(e.value, time.time())

    async def _write(self, rec: dict) -> None:
        try:
            await (await self.kv()).put(response_key(rec["tenant"], rec["id"]), rec)
        except KvError as exc:
            log.warning("response %s not stored: %r", rec["id"], exc)
            raise _unavailable() from None

    async def _claim(self, rec: dict, req: dict, body: dict) -> dict | None:
        """Claim an ``Idempotency-Key``'s response id (atomic create of ``rec``): None when claimed, else
        the record already there (ApiError 409 when it was made by a different body, 400 without store)."""
        if not req["store"]:
            raise ApiError(400, "Idempotency-Key needs store=true", param="Idempotency-Key")
        rec["body_hash"] = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()
        try:
            await (await self.kv()).create(response_key(rec["tenant"], rec["id"]), rec)
            return None
        except KvConflict:
            old = await self._read(rec["tenant"], rec["id"])
        except KvError:
            raise _unavailable() from None
        if old.get("body_hash") != rec["body_hash"]:
            raise ApiError(409, "Idempotency-Key was already used with a different request body",
                           param="Idempotency-Key", code="idempotency_key_conflict")
        return old

    async def _forget(self, rec: dict) -> None:
        """Delete an idempotent claim whose run failed (best effort)."""
        try:
            await (await self.kv()).delete(response_key(rec["tenant"], rec["id"]))
        except (KvError, ApiError) as exc:
            log.warning("idempotent response %s not released: %r", rec["id"], exc)

    async def _replay(self, request: web.Request, rec: dict, stream: bool) -> web.StreamResponse:
        """Answer a repeated ``Idempotency-Key``: the stored response (waited for while a foreground run
        or a streamed one is; 409 if that run failed meanwhile), as JSON or as the replayed event stream."""
        while rec["status"] not in rf.TERMINAL and (stream or not rec["request"].get("background")):
            await asyncio.sleep(POLL_S)
            try:
                rec = await self._read(rec["tenant"], rec["id"])
            except ApiError as err:
                if err.status != 404:
                    raise
                raise ApiError(409, "the request first sent with this Idempotency-Key failed; retry it",
                               param="Idempotency-Key", code="idempotency_key_retry", retry_after=0.1) from None
        obj, headers = rf.response_object(rec), {"Idempotent-Replayed": "true"}
        if not stream:
            return web.json_response(obj, headers=headers)
        writer = _SseEvents(request, headers)
        for ev in rf.replay_events(obj):
            await writer.send(ev)
        return writer.resp

    def add_routes(self, app: web.Application) -> None:
        """Register the /v1/responses routes."""
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{id}", self.get)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_get("/v1/responses/{id}/input_items", self.input_items)
        app.router.add_post("/v1/responses/{id}/cancel", self.cancel)

    # -- the shared core -----------------------------------------------------------------------------

    async def prepare(self, tenant, body, deadline_header: str | None, marks: dict, headers: dict,
                      rid: str | None = None) -> tuple[pipeline.Request, dict, dict]:
        """``(pipeline request, parsed request, record)`` of a create body for ``tenant`` (a Tenant
        record); ``rid``: the request id (None: a new one). ApiError 400 (field named), 404
        (``previous_response_id`` unknown), 503."""
        req = rf.parse_request(body)
        history: list[dict] = []
        prev_id = req.get("previous_response_id")
        if prev_id:
            try:
                prev = await self._read(tenant.id, prev_id)
            except ApiError as err:
                if err.status == 404:
                    raise ApiError(404, err.message, param="previous_response_id", code="not_found") from None
                raise
            if prev["status"] not in ("completed", "incomplete"):
                raise ApiError(400, f"previous response {prev_id} is {prev['status']}; only completed responses "
                                    "can be continued", param="previous_response_id")
            history = prev.get("history", []) + prev.get("input_items", []) + prev.get("output", [])
        deadline_ms = parse_deadline_ms(req.get("deadline_ms"), deadline_header, self.fe.cfg)
        rid = rid or new_request_id()
        chat = rf.chat_body(req, history)
        preq = pipeline.Request(tenant.id, "chat", chat, rid, deadline_ms, marks, tenant, headers)
        rec = record("resp_" + rid, rid, tenant.id, req, history, deadline_ms,
                     "queued" if req["background"] else "in_progress")
        return preq, req, rec

    async def execute(self, preq: pipeline.Request, req: dict, rec: dict, send=None, gone=None) -> dict:
        """Run one foreground response: the finished record (stored when ``store``). ``send``: the
        event callback of a streamed run. ApiError (field named) when it fails before any event was sent."""
        sink = EventSink(send, rec) if send is not None else None
        try:
            async with pipeline.admitted(self.fe, preq, self.tenancy) as sub:
                out = await pipeline.run(self.fe, sub, sink=sink, gone=gone)
        except ApiError as err:
            raise _mapped(err) from None
        if out.error is not None and (sink is None or not sink.started):
            raise _mapped(out.error)
        rec = finished(rec, out, sink.tr.output if sink is not None and sink.started else None)
        tail = sink.closing(rec) if sink is not None and sink.started and not out.disconnected else []
        if out.disconnected and rec.get("body_hash"):
            await self._forget(rec)  # an idempotent claim whose client left: a retry runs again
        if req["store"] and not out.disconnected:
            try:
                await self._write(rec)
            except ApiError:
                log.warning("response %s was answered but not stored", rec["id"])
        try:
            for ev in tail:
                await sink.send(ev)
        except ConnectionResetError:
            pass
        return rec

    async def background(self, preq: pipeline.Request, rec: dict, send=None) -> asyncio.Task:
        """Store the queued record and start its run in a gateway task (returned; it ends after the
        record's final write). ``send``: the event callback of ``stream: true`` (as for :meth:`execute`):
        the run's events go to it until the client leaves (ConnectionResetError), the run goes on."""
        await self._write(rec)
        task = asyncio.create_task(self._run_background(preq, rec, _Detachable(send) if send else None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _update(self, rec: dict, change) -> dict | None:
        """Compare-and-swap the stored record (``change(current) -> new | None``); None when it is gone."""
        try:
            return (await (await self.kv()).update(response_key(rec["tenant"], rec["id"]), change)).value
        except (KvError, ApiError, TimeoutError) as exc:
            log.warning("response %s not updated: %r", rec["id"], exc)
            return None

    async def _run_background(self, preq: pipeline.Request, rec: dict, send=None) -> None:
        def unless_ended(new: dict):
            return lambda cur: None if cur is None or cur["status"] in rf.TERMINAL else new
        sink = EventSink(send, rec) if send is not None else None
        try:
            started = await pipeline.start(self.fe, preq, self.tenancy)
        except ApiError as err:
            err = _mapped(err)
            end = {**rec, "status": "failed", "completed_at": rf.now_s(),
                   "error": {"code": err.code or err.type, "message": err.message}}
        else:
            try:
                cur = await self._update(rec, unless_ended({**rec, "status": "in_progress"}))
                if cur is None or cur["status"] != "in_progress":  # cancelled (or deleted) before it started
                    await self.fe.cancel(preq.request_id, "client", tenant=preq.tenant_id)
                out = await pipeline.run(self.fe, started.sub, sink=sink)
            finally:
                await started.release()
            end = finished(rec, out, sink.tr.output if sink is not None and sink.started else None)
        tail = _ending(sink, end) if sink is not None else []  # before the write: items get their final status
        stored = await self._update(rec, unless_ended(end))
        if sink is not None:  # the terminal event names the stored status (a cancel may have won the race)
            final = stored or end  # None: deleted meanwhile, or storage unavailable
            kind = {"incomplete": "response.incomplete", "failed": "response.failed",
                    "cancelled": "response.failed"}.get(final["status"], "response.completed")
            tail[-1] = {**tail[-1], "type": kind, "response": {**rf.response_object(final),
                                                               "output": tail[-1]["response"]["output"]}}
            for ev in tail:
                await sink.send(ev)

    # -- HTTP ----------------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``. Errors: 400 (field named), 401, 404 (model, previous_response_id), 429,
        503; after streaming began a failure is a ``response.failed`` event."""
        marks = {"gateway_in": time.time()}
        tenant = self.tenancy.authenticate(request)
        marks["auth_done"] = time.time()
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request: {exc}",
                           code="invalid_json") from None
        headers: dict[str, str] = {}
        idem = request.headers.get("Idempotency-Key")
        rid = idempotent_request_id(tenant.id, idem) if idem is not None else None
        preq, req, rec = await self.prepare(tenant, body, request.headers.get("x-actorserve-deadline-ms"), marks,
                                            headers, rid)
        if idem is not None:
            stored = await self._claim(rec, req, body)
            if stored is not None:
                return await self._replay(request, stored, req["stream"])
            try:
                return await self._create(request, preq, req, rec, headers)
            except BaseException:
                await self._forget(rec)  # a failed first run must not stick: a retry runs again
                raise
        return await self._create(request, preq, req, rec, headers)

    async def _create(self, request: web.Request, preq: pipeline.Request, req: dict, rec: dict,
                      headers: dict) -> web.StreamResponse:
        if req["background"]:
            if not req["stream"]:
                await self.background(preq, rec)
                return web.json_response(rf.response_object(rec), headers=headers)
            writer = _SseEvents(request, headers)
            await asyncio.shield(await self.background(preq, rec, send=writer.send))  # a client leaving: run on
            return writer.resp if writer.resp is not None else web.Response(status=499)
        if not req["stream"]:
            rec = await self.execute(preq, req, rec, gone=lambda: _gone(request))
            return web.json_response(rf.response_object(rec), headers=headers,
                                     dumps=lambda o: orjson.dumps(o).decode())
        writer = _SseEvents(request, headers)
        await self.execute(preq, req, rec, send=writer.send, gone=lambda: _gone(request))  # ApiError: no byte sent
        return writer.resp if writer.resp is not None else web.Response(status=499)

    async def get(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``: the caller's response or 404."""
        return await self._http_op("get", request)

    async def input_items(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/input_items?limit=&order=asc|desc&after=``: see :meth:`operate`."""
        return await self._http_op("input_items", request)

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /v1/responses/{id}``: remove the caller's response (404 if unknown)."""
        return await self._http_op("delete", request)

    async def cancel(self, request: web.Request) -> web.Response:
        """``POST /v1/responses/{id}/cancel``: see :meth:`operate`."""
        return await self._http_op("cancel", request)

    async def _http_op(self, op: str, request: web.Request) -> web.Response:
        tenant = self.tenancy.authenticate(request)
        return web.json_response(await self.operate(op, tenant.id,
                                                    {**request.query, "response_id": request.match_info["id"]}))

    # -- stored-response operations (HTTP routes above, NATS as.api.v1.responses.<op>) ------------------

    async def operate(self, op: str, tenant_id: str, args) -> dict:
        """One operation on the tenant's stored response ``args["response_id"]``; the JSON answer.

        ``op``: ``get`` (the response object), ``input_items`` (the response's own input items, not its
        chained history, a cursor page: ``limit`` 1..100 default 20, ``order`` asc|desc default desc,
        ``after`` an item id), ``delete`` (``{"id", "object", "deleted": true}``; a running one is
        cancelled), ``cancel`` (background responses only, idempotent; a finished one is returned as it
        is). ``args``: a mapping (HTTP query + path id, or the NATS JSON body). ApiError 400 (field named),
        404 (unknown or another tenant's id, one shape), 503 (storage)."""
        resp_id = args.get("response_id")
        if not isinstance(resp_id, str) or not resp_id:
            raise ApiError(400, "response_id must be a non-empty string", param="response_id")
        rec = await self._read(tenant_id, resp_id)
        if op == "get":
            return rf.response_object(rec)
        if op == "input_items":
            return _items_page(rec, args)
        if op == "delete":
            if rec["status"] in ("queued", "in_progress"):
                await self.fe.cancel(rec["request_id"], "client", tenant=tenant_id)
            try:
                await (await self.kv()).delete(response_key(tenant_id, resp_id))
            except KvError:
                raise _unavailable() from None
            return {"id": resp_id, "object": "response", "deleted": True}
        if op != "cancel":
            raise ValueError(f"unknown responses operation {op!r}")
        if not rec["request"].get("background"):
            raise ApiError(400, "Only background responses can be cancelled.", param="response_id")
        if rec["status"] in ("queued", "in_progress"):
            new = await self._update(rec, lambda cur: None if cur is None or cur["status"] in rf.TERMINAL else
                                     {**cur, "status": "cancelled", "completed_at": rf.now_s()})
            await self.fe.cancel(rec["request_id"], "client", tenant=tenant_id)
            rec = new or rec
        return rf.response_object(rec)


def _items_page(rec: dict, args) -> dict:
    """The input-items list page of ``rec`` for ``limit`` / ``order`` / ``after`` (strings from a query or
    JSON values); ApiError 400 naming the field."""
    limit = args.get("limit", 20)
    try:
        limit = int(limit) if isinstance(limit, (int, str)) and not isinstance(limit, bool) else 0
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be an integer between 1 and 100", param="limit")
    order = args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
    after = args.get("after")
    if after is not None and not isinstance(after, str):
        raise ApiError(400, "after must be an item id (a string)", param="after")
    items = list(rec.get("input_items", []))
    if order == "desc":
        items.reverse()
    if after:
        idx = next((i for i, it in enumerate(items) if it.get("id") == after), None)
        items = items[idx + 1:] if idx is not None else []
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _ending(sink: EventSink, rec: dict) -> list[dict]:
    """The closing events of a background stream (with its opening ones when no chunk came)."""
    head = [] if sink.started else sink.tr.start(rf.response_object({**sink.rec, "status": "in_progress"}))
    sink.started = True
    return head + sink.closing(rec)


class _Detachable:
    """Event callback of a streamed background run: a client that left stops the events, not the run."""

    def __init__(self, send) -> None:
        self.send, self.gone = send, False

    async def __call__(self, ev: dict) -> None:
        if not self.gone:
            try:
                await self.send(ev)
            except ConnectionError:
                self.gone = True


def _gone(request: web.Request) -> bool:
    tr = request.transport
    return tr is None or tr.is_closing()


class _SseEvents:
    """Responses SSE writer: ``event: <type>`` + ``data: <json>`` per event; headers sent with the first."""

    def __init__(self, request: web.Request, headers: dict) -> None:
        self.request, self.headers, self.resp = request, headers, None

    async def send(self, ev: dict) -> None:
        """One event (ConnectionResetError when the client is gone)."""
        if self.resp is None:
            resp = web.StreamResponse(headers={**self.headers, "Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(self.request)
            self.resp = resp
        await self.resp.write(b"event: " + ev["type"].encode() + b"\n" + sse.data_event(sse.json_payload(ev)))
