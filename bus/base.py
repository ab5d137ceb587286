"""The Bus protocol every actor talks through, and the message envelope it delivers.

Two implementations: ``bus.nats_bus.NatsBus`` (nats-py, real deployments and integration tests) and
``bus.memory.MemoryBus`` (in-process, unit tests of one actor's logic only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol


class BusError(RuntimeError):
    """Base class of bus failures."""


class BusTimeout(BusError):
    """A request got no reply within its timeout."""


class NoResponders(BusError):
    """Nobody listens on the subject of a request."""


class BusDisconnected(BusError):
    """The bus is not connected (NATS reconnecting); fail fast rather than wait."""


@dataclass
class Msg:
    """A delivered message. ``respond`` publishes to ``reply`` (ValueError if there is none)."""

    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None
    _bus: "Bus | None" = field(default=None, repr=False)

    async def respond(self, data: bytes) -> None:
        """Publish ``data`` to this message's reply subject."""
        if not self.reply or self._bus is None:
            raise ValueError("message has no reply subject")
        await self._bus.publish(self.reply, data)


Handler = Callable[[Msg], Awaitable[None]]


class Subscription(Protocol):
    """A live subscription; ``unsubscribe`` stops delivery; ``pending`` counts messages delivered to this
    process and not yet handed to the handler (a load signal, actors/load_report.py)."""

    async def unsubscribe(self) -> None: ...

    def pending(self) -> int: ...


class Bus(Protocol):
    """What actors need from the message bus."""

    @property
    def is_connected(self) -> bool: ...

    async def publish(self, subject: str, data: bytes, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """Fire-and-forget publish. Raises BusDisconnected when the bus cannot accept it."""

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> Subscription:
        """Deliver messages on ``subject`` (wildcards allowed) to ``handler``; ``queue`` = queue group.

        Messages of one subscription are handled one at a time, in order; a handler that must not block
        the subscription spawns its own task."""

    async def request(self, subject: str, data: bytes, timeout: float,
                      headers: dict[str, str] | None = None) -> Msg:
        """Request-reply. Raises BusTimeout after ``timeout`` seconds, NoResponders if nobody listens."""

    def new_inbox(self) -> str:
        """A fresh unique reply subject under this connection's inbox prefix."""

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Register a callback run when the connection drops (to fail open streams fast)."""

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait until everything published so far reached the server (no-op in memory)."""

    async def close(self) -> None:
        """Drain subscriptions and close."""
