"""The gateway's request core, shared by the HTTP and the NATS API fronts.

``Frontend.submit`` resolves the model, registers the request in the in-flight table, hands it to a
validator (request-reply ack: a missing validator is a 503 at once, not a timeout) and returns the
entry whose chunks ``Frontend.next`` hands out in order; gateway/pipeline.py consumes them for every front.
A request that a scheduler has just shown it would refuse (queue full, deadline unmeetable) is refused in
``submit`` from a refusal hint (gateway/shed.py), before any bus hop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import orjson

from bus.errors import ServeError
from bus import subjects
from bus.base import Bus, BusDisconnected, BusError, BusTimeout, Msg, NoResponders
from bus.messages import (ApiRequest, Cancel, Chunk, HopAck, PRIORITIES, ProbeAnswer, ReceiverProbe,
                          choice_request_id)
from gateway.inflight import Inflight, InflightTable, StreamError, next_chunk
from gateway.models import ModelResolver
from gateway.shed import Shape, ShedHints
from gateway.openai_format import ApiError
from gateway.request_body import ApiBody
from gateway.tracing import annotate as annotate_trace
from actors import content_log
from control.policy.limits import MAX_CHOICES

log = logging.getLogger(__name__)


@dataclass
class FrontendConfig:
    """Gateway limits (ValueError on bad values)."""

    gateway_id: str
    default_deadline_ms: int = 120_000  # deadline when the request gives none (ms)
    max_deadline_ms: int = 3_600_000  # largest accepted deadline_ms
    inactivity_s: float = 60.0  # max silence between chunks (s)
    validator_ack_s: float = 2.0  # wait for a validator to take the request (s)
    step_frames: bool = True  # ask workers for step frames (one message per step, bus.messages.StepFrame)

    def __post_init__(self) -> None:
        subjects.gateway_replies(self.gateway_id)
        if self.default_deadline_ms <= 0 or self.inactivity_s <= 0:
            raise ValueError("deadlines and timeouts must be positive")


@dataclass
class Submitted:
    """A request accepted by a validator."""

    entry: Inflight
    request_id: str
    endpoint: str
    name: str
    version: str
    marks: dict[str, float]
    num_choices: int = 1  # choices (engine requests) the request fans out into
    body: ApiBody | None = None  # the body as submitted, read once (None: a Submitted built by hand, in tests)

    @property
    def model(self) -> str:
        return f"{self.name}@{self.version}"


def new_request_id() -> str:
    """32 hex chars, safe as a subject token."""
    return uuid.uuid4().hex


def parse_deadline_ms(body_value, header_value, cfg: FrontendConfig) -> int:
    """Relative deadline (ms) from the body field or the header; ApiError 400 naming the field."""
    raw, param = (body_value, "deadline_ms") if body_value is not None else (header_value, "x-actorserve-deadline-ms")
    if raw is None:
        return cfg.default_deadline_ms
    try:
        ms = int(raw) if not isinstance(raw, bool) and float(raw) == int(float(raw)) else -1
    except (TypeError, ValueError):
        ms = -1
    if not 0 < ms <= cfg.max_deadline_ms:
        raise ApiError(400, f"{param} must be an integer between 1 and {cfg.max_deadline_ms}", param=param)
    return ms


class Frontend:
    """Submits requests to validators and routes response chunks back to their waiters."""

    #: optional ``gateway.metrics.GatewayMetrics`` (time to first token): told of each submit and chunk
    observer = None
    #: optional ``actors.load_report.LoadReporter``: each submit's time in the gateway (gateway_in -> hand-off)
    load = None

    def __init__(self, bus: Bus, resolver: ModelResolver, cfg: FrontendConfig) -> None:
        self.bus, self.resolver, self.cfg = bus, resolver, cfg
        self.table = InflightTable()
        self.shed = ShedHints()  # refusals learnt from the schedulers' answers (gateway/shed.py)
        self._sub = None
        self._frames_sub = None

    async def start(self) -> None:
        """Subscribe to this gateway's reply subjects and its step frames; fail streams fast on NATS disconnect."""
        self._sub = await self.bus.subscribe(subjects.gateway_replies(self.cfg.gateway_id), self._on_chunk)
        if self.cfg.step_frames:
            self._frames_sub = await self.bus.subscribe(subjects.frames(self.cfg.gateway_id), self._on_frame)
        self.bus.on_disconnect(lambda: self.table.fail_all(ServeError(
            503, "lost connection to the message bus", type="unavailable", code="bus_disconnected",
            retryable=True, retry_after=1.0)))

    async def stop(self) -> None:
        """Unsubscribe (requests in flight end by their own deadlines)."""
        for sub in (self._sub, self._frames_sub):
            if sub:
                await sub.unsubscribe()

    async def _on_chunk(self, msg: Msg) -> None:
        try:
            obj = orjson.loads(msg.data)
            if msg.reply and ReceiverProbe.matches(obj):  # a worker asks whether we still listen
                rid = msg.subject.rsplit(".", 1)[-1]  # the reply subject's request token (the one it was sent)
                return await msg.respond(ProbeAnswer(self.table.get(rid) is not None).encode())
            self._take(Chunk.from_dict(obj) if isinstance(obj, dict) else Chunk.decode(msg.data))
        except ValueError as exc:
            log.warning("undecodable chunk on %s: %s", msg.subject, exc)

    async def _on_frame(self, msg: Msg) -> None:
        """A worker's step frame (bus.messages.StepFrame): its chunks for this gateway's requests, each delivered
        as if it came alone; an undecodable item is logged and the others still delivered (its request sees
        the gap)."""
        try:
            items = orjson.loads(msg.data).get("chunks")
            if not isinstance(items, list):
                raise ValueError("'chunks' is not a list")
        except (ValueError, AttributeError) as exc:
            log.warning("undecodable step frame on %s: %s", msg.subject, exc)
            return
        for item in items:
            try:
                if not isinstance(item, dict):
                    raise ValueError(f"an item is a {type(item).__name__}, not an object")
                self._take(Chunk.from_dict(item))
            except ValueError as exc:
                log.warning("undecodable chunk in a step frame on %s: %s", msg.subject, exc)

    def _take(self, chunk: Chunk) -> None:
        """Hand one chunk to its waiter (observer told, a refusal learnt from an error chunk)."""
        if self.observer is not None:
            self.observer.on_chunk(chunk)
        if chunk.error is not None:
            self._learn(chunk)
        self.table.deliver(chunk)

    def _learn(self, chunk: Chunk) -> None:
        """Learn a refusal hint from a request's final error chunk (a scheduler's refusal, relayed)."""
        entry = self.table.get(chunk.request_id)
        if entry is not None and chunk.model:
            self.shed.learn(chunk.model, entry.tenant, entry.priority, chunk.error, time.time())

    def _shed(self, name: str, version: str, tenant: str, priority: str, deadline: float, body: ApiBody) -> None:
        """Raise the ApiError (429/503 + Retry-After) of a refusal hint that covers this request, if any."""
        shape = Shape(f"{name}@{version}", tenant, priority, deadline, body.max_tokens, body.ignore_eos)
        err = self.shed.check(shape, time.time())
        if err is not None:
            if self.observer is not None:
                from gateway.metrics import count_shed
                count_shed(shape.model, str(err.get("code")))
            raise ApiError.from_chunk_error(err)

    async def submit(self, *, tenant: str, endpoint: str, body: ApiBody | dict, request_id: str, deadline_ms: int,
                     marks: dict[str, float]) -> Submitted:
        """Resolve, register and hand the request to a validator. ``body``: the ApiBody (a dict is read into
        one here). Raises ApiError (404, 400, 503; 429/503 from a refusal hint)."""
        if not isinstance(body, ApiBody):
            body = ApiBody.parse(endpoint, body)
        model = body.model
        if not isinstance(model, str) or not model:
            raise ApiError(400, "you must provide a model parameter", param="model")
        name, version, adapter = self.resolver.snapshot.resolve_ref(model, tenant=tenant, request_key=request_id)
        priority = body.priority
        if priority not in PRIORITIES:
            raise ApiError(400, f"priority must be one of {', '.join(PRIORITIES)}", param="priority")
        deadline = time.time() + deadline_ms / 1e3
        self._shed(name, version, tenant, priority, deadline, body)
        k = body.num_choices
        annotate_trace(request_id=request_id, tenant=tenant, name=name, version=version, endpoint=endpoint, marks=marks)
        entry = self.table.open(request_id, deadline, self.cfg.inactivity_s, children=k)
        entry.tenant = tenant  # checked by a public NATS cancel (gateway/nats_api.py)
        entry.priority = priority
        marks["gateway_out"] = time.time()
        if self.load is not None:
            self.load.waited(marks.get("gateway_in"), marks["gateway_out"])
        if self.observer is not None:
            self.observer.on_submit(request_id, tenant, f"{name}@{version}", marks.get("gateway_in"))
        req = ApiRequest(request_id, tenant, model, name, version, endpoint, body.raw,
                         subjects.gateway_reply(tenant, self.cfg.gateway_id, request_id), priority, deadline, marks,
                         adapter=adapter, adapter_path=self.resolver.snapshot.adapter_path(name, adapter),
                         frames=subjects.frames(self.cfg.gateway_id) if self.cfg.step_frames else "")
        content_log.log_content("request body", request_id, body.raw)  # only with ACTORSERVE_LOG_PROMPTS=1
        try:
            await self._hand_to_validator(req)
        except ApiError:
            self.table.close(request_id)
            raise
        return Submitted(entry, request_id, endpoint, name, version, marks, k, body)

    async def _hand_to_validator(self, req: ApiRequest) -> None:
        data = req.encode()
        limit = getattr(self.bus, "max_payload", 0) or 0
        if limit and len(data) > limit:  # NATS would refuse it: say so instead of timing out
            raise ApiError(413, f"The request is {len(data)} bytes once wrapped for the message bus; the bus "
                           f"carries at most {limit} bytes per message. Send a smaller request.",
                           code="request_too_large")
        ok = await self._ask_validator(data, req.deadline)
        if not ok:
            raise ApiError(503, "no validator is available; retry later", type="unavailable",
                           code="validator_unavailable", retry_after=1.0)

    async def _ask_validator(self, data: bytes, deadline: float) -> bool:
        """Request-reply on ``as.int.validate``: True once a validator acknowledged. No validator at all
        (no responders) is False at once; an ack that does not come within ``validator_ack_s`` (a stalled
        validator loop, a NATS server reloading its users) is asked once more if the deadline allows: a
        validator acks a hand-off it has taken (same request id and ``gateway_out`` mark) without handling
        it twice, so the retry cannot run it twice."""
        for attempt in range(2):
            try:
                reply = await self.bus.request(subjects.VALIDATE, data, self.cfg.validator_ack_s)
                return HopAck.decode(reply.data).accepted
            except BusTimeout:
                if attempt or (deadline and time.time() + self.cfg.validator_ack_s > deadline):
                    return False
                log.info("no validator acknowledged within %.1f s; asking again", self.cfg.validator_ack_s)
            except (NoResponders, BusDisconnected):
                return False
            except (BusError, ValueError) as exc:
                log.warning("validator hand-off failed: %s", exc)
                return False
        return False

    async def next(self, sub: Submitted, poll_s: float | None = None) -> Chunk | None:
        """``next_chunk`` of the request; when it fails (deadline, silence, gap, bus loss) the generation is
        cancelled too, so no worker keeps producing tokens nobody will read. Raises StreamError."""
        try:
            return await next_chunk(sub.entry, poll_s)
        except StreamError:
            await self.cancel(sub.request_id, "gateway_gave_up")
            raise

    async def cancel(self, request_id: str, reason: str, tenant: str = "", num_choices: int | None = None) -> None:
        """Publish ``as.int.cancel.<id>`` for the request and each of its fanned-out choices (best effort).

        ``num_choices`` None: taken from the in-flight table, else the server cap (a NATS cancel may reach
        a gateway that does not hold the request).
        """
        if num_choices is None:
            entry = self.table.get(request_id)
            num_choices = entry.children if entry is not None else MAX_CHOICES
        ids = [request_id] + ([choice_request_id(request_id, i) for i in range(num_choices)] if num_choices > 1 else [])
        for rid in ids:
            try:
                await asyncio.wait_for(self.bus.publish(subjects.cancel(rid), Cancel(rid, reason, tenant).encode()),
                                       2.0)
            except (BusError, asyncio.TimeoutError, ValueError) as exc:
                log.warning("cancel of %s not sent: %s", rid, exc)
                return
