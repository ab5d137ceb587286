"""The one skeleton every actor's ``main(args)`` runs: :func:`serve`.

::

    async def main(args):
        await serve(args, "validator", build)

    async def build(ctx: ActorContext) -> None:
        bus = await ctx.connect_bus()
        svc = ValidatorService(bus, ctx.registry, ...)
        await svc.start()
        ctx.on_stop(lambda: svc.stop(timeout=10.0), timeout_s=15.0, what="validator service")

:func:`serve` resolves the endpoints (``--nats`` / ``--etcd``, environment, ``endpoints.json``), opens the
etcd :class:`control.state.registry.Registry` on the context, calls ``build(ctx)`` and then waits until
it is cancelled (actors.runtime turns SIGTERM / SIGINT into that cancellation). ``build`` starts the
actor's parts and registers, with :meth:`ActorContext.on_stop`, how to stop each one as soon as it has
started; a ``build`` with a loop of its own (the scheduler's terms, the worker's lease) simply does not
return. However ``serve`` ends (cancelled, ``build`` raised, or returned and was cancelled later), the
closers run in reverse order of registration (the bus and the registry, opened first, close last),
each bounded by its timeout, under :func:`asyncio.shield` so that a drain is never cut short by the
cancellation that asked for it; a closer that fails or times out is logged and the next one runs.
The cancellation (or the error) then propagates: it is never swallowed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("actorserve.serve")

#: default bound (seconds) of one closer
DEFAULT_STOP_S = 10.0

Closer = Callable[[], Awaitable[Any]]


@dataclass
class _Stop:
    closer: Closer
    timeout_s: float
    what: str


@dataclass
class ActorContext:
    """What an actor's ``build`` starts its parts on: ``args``, ``name`` (the actor's name, also its NATS
    connection name), ``registry`` (open etcd Registry), the bus once :meth:`connect_bus` connected it,
    and the closers run on stop."""

    args: argparse.Namespace
    name: str
    nats_url: str
    registry: Any = None
    bus: Any = None
    _stops: list[_Stop] = field(default_factory=list)

    def on_stop(self, closer: Closer, *, timeout_s: float = DEFAULT_STOP_S, what: str = "") -> None:
        """Run ``closer()`` on stop, at most ``timeout_s`` seconds, before every closer registered earlier.
        ``what`` names it in the log. ValueError for a non-positive timeout."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s!r})")
        self._stops.append(_Stop(closer, float(timeout_s), what or getattr(closer, "__qualname__", "closer")))

    async def connect_bus(self) -> Any:
        """Connect the NATS bus named :attr:`name` (once; later calls return it); closed on stop after
        everything registered after it. Raises bus.base.BusError if NATS does not answer."""
        if self.bus is None:
            from bus.nats_bus import NatsBus

            self.bus = await NatsBus.connect(self.nats_url, name=self.name)
            self.on_stop(self.bus.close, timeout_s=DEFAULT_STOP_S, what="bus")
        return self.bus

    async def aclose(self) -> None:
        """Run the registered closers, last registered first, each bounded by its timeout; failures and
        timeouts are logged. A cancellation of the task running this propagates."""
        while self._stops:
            stop = self._stops.pop()
            watchdog = asyncio.get_running_loop().call_later(0.9 * stop.timeout_s, _log_stuck, self.name, stop.what)
            try:
                async with asyncio.timeout(stop.timeout_s):
                    await stop.closer()
            except TimeoutError:
                log.warning("%s: stopping %s took over %g s; going on", self.name, stop.what, stop.timeout_s)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                log.warning("%s: stopping %s was cancelled; going on", self.name, stop.what)
            except Exception as exc:
                log.warning("%s: stopping %s failed: %r", self.name, stop.what, exc)
            finally:
                watchdog.cancel()


def _log_stuck(name: str, what: str, max_tasks: int = 40, max_frames: int = 8) -> None:
    """Log where every task of the loop waits (the chain of awaits of its coroutine, innermost
    ``max_frames``): a closer about to time out shows what it waits for (a stop that hangs is otherwise a
    bare "took over N s")."""
    lines = [f"  {t.get_name()}: {_await_chain(t.get_coro(), max_frames)}" for t in list(asyncio.all_tasks())[:max_tasks]]
    log.warning("%s: stopping %s still runs; the tasks wait at:\n%s", name, what, "\n".join(lines))


def _await_chain(coro: Any, max_frames: int) -> str:
    """``file:line function -> ...`` along ``cr_await`` / ``ag_await`` from ``coro`` (innermost last)."""
    out = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
    return " -> ".join(out[-max_frames:]) or "(no frame)"


async def open_context(args: argparse.Namespace, name: str) -> ActorContext:
    """Resolve the endpoints of ``args`` and open the registry on a new context (closed on stop).
    SystemExit when an endpoint is found nowhere; the registry's errors when etcd does not answer."""
    from actors.runtime import resolve_endpoints
    from control.state.registry import Registry

    nats_url, etcd_url = resolve_endpoints(args)
    ctx = ActorContext(args, name, nats_url)
    ctx.registry = await Registry.open(etcd_url)
    ctx.on_stop(ctx.registry.close, timeout_s=DEFAULT_STOP_S, what="registry")
    return ctx


async def serve(args: argparse.Namespace, name: str, build: Callable[[ActorContext], Awaitable[None]]) -> None:
    """Run the actor ``name``: open the context, ``await build(ctx)``, wait until cancelled, then run the
    context's closers (shielded, bounded). Returns only by cancellation or an error, which propagate."""
    ctx = await open_context(args, name)
    try:
        await build(ctx)
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(ctx.aclose())
