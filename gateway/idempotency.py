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

from bus import streams
from bus.kv import KvConflict, KvError
from gateway import pipeline, sse
from gateway.merge import ChoiceMerger
from gateway.openai_format import ApiError

log = logging.getLogger(__name__)

BUCKET = streams.IDEM_BUCKET
TTL_S = streams.IDEMPOTENCY.ttl_s
HEARTBEAT_S = 3.0
STALE_S = 10.0
POLL_S = 0.1
FINISH_S = 60.0  # how long a finished run retries storing its result through a store outage (s)
MAX_KEY_LEN = 255


def body_hash(endpoint: str, body: dict) -> str:
    """SHA-256 hex of the canonical JSON (sorted keys, no spaces) of ``{"endpoint", "body"}``."""
    return hashlib.sha256(orjson.dumps({"endpoint": endpoint, "body": body}, option=orjson.OPT_SORT_KEYS)).hexdigest()


def record_key(tenant_id: str, idem_key: str) -> str:
    """KV key of one tenant's idempotency key (the client's key is hashed: any characters are fine)."""
    return f"i.{tenant_id}.{hashlib.sha256(idem_key.encode('utf-8')).hexdigest()}"


# -- record rules (pure; ``now`` in epoch seconds) ---------------------------------------------------

def sticky(status: int) -> bool:
    """Whether a result with HTTP ``status`` is kept and replayed (not 5xx, 408, 429: a retry runs again)."""
    return status < 500 and status not in (408, 429)


def running_record(bh: str, gateway_id: str, deadline: float, now: float) -> dict:
    """The claim of a run: state ``running`` owned by ``gateway_id``, heartbeat ``now``."""
    return {"state": "running", "body_hash": bh, "gateway": gateway_id, "heartbeat": now, "deadline": deadline}


def is_stale(rec: dict, now: float) -> bool:
    """A running record whose owner's heartbeat is older than ``STALE_S``: another gateway may take it over."""
    return rec.get("state") == "running" and now - float(rec.get("heartbeat", 0)) > STALE_S


def heartbeat(rec: dict | None, gateway_id: str, now: float) -> dict | None:
    """``rec`` with a fresh heartbeat while it is still ``gateway_id``'s running claim; else None (stop)."""
    if rec is None or rec.get("state") != "running" or rec.get("gateway") != gateway_id:
        return None
    return {**rec, "heartbeat": now}


def done_record(bh: str, gateway_id: str, status: int, headers: dict, json_body, events: list[bytes] | None,
                now: float) -> dict:
    """The finished record replayed to later requests (``events``: the SSE payloads of a streamed run)."""
    return {"state": "done", "body_hash": bh, "gateway": gateway_id, "finished": now, "status": status,
            "headers": headers, "json": json_body,
            "events": [e.decode() for e in events] if events is not None else None}


def finish_action(rec: dict | None, bh: str, status: int) -> str | None:
    """What ending a run does to the current record: None (it is gone or another request's: leave it),
    ``"delete"`` (a result that must not stick) or ``"store"`` (the done record)."""
    if rec is None or rec.get("body_hash") != bh:
        return None
    return "store" if sticky(status) else "delete"


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

    async def emit(self, events: list[dict], merger: ChoiceMerger) -> None:
        """Pipeline sink of a streamed run: keep one chunk's objects as SSE payloads, wake the followers."""
        for ev in events:
            self.push(sse.json_payload(ev))


def _result(out: pipeline.Outcome, live: LiveRun) -> tuple[dict, dict | None]:
    """(headers, JSON body) of a finished run; the JSON body is None when the answer is the event stream
    (a streamed run that produced output: an error then ends it as one more event)."""
    headers = {"x-actorserve-model-version": out.merger.model}
    err = out.error
    if err is not None:  # Retry-After of a 429 / 503, as on a request without Idempotency-Key
        headers.update(err.http_headers())
    if not live.stream:
        if err is None:
            headers["x-actorserve-timing"] = orjson.dumps(out.merger.final_timing()).decode()
        return headers, err.body() if err is not None else out.merger.body()
    if err is not None and not live.events:
        return headers, err.body()  # error before any output: answer it as a plain HTTP error
    if err is not None:
        live.push(sse.json_payload(err.body()))
    return headers, None


