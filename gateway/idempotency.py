"""``Idempotency-Key`` on POST completions: one model run per (tenant, key), its response replayed.

Records live in the JetStream KV bucket ``as_idem`` (file storage, per-bucket TTL 24 h), so they are
shared by every gateway replica and survive a gateway restart. Key: ``i.<tenant>.<sha256(key)>``
(scoped per tenant: another tenant's identical key is a different record). Value::

    {"state": "running" | "done", "body_hash": sha256 of canonical JSON of {endpoint, body},
     "gateway": id, "heartbeat": epoch s, "deadline": epoch s,
     "status": 200, "headers": {...}, "json": {...} | null, "events": [...] | null}

* First request: ``create`` (atomic; loses to a concurrent first) a running record, run the request in
  a background task that is not tied to the client connection (a disconnect does not cancel it),
  store the result as ``done``. The owner's client gets the live stream / the response.
* Same key + same body while running: on the owner gateway the caller attaches to the live run (SSE
  events as they come); on another replica it polls the record (100 ms) until done, then replays.
  If the owner's heartbeat (every 3 s) is older than ``STALE_S`` (the gateway died), the waiter takes
  the record over with compare-and-swap and runs the request itself: the model then runs again, once.
* Same key + different body: 409 ``idempotency_key_conflict``. Done records are replayed with header
  ``Idempotent-Replayed: true``. Results that must not stick (429, 5xx, 408) delete the record so
  that a retry runs again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from gateway import sse
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

BUCKET = "as_idem"
TTL_S = 24 * 3600
HEARTBEAT_S = 3.0
STALE_S = 10.0
POLL_S = 0.1
MAX_KEY_LEN = 255


def body_hash(endpoint: str, body: dict) -> str:
    """SHA-256 hex of the canonical JSON (sorted keys, no spaces) of ``{"endpoint", "body"}``."""
    return hashlib.sha256(orjson.dumps({"endpoint": endpoint, "body": body}, option=orjson.OPT_SORT_KEYS)).hexdigest()


def record_key(tenant_id: str, idem_key: str) -> str:
    """KV key of one tenant's idempotency key (the client's key is hashed: any characters are fine)."""
    return f"i.{tenant_id}.{hashlib.sha256(idem_key.encode('utf-8')).hexdigest()}"


def _sticky(status: int) -> bool:
    return status < 500 and status not in (408, 429)


@dataclass
class LiveRun:
    """The in-process view of a run this gateway owns: events so far and completion."""

    stream: bool
    events: list[bytes] = field(default_factory=list)  # SSE data payloads (without "data: ")
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    status: int = 200
    headers: dict = field(default_factory=dict)
    json: dict | None = None

    def push(self, payload: bytes) -> None:
        self.events.append(payload)
        self.changed.set()


class IdempotencyStore:
    """Idempotent request handling over the ``as_idem`` bucket. ``js``: nats-py JetStreamContext."""

    def __init__(self, js, gateway_id: str) -> None:
        self.js, self.gateway_id = js, gateway_id
        self.kv = None
        self._live: dict[str, LiveRun] = {}
        self._tasks: set[asyncio.Task] = set()

    async def open(self) -> None:
        """Create or bind the bucket (file storage, 24 h TTL)."""
        from nats.js.api import KeyValueConfig, StorageType

        try:
            self.kv = await self.js.key_value(BUCKET)
        except Exception:
            self.kv = await self.js.create_key_value(KeyValueConfig(
                bucket=BUCKET, history=1, ttl=TTL_S, storage=StorageType.FILE, max_bytes=128 * 1024 * 1024))

    async def close(self, grace_s: float = 10.0) -> None:
        """Let background runs finish and store their results (at most ``grace_s`` seconds)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)

    async def _get(self, key: str):
        from nats.js.errors import KeyDeletedError, KeyNotFoundError
        try:
            e = await self.kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        if not e.value:
            return None, 0
        return orjson.loads(e.value), e.revision

    async def _put(self, key: str, rec: dict, last: int | None) -> int | None:
        """Create (last None) or CAS-update; return the new revision, None if we lost the race."""
        from nats.js.errors import KeyWrongLastSequenceError, APIError
        try:
            if last is None:
                return await self.kv.create(key, orjson.dumps(rec))
            return await self.kv.update(key, orjson.dumps(rec), last=last)
        except (KeyWrongLastSequenceError, APIError):
            return None

    # -- the HTTP entry point ------------------------------------------------------------------

    async def handle(self, front, request: web.Request, endpoint: str, tenant, body: dict, rid: str,
                     echo: dict, marks: dict, deadline_ms: int, idem_key: str) -> web.StreamResponse:
        """Serve one keyed request (see the module docstring). ``front`` is the gateway.http.HttpFront.

        Raises ApiError (400 bad key, 409 conflict, 404/429 from admission, 503 store trouble)."""
        if not idem_key or len(idem_key) > MAX_KEY_LEN:
            raise ApiError(400, f"Idempotency-Key must be 1 to {MAX_KEY_LEN} characters", param="Idempotency-Key")
        key, bh = record_key(tenant.id, idem_key), body_hash(endpoint, body)
        stream = body.get("stream") is True
        deadline = time.time() + deadline_ms / 1e3
        while True:
            rec, rev = await self._get(key)
            if rec is None:
                claim = self._running(bh, deadline)
                new_rev = await self._put(key, claim, None if rev == 0 else rev)
                if new_rev is None:
                    continue  # another request claimed it first: look again
                return await self._own(front, request, endpoint, tenant, body, rid, echo, marks, deadline_ms,
                                       key, bh, stream, new_rev)
            if rec.get("body_hash") != bh:
                raise ApiError(409, "Idempotency-Key was already used with a different request body",
                               param="Idempotency-Key", code="idempotency_key_conflict")
            if rec.get("state") == "done":
                return await self._replay(request, rec, echo, stream)
            live = self._live.get(key)
            if live is not None:
                return await self._follow(request, live, echo, stream)
            if time.time() - float(rec.get("heartbeat", 0)) > STALE_S:
                new_rev = await self._put(key, self._running(bh, deadline), rev)
                if new_rev is not None:
                    log.warning("idempotent request %s: owner %s went silent; taking over", key, rec.get("gateway"))
                    return await self._own(front, request, endpoint, tenant, body, rid, echo, marks, deadline_ms,
                                           key, bh, stream, new_rev)
                continue
            if time.time() > deadline:
                raise ApiError(409, "a request with this Idempotency-Key is still in progress",
                               param="Idempotency-Key", code="idempotency_key_in_progress", retry_after=1.0)
            await asyncio.sleep(POLL_S)

    def _running(self, bh: str, deadline: float) -> dict:
        return {"state": "running", "body_hash": bh, "gateway": self.gateway_id, "heartbeat": time.time(),
                "deadline": deadline}

    async def _own(self, front, request, endpoint, tenant, body, rid, echo, marks, deadline_ms, key, bh, stream,
                   rev) -> web.StreamResponse:
        tenancy = front.tenancy
        adm = None
        try:
            adm = await tenancy.admit(tenant, body, rid, echo)
            sub = await front.fe.submit(tenant=tenant.id, endpoint=endpoint, body=body, request_id=rid,
                                        deadline_ms=deadline_ms, marks=marks)
        except ApiError as err:
            await tenancy.release(adm)
            await self._finish(key, bh, rev, err.status, {**echo, **err.http_headers()}, err.body(), None)
            raise
        live = LiveRun(stream)
        self._live[key] = live
        task = asyncio.create_task(self._run(front, sub, body, echo, live, key, bh, rev, adm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await self._follow(request, live, echo, stream)

    async def _run(self, front, sub, body, echo, live: LiveRun, key, bh, rev, adm) -> None:
        """Consume the request to its end regardless of clients; store the result."""
        from gateway.inflight import StreamError
        from gateway.merge import ChoiceMerger

        hb = asyncio.create_task(self._heartbeat(key, bh, rev))
        merger = ChoiceMerger(sub.endpoint, sub.request_id, sub.model, body, sub.marks, sub.num_choices)
        status, err_body = 200, None
        try:
            async for chunk in front.fe.stream(sub):
                if chunk.error:
                    await front.fe.cancel(sub.request_id, "sibling_failed", num_choices=sub.num_choices)
                    e = ApiError.from_chunk_error(chunk.error)
                    status, err_body = e.status, e.body()
                    break
                for ev in merger.add(chunk):
                    live.push(sse.json_payload(ev))
        except StreamError as exc:
            await front.fe.cancel(sub.request_id, "stream_error", num_choices=sub.num_choices)
            e = front.fe.resolve_error(exc)
            status, err_body = e.status, e.body()
        except Exception as exc:  # never leave a running record behind silently
            log.exception("idempotent run %s failed", key)
            status, err_body = 500, ApiError(500, f"internal error: {exc}", type="server_error").body()
        finally:
            hb.cancel()
            await front.tenancy.release(adm)
        headers = {"x-actorserve-model-version": merger.model}
        if err_body is None and not live.stream:
            headers["x-actorserve-timing"] = orjson.dumps(merger.final_timing()).decode()
        if live.stream:
            if err_body is not None:
                live.push(sse.json_payload(err_body))
            result_json = err_body if (err_body is not None and not live.events) else None
        else:
            result_json = err_body if err_body is not None else merger.body()
        if live.stream and err_body is not None and len(live.events) == 1:
            live.events.clear()  # error before any output: answer it as a plain HTTP error
        live.status, live.headers, live.json = status, headers, result_json
        try:
            await self._finish(key, bh, rev, status, headers, result_json, live.events if live.stream else None)
        finally:
            live.done = True
            live.changed.set()
            self._live.pop(key, None)

    async def _heartbeat(self, key: str, bh: str, rev: int) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            rec, cur = await self._get(key)
            if rec is None or rec.get("state") != "running" or rec.get("gateway") != self.gateway_id:
                return
            rec["heartbeat"] = time.time()
            await self._put(key, rec, cur)

    async def _finish(self, key, bh, rev, status, headers, json_body, events) -> None:
        """Store the done record (or delete the claim for a non-sticky result)."""
        for _ in range(20):
            rec, cur = await self._get(key)
            if rec is None or rec.get("body_hash") != bh:
                return
            if not _sticky(status):
                try:
                    await self.kv.delete(key, last=cur)
                    return
                except Exception:
                    continue
            done = {"state": "done", "body_hash": bh, "gateway": self.gateway_id, "finished": time.time(),
                    "status": status, "headers": headers, "json": json_body,
                    "events": [e.decode() for e in events] if events is not None else None}
            if await self._put(key, done, cur) is not None:
                return
        log.warning("could not store the result of idempotent request %s", key)

    # -- answering ------------------------------------------------------------------------------

    async def _follow(self, request, live: LiveRun, echo: dict, stream: bool) -> web.StreamResponse:
        """Answer from a live run on this gateway; a client disconnect only stops the writing."""
        if not stream:
            while not live.done:
                live.changed.clear()
                if not live.done:
                    await live.changed.wait()
            return self._json(live.status, {**echo, **live.headers}, live.json)
        # Streaming: wait for the first event (or the end), so early errors are real HTTP statuses.
        while not live.events and not live.done:
            live.changed.clear()
            await live.changed.wait()
        if live.done and not live.events:
            return self._json(live.status, {**echo, **live.headers}, live.json)
        resp = web.StreamResponse(headers={**echo, **live.headers, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = 0
        try:
            while True:
                while sent < len(live.events):
                    await resp.write(sse.data_event(live.events[sent]))
                    sent += 1
                if live.done:
                    break
                live.changed.clear()
                if sent >= len(live.events) and not live.done:
                    await live.changed.wait()
            await resp.write(sse.DONE)
        except (ConnectionResetError, RuntimeError):
            pass  # the run goes on and its result is stored
        return resp

    async def _replay(self, request, rec: dict, echo: dict, stream: bool) -> web.StreamResponse:
        headers = {**echo, **(rec.get("headers") or {}), "Idempotent-Replayed": "true"}
        events = rec.get("events")
        if not stream or events is None:
            return self._json(int(rec.get("status", 200)), headers, rec.get("json"))
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            for e in events:
                await resp.write(sse.data_event(sse.escape_line_breaks(e.encode())))  # older gateways stored raw
            await resp.write(sse.DONE)
        except (ConnectionResetError, RuntimeError):
            pass
        return resp

    @staticmethod
    def _json(status: int, headers: dict, body) -> web.Response:
        return web.json_response(body, status=status, headers=headers, dumps=lambda o: orjson.dumps(o).decode())
