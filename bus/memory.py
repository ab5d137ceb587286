"""In-memory Bus for unit tests of one actor's logic (never for tests that cross actors).

Semantics follow NATS core: subjects with ``*`` (one token) and ``>`` (rest) wildcards, queue groups
(one member per group gets each message, round robin), no persistence, no responders -> error.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

from bus import subjects, tracing
from bus.base import BusDisconnected, BusTimeout, Handler, Msg, NoResponders

log = logging.getLogger(__name__)


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` matches one token, a trailing ``>`` one or more."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


class _MemSub:
    def __init__(self, bus: "MemoryBus", subject: str, handler: Handler, queue: str) -> None:
        self.bus, self.subject, self.handler, self.queue = bus, subject, handler, queue
        self.inbox: asyncio.Queue[Msg] = asyncio.Queue(maxsize=65536)
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                with tracing.attached(msg.headers):  # as NatsBus: the handler runs in the sender's trace
                    await self.handler(msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # mirrors NatsBus: a handler error is logged, delivery goes on
                log.exception("handler for %s failed", self.subject)

    def pending(self) -> int:
        """Messages queued for the handler, not yet handed to it."""
        return self.inbox.qsize()

    async def unsubscribe(self) -> None:
        """Stop delivery and the delivery task."""
        if self in self.bus._subs:
            self.bus._subs.remove(self)
        self.task.cancel()


class MemoryBus:
    """Process-local Bus. ``connected`` can be toggled to test disconnect handling."""

    def __init__(self) -> None:
        self._subs: list[_MemSub] = []
        self._rr = itertools.count()
        self._ids = itertools.count()
        self.connected = True
        self._disconnect_cbs: list[Callable[[], None]] = []
        self.published: list[tuple[str, bytes]] = []  # every publish, for assertions

    @property
    def is_connected(self) -> bool:
        return self.connected

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        self._disconnect_cbs.append(callback)

    def disconnect(self) -> None:
        """Simulate a dropped connection: fire callbacks; publishes then fail."""
        self.connected = False
        for cb in self._disconnect_cbs:
            cb()

    def _targets(self, subject: str) -> list[_MemSub]:
        plain = [s for s in self._subs if not s.queue and subject_matches(s.subject, subject)]
        groups: dict[str, list[_MemSub]] = {}
        for s in self._subs:
            if s.queue and subject_matches(s.subject, subject):
                groups.setdefault(s.queue, []).append(s)
        picked = [members[next(self._rr) % len(members)] for members in groups.values()]
        return plain + picked

    async def publish(self, subject: str, data: bytes, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        if not self.connected:
            raise BusDisconnected("memory bus disconnected")
        self.published.append((subject, data))
        headers = tracing.inject(headers)
        for sub in self._targets(subject):
            sub.inbox.put_nowait(Msg(subject, data, reply, headers, self))

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> _MemSub:
        sub = _MemSub(self, subject, handler, queue)
        self._subs.append(sub)
        return sub

    async def request(self, subject: str, data: bytes, timeout: float,
                      headers: dict[str, str] | None = None) -> Msg:
        if not self._targets(subject):
            raise NoResponders(f"no responders on {subject}")
        inbox = self.new_inbox()
        fut: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

        async def on_reply(m: Msg) -> None:
            if not fut.done():
                fut.set_result(m)
        sub = await self.subscribe(inbox, on_reply)
        try:
            await self.publish(subject, data, reply=inbox, headers=headers)
            async with asyncio.timeout(timeout):  # not wait_for: it can swallow a cancel (actors.aio.wait_event)
                return await fut
        except TimeoutError as exc:
            raise BusTimeout(f"no reply on {subject} within {timeout} s") from exc
        finally:
            await sub.unsubscribe()

    def new_inbox(self) -> str:
        return f"{subjects.INBOX}.mem.{next(self._ids)}"

    async def flush(self, timeout: float = 2.0) -> None:
        await asyncio.sleep(0)

    async def close(self) -> None:
        for sub in list(self._subs):
            await sub.unsubscribe()
