"""The gateway's one request pipeline, shared by the HTTP front, the NATS API, idempotent runs and the jobs actor.

Every front runs a request the same way; only the reading of the caller and the formatting differ:

1. the front authenticates the caller and reads the body and the deadline (HTTP and NATS carry the key,
   the body and the deadline differently), then builds a :class:`Request`;
2. :func:`start` (or the context manager :func:`admitted`) admits it through the tenancy layer (model
   access, priority class, quotas: ApiError 404 / 429), reserves its largest cost against the tenant's spend
   budget (gateway/budget_store.py: ApiError 429 ``budget_exhausted`` / 503) and submits it
   (``Frontend.submit``: ApiError 400 / 404 / 413 / 503). A failed submit releases the quota slot and drops
   the reservation at once; otherwise :meth:`Started.release` (called by :func:`admitted` on every exit)
   does, exactly once (the reservation then waits briefly for its completion records, which settle it);
3. :func:`run` consumes the response chunks through ``Frontend.next`` (which owns the deadline, the
   inactivity limit, gap detection and bus loss), merges the choices (``gateway.merge.ChoiceMerger``) and
   hands each chunk's streaming objects to a :class:`Sink` (``emit``). It ends in an :class:`Outcome`: on a
   ``StreamError``, a client disconnect, an unexpected failure or an error chunk of a fanned-out request it
   cancels the generation (every fanned-out choice) once (a single choice's error chunk needs no cancel: its
   sender ended it, and a refused request was never queued), and in every case it closes the in-flight entry once;
4. the front formats the Outcome (JSON response, SSE tail, NATS reply, idempotency record, job result).

Usage is metered from the workers' completion records (gateway/usage.py), never on this path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from bus.errors import ServeError
from bus.messages import Chunk
from control.state.tenants import DEV_TENANT, Tenant
from gateway.budget_store import reserve_request
from gateway.frontend import Frontend, Submitted
from gateway.inflight import StreamError
from gateway.merge import ChoiceMerger
from gateway.request_body import ApiBody

log = logging.getLogger(__name__)

CANCEL_RESEND_S = 30.0  # a cancel the bus could not carry is sent again once it is back, for this long (s)
CANCEL_RESEND_POLL_S = 0.25  # ... checking the connection this often (s)
_RESENDS: set[asyncio.Task] = set()  # cancels waiting for the bus (kept referenced until done)


@dataclass
class Request:
    """One API request as the pipeline admits and submits it.

    ``tenant``: the authenticated tenant record, admitted through the tenancy layer when set (None: no
    admission, e.g. the jobs actor whose jobs were admitted when accepted). ``headers``: the response
    headers of the front; admission adds the ``x-ratelimit-*`` values to this very dict.
    ``deadline_ms``: relative deadline (ms); ``marks``: timing marks (epoch s) the response reports.
    """

    tenant_id: str
    endpoint: str
    body: dict
    request_id: str
    deadline_ms: int
    marks: dict[str, float]
    tenant: Tenant | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tenant is not None and self.tenant.id != self.tenant_id:
            raise ValueError(f"tenant_id {self.tenant_id!r} is not the id of the tenant {self.tenant.id!r}")


class Admitter(Protocol):
    """What admits requests: gateway.tenancy.Tenancy (model access, priority class, quotas)."""

    async def admit(self, tenant: Tenant, body: dict, request_id: str, headers: dict) -> Any:
        """Admit one request (ApiError 404 / 429), adding x-ratelimit-* to ``headers``; the admission to
        release (None: nothing held)."""

    async def release(self, admission: Any) -> None:
        """Free what ``admit`` took."""

    #: a gateway.budget_store.BudgetGate (spend budgets) or None
    budgets: Any


@dataclass
class Started:
    """A submitted request and the quota slot it holds until :meth:`release`."""

    sub: Submitted
    tenancy: Admitter | None = None
    admission: Any = None
    budgets: Any = None  # the gateway.budget_store.BudgetGate holding ``hold``
    hold: Any = None  # the request's budget reservation (None: none)

    async def release(self) -> None:
        """Free the quota slot and end the budget reservation (idempotent: only the first call releases)."""
        adm, self.admission = self.admission, None
        hold, self.hold = self.hold, None
        await _release(self.tenancy, adm)
        if hold is not None:
            await self.budgets.end(hold)


async def _release(tenancy: Admitter | None, adm: Any) -> None:
    if tenancy is not None and adm is not None:
        await tenancy.release(adm)


async def start(fe: Frontend, req: Request, tenancy: Admitter | None = None, budgets: Any = None) -> Started:
    """Admit ``req`` (when ``tenancy`` and ``req.tenant`` are set), reserve its cost against the tenant's
    budget (``budgets``, else ``tenancy.budgets``: a gateway.budget_store.BudgetGate) and submit it.

    Raises ApiError (404 model not allowed, 429 quota or ``budget_exhausted``, 503 ``budget_unavailable``, and
    the submit's 400 / 404 / 413 / 503); the slot and the reservation are released before any exception leaves."""
    adm = hold = None
    gate = budgets if budgets is not None else getattr(tenancy, "budgets", None)
    try:
        if tenancy is not None and req.tenant is not None:
            adm = await tenancy.admit(req.tenant, req.body, req.request_id, req.headers)
        if gate is not None:
            hold = await reserve_request(gate, fe.resolver.snapshot, req)
        body = ApiBody.parse(req.endpoint, req.body)  # the one reading, after admission set the priority class
        sub = await fe.submit(tenant=req.tenant_id, endpoint=req.endpoint, body=body,
                              request_id=req.request_id, deadline_ms=req.deadline_ms, marks=req.marks)
    except BaseException:
        await _release(tenancy, adm)
        if hold is not None:
            await gate.end(hold, submitted=False)
        raise
    return Started(sub, tenancy, adm, gate, hold)


@asynccontextmanager
async def admitted(fe: Frontend, req: Request, tenancy: Admitter | None = None,
                   budgets: Any = None) -> AsyncIterator[Submitted]:
    """:func:`start` as a context manager: yields the Submitted request, releases its slot (and ends its
    budget reservation) on every exit."""
    started = await start(fe, req, tenancy, budgets)
    try:
        yield started.sub
    finally:
        await started.release()


class Sink(Protocol):
    """Where a streaming request's objects go (SSE writer, NATS replies, idempotent live run)."""

    async def emit(self, events: list[dict], merger: ChoiceMerger) -> None:
        """The streaming objects one chunk produced (possibly none), in order; ``merger.done`` after the last
        chunk. Raising ConnectionResetError means the client went away."""


@dataclass
class Outcome:
    """How one request ended. ``failure``: the ServeError a failure ended it with, as the hop that found it
    said it (an error chunk's, the stream's; None: success or disconnect); ``merger`` holds everything merged
    so far (``merger.body()`` is the response on success)."""

    merger: ChoiceMerger
    failure: ServeError | None = None
    disconnected: bool = False  # the client went away (HTTP 499)

    @property
    def ok(self) -> bool:
        """Every choice finished normally."""
        return self.failure is None and not self.disconnected

    @property
    def error(self) -> ServeError | None:
        """The client-facing error of a failure (a worker's 499 cancelled becomes 408), else None."""
        return self.failure.for_client() if self.failure is not None else None

    @property
    def status(self) -> int:
        """200, the error's HTTP status, or 499 for a client disconnect."""
        if self.disconnected:
            return 499
        return self.error.status if self.failure is not None else 200


async def run(fe: Frontend, sub: Submitted, body: ApiBody | dict | None = None, sink: Sink | None = None,
              gone: Callable[[], bool] | None = None) -> Outcome:
    """Consume ``sub``'s chunks until every choice's final one; see the module docstring.

    ``body``: None (the fronts): the ApiBody the submit read (``sub.body``); given only for a Submitted built
    by hand (tests), an ApiBody or the body dict.
    ``sink``: told of each chunk's streaming objects (None: a non-streaming request). ``gone``: checked every
    ``inflight.WATCH_S`` s by the table's disconnect watch (one task for all requests, not one wake-up per
    waiting request); True = the client disconnected. Cancel reasons: ``sibling_failed`` (an error chunk of
    a fanned-out request, for its other choices; a single choice's error chunk comes from whoever held it,
    the validator, a scheduler or a worker, which has ended it already: nothing is sent), ``stream_error``
    (deadline, silence, gap, bus loss; ``Frontend.next`` already sent
    ``gateway_gave_up``), ``disconnect``. Never raises but for task cancellation."""
    body = sub.body if body is None else body
    merger = ChoiceMerger(sub.endpoint, sub.request_id, sub.model, body if body is not None else {}, sub.marks,
                          sub.num_choices)
    out = Outcome(merger)
    if gone is not None:
        fe.table.watch(sub.request_id, gone)
    try:
        while not merger.done:
            chunk = await _next(fe, sub, gone)
            failure = chunk.failure
            if failure is not None and sub.num_choices == 1:  # refused or ended by its holder: nothing to cancel
                out.failure = failure
                return out
            if failure is not None:
                return await _fail(fe, sub, out, failure, "sibling_failed")
            await _add(merger, chunk, sink)
    except StreamError as exc:
        return await _fail(fe, sub, out, exc, "stream_error")
    except ConnectionResetError:
        out.disconnected = True
        await _cancel(fe, sub, "disconnect")
    except Exception as exc:  # a bug must still end the request, its generation and the client's wait
        log.exception("request %s failed in the gateway", sub.request_id)
        return await _fail(fe, sub, out, ServeError(500, f"internal error: {exc}", type="server_error"),
                           "stream_error")
    finally:
        fe.table.close(sub.request_id)
    return out


async def _next(fe: Frontend, sub: Submitted, gone: Callable[[], bool] | None) -> Chunk:
    """The next chunk (Frontend.next); ConnectionResetError once ``gone()`` says the client left (checked
    here, then by the table's disconnect watch while waiting)."""
    if gone is not None and gone():
        raise ConnectionResetError("client disconnected")
    while True:
        chunk = await fe.next(sub)
        if chunk is not None:
            return chunk


async def _add(merger: ChoiceMerger, chunk: Chunk, sink: Sink | None) -> None:
    """Merge one chunk (every object names the version that served it) and pass its objects on."""
    merger.model = chunk.model or merger.model
    events = merger.add(chunk)
    if sink is not None:
        await sink.emit(events, merger)


async def _fail(fe: Frontend, sub: Submitted, out: Outcome, failure: ServeError, reason: str) -> Outcome:
    """Record the failure and cancel the generation (every fanned-out choice) with ``reason``."""
    out.failure = failure
    await _cancel(fe, sub, reason)
    return out


def _connected(fe: Frontend) -> bool:
    state = getattr(fe.bus, "is_connected", True)  # a method on NatsBus, a property on MemoryBus
    return bool(state() if callable(state) else state)


async def _cancel(fe: Frontend, sub: Submitted, reason: str) -> None:
    """Cancel ``sub``'s generation; when the bus is down (a nats-server restart: the streams failed with
    ``bus_disconnected`` and the cancel could not be sent) send it again once the bus is back, in the
    background, for up to CANCEL_RESEND_S s: a worker that kept generating for nobody frees its slots
    at once instead of running to ``max_tokens``."""
    await fe.cancel(sub.request_id, reason, num_choices=sub.num_choices)
    if not _connected(fe):
        task = asyncio.create_task(_resend_cancel(fe, sub.request_id, reason, sub.num_choices),
                                   name=f"cancel-resend-{sub.request_id}")
        _RESENDS.add(task)
        task.add_done_callback(_RESENDS.discard)


async def _resend_cancel(fe: Frontend, request_id: str, reason: str, num_choices: int) -> None:
    t_end = time.monotonic() + CANCEL_RESEND_S
    while time.monotonic() < t_end:
        await asyncio.sleep(CANCEL_RESEND_POLL_S)
        if _connected(fe):
            await fe.cancel(request_id, reason, num_choices=num_choices)
            if _connected(fe):
                log.info("cancel of %s sent after the bus came back", request_id)
                return
    log.warning("cancel of %s never sent: the bus stayed down %.0f s", request_id, CANCEL_RESEND_S)