class IdempotencyStore:
    """Idempotent request handling over the ``as_idem`` bucket. ``js``: what opens KV buckets
    (``bus.jetstream.JetStream``; ``bus.kv.MemoryBuckets`` in tests)."""

    def __init__(self, js, gateway_id: str) -> None:
        self.js, self.gateway_id = js, gateway_id
        self.kv = None
        self._live: dict[str, LiveRun] = {}
        self._tasks: set[asyncio.Task] = set()

    async def open(self) -> None:
        """Create or bind the bucket (``bus.streams.IDEMPOTENCY``: file storage, 24 h TTL)."""
        self.kv = await self.js.bucket(streams.IDEMPOTENCY)

    async def close(self, grace_s: float = 10.0) -> None:
        """Let background runs finish and store their results (at most ``grace_s`` seconds)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)

    async def _get(self, key: str) -> tuple[dict | None, int]:
        """``(record, revision)``, ``(None, 0)`` when there is none."""
        e = await self.kv.get(key)
        return (e.value, e.revision) if e is not None and e.value else (None, 0)

    async def _put(self, key: str, rec: dict, last: int | None) -> int | None:
        """Create (last None) or compare-and-swap at revision ``last``; the new revision, None if we
        lost the race (bus.kv.KvError on store trouble)."""
        try:
            return await (self.kv.create(key, rec) if last is None else self.kv.swap(key, rec, last))
        except KvConflict:
            return None

    # -- the HTTP entry point ------------------------------------------------------------------

    async def handle(self, front, request: web.Request, req: pipeline.Request, idem_key: str) -> web.StreamResponse:
        """Serve one keyed request (see the module docstring). ``front`` is the gateway.http.HttpFront,
        ``req`` the authenticated request (``req.headers``: the response headers, X-Request-Id included).

        Raises ApiError (400 bad key, 409 conflict, 404/429 from admission, 503 store trouble)."""
        try:
            return await self._handle(front, request, req, idem_key)
        except (KvError, TimeoutError) as exc:  # JetStream without a leader, the bus away: never a 500
            log.warning("idempotency store unavailable: %r", exc)
            raise ApiError(503, "the idempotency store is unavailable; retry later", type="unavailable",
                           code="idempotency_unavailable", retry_after=1.0) from exc

    async def _handle(self, front, request: web.Request, req: pipeline.Request, idem_key: str) -> web.StreamResponse:
        if not idem_key or len(idem_key) > MAX_KEY_LEN:
            raise ApiError(400, f"Idempotency-Key must be 1 to {MAX_KEY_LEN} characters", param="Idempotency-Key")
        key, bh = record_key(req.tenant_id, idem_key), body_hash(req.endpoint, req.body)
        stream, echo = req.body.get("stream") is True, req.headers
        deadline = time.time() + req.deadline_ms / 1e3
        while True:
            rec, rev = await self._get(key)
            if rec is None:
                claim = self._running(bh, deadline)
                new_rev = await self._put(key, claim, None if rev == 0 else rev)
                if new_rev is None:
                    continue  # another request claimed it first: look again
                return await self._own(front, request, req, key, bh, stream, new_rev)
            if rec.get("body_hash") != bh:
                raise ApiError(409, "Idempotency-Key was already used with a different request body",
                               param="Idempotency-Key", code="idempotency_key_conflict")
            if rec.get("state") == "done":
                return await self._replay(request, rec, echo, stream)
            live = self._live.get(key)
            if live is not None:
                return await self._follow(request, live, echo, stream)
            if is_stale(rec, time.time()):
                new_rev = await self._put(key, self._running(bh, deadline), rev)
                if new_rev is not None:
                    log.warning("idempotent request %s: owner %s went silent; taking over", key, rec.get("gateway"))
                    return await self._own(front, request, req, key, bh, stream, new_rev)
                continue
            if time.time() > deadline:
                raise ApiError(409, "a request with this Idempotency-Key is still in progress",
                               param="Idempotency-Key", code="idempotency_key_in_progress", retry_after=1.0)
            await asyncio.sleep(POLL_S)

    def _running(self, bh: str, deadline: float) -> dict:
        return running_record(bh, self.gateway_id, deadline, time.time())

    async def _own(self, front, request, req: pipeline.Request, key, bh, stream, rev) -> web.StreamResponse:
        try:
            started = await pipeline.start(front.fe, req, front.tenancy)
        except ApiError as err:
            await self._finish(key, bh, rev, err.status, {**req.headers, **err.http_headers()}, err.body(), None,
                               within_s=2.0)  # not cleared: the claim goes stale and is taken over
            raise
        live = LiveRun(stream)
        self._live[key] = live
        task = asyncio.create_task(self._run(front, started, live, key, bh, rev))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await self._follow(request, live, req.headers, stream)

    async def _run(self, front, started: pipeline.Started, live: LiveRun, key, bh, rev) -> None:
        """Consume the request to its end regardless of clients (the quota slot is held until then); store
        the result."""
        hb = asyncio.create_task(self._heartbeat(key, bh, rev))
        try:  # heartbeats go on until the result is stored: a store outage must not let a waiter re-run it
            try:
                out = await pipeline.run(front.fe, started.sub, sink=live if live.stream else None)
            finally:
                await started.release()
            headers, result_json = _result(out, live)
            live.status, live.headers, live.json = out.status, headers, result_json
            await self._finish(key, bh, rev, out.status, live.headers, live.json,
                               live.events if live.json is None else None)
        finally:
            hb.cancel()
            live.done = True
            live.changed.set()
            self._live.pop(key, None)

    async def _heartbeat(self, key: str, bh: str, rev: int) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                if not (await self.kv.update(key, lambda r: heartbeat(r, self.gateway_id, time.time()))).changed:
                    return
            except (KvError, TimeoutError) as exc:  # the next beat tries again; a long outage lets a waiter take over
                log.warning("heartbeat of idempotent request %s failed: %r", key, exc)

    async def _finish(self, key, bh, rev, status, headers, json_body, events, within_s: float = FINISH_S) -> None:
        """Store the done record (or delete the claim for a non-sticky result), retrying lost races and
        store outages (JetStream without a leader for a while) for up to ``within_s`` seconds. A record
        another run already finished is left as it is."""
        t_end = time.monotonic() + within_s
        while True:
            try:
                rec, cur = await self._get(key)
                action = finish_action(rec, bh, status) if (rec or {}).get("state") != "done" else None
                if action == "delete":
                    await self.kv.delete(key, last=cur)
                elif action == "store":
                    await self.kv.swap(key, done_record(bh, self.gateway_id, status, headers, json_body, events,
                                                        time.time()), cur)
                return
            except (KvError, TimeoutError) as exc:  # lost a race (KvConflict) or store trouble: look again
                if time.monotonic() >= t_end:
                    log.warning("could not store the result of idempotent request %s: %r", key, exc)
                    return
                await asyncio.sleep(0.02 if isinstance(exc, KvConflict) else 0.5)

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
