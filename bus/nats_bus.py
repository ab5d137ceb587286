"""The Bus over nats-py: with ``bus/jetstream.py`` the only modules that import nats.

Connection policy: reconnect forever (``max_reconnect_attempts=-1``) so actors survive a NATS
restart, while publishes during a disconnect fail fast with BusDisconnected and registered
``on_disconnect`` callbacks let streams in flight end at once with a retryable error. A server that
stops answering (its host partitioned away) is given up after 2 unanswered PINGs 2 s apart (4 to 6 s),
then the next server of the URL list is used (tests/cluster, docs/cluster.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import nats
from nats import errors as nats_errors
from nats.aio.msg import Msg as NatsMsg

from bus import subjects, tracing
from bus.base import BusDisconnected, BusTimeout, Handler, Msg, NoResponders

log = logging.getLogger(__name__)


def _url_user(url: str) -> str | None:
    """User name in the first URL of ``url`` (``nats://user:pw@host:port``), else None."""
    rest = url.split(",")[0].partition("://")[2]
    creds, at, _ = rest.rpartition("@")
    return creds.split(":", 1)[0] if at else None


def default_inbox_prefix(url: str) -> str:
    """Inbox prefix for a connection to ``url``: ``_INBOX_<role>`` for an internal role user, else ``_INBOX``."""
    role = subjects.role_of_user(_url_user(url))
    return subjects.role_inbox_prefix(role) if role else subjects.INBOX


def redact(url: str) -> str:
    """``url`` (or a comma-separated list) with any password replaced by ``***``, for messages and logs."""
    out = []
    for u in url.split(","):
        scheme, sep, rest = u.partition("://")
        creds, at, host = rest.rpartition("@")
        out.append(f"{scheme}{sep}{creds.split(':', 1)[0]}:***@{host}" if at and ":" in creds else u)
    return ",".join(out)


def _tls_options(url: str) -> dict:
    """``{"tls": ssl.SSLContext}`` for nats.connect when TLS files are configured (``ACTORSERVE_TLS_*``,
    bus/tls.py) or a URL says ``tls://``, else ``{}``. nats-py upgrades to TLS when the server requires it."""
    from bus.tls import TlsFiles
    files = TlsFiles.from_env()
    if files is None and "tls://" not in url:
        return {}
    import ssl
    # nats-py's reader protocol returns True from eof_received, which asyncio's TLS transport ignores with a
    # WARNING at every disconnect ("NATS disconnected" already says it): drop that one line.
    logging.getLogger("asyncio").addFilter(_quiet_ssl_eof)
    return {"tls": files.client_context() if files is not None else ssl.create_default_context()}


def _quiet_ssl_eof(record: logging.LogRecord) -> bool:
    return "eof_received() has no effect when using ssl" not in record.getMessage()


TRANSPORT_CLOSE_S = 1.0  # how long a reconnect waits for the old connection to close (s)


def _bound_transport_close() -> None:
    """Bound nats-py's wait for the old connection to close before it reconnects (idempotent).

    nats-py awaits ``wait_closed()`` of the old transport with no deadline; over TLS to a server that
    went silent (its host partitioned away) that is asyncio's TLS shutdown timeout, 30 s, during which
    the client is connected to nothing (seen in the cluster test, tests/cluster: a scheduler cut off
    for 25 s). After :data:`TRANSPORT_CLOSE_S` the old transport is aborted and the reconnect goes on."""
    from nats.aio import transport as nats_transport

    cls = nats_transport.TcpTransport
    if getattr(cls.wait_closed, "_actorserve_bounded", False):
        return
    original = cls.wait_closed

    async def wait_closed(self):
        try:
            return await asyncio.wait_for(original(self), TRANSPORT_CLOSE_S)
        except (TimeoutError, OSError):
            writer = getattr(self, "_io_writer", None)
            if writer is not None and writer.transport is not None:
                writer.transport.abort()
    wait_closed._actorserve_bounded = True
    cls.wait_closed = wait_closed


class _Sub:
    """A nats-py subscription wrapped to the Subscription protocol."""

    def __init__(self, sub) -> None:
        self._sub = sub

    def pending(self) -> int:
        """Messages the server delivered that wait in nats-py's pending queue for the handler."""
        try:
            return int(self._sub.pending_msgs)
        except (AttributeError, TypeError, ValueError):
            return 0

    async def unsubscribe(self) -> None:
        """Stop delivery; ignores a connection already closed."""
        try:
            await self._sub.unsubscribe()
        except (nats_errors.ConnectionClosedError, nats_errors.BadSubscriptionError):
            pass


class NatsBus:
    """Bus implementation on a nats-py connection. Create with ``await NatsBus.connect(url)``."""

    def __init__(self, nc: nats.NATS) -> None:
        self._nc = nc
        self._disconnect_cbs: list[Callable[[], None]] = []

    @classmethod
    async def connect(cls, url: str, *, name: str = "actorserve", inbox_prefix: str | None = None,
                      connect_timeout: float = 5.0) -> "NatsBus":
        """Connect to ``url`` (comma-separated list allowed). Raises BusError if the first connect fails.

        ``inbox_prefix`` defaults to the role's own prefix (``_INBOX_<role>``, bus.subjects) when the URL's
        user is an internal role user (``actorserve-<role>``), else ``_INBOX``."""
        if inbox_prefix is None:
            inbox_prefix = default_inbox_prefix(url)
        bus = cls.__new__(cls)
        bus._disconnect_cbs = []
        tls_opts = _tls_options(url)  # TLS when the server requires it (docs/security.md)
        _bound_transport_close()  # a silent server must not hold the reconnect for 30 s
        try:
            bus._nc = await nats.connect(
                url.split(","), name=name, inbox_prefix=inbox_prefix, connect_timeout=connect_timeout, **tls_opts,
                max_reconnect_attempts=-1, reconnect_time_wait=0.5, allow_reconnect=True,
                disconnected_cb=bus._on_disconnected, error_cb=bus._on_error, ping_interval=2,
                max_outstanding_pings=2, pending_size=64 * 1024 * 1024)
        except (OSError, nats_errors.Error, asyncio.TimeoutError) as exc:
            raise BusDisconnected(f"cannot connect to NATS at {redact(url)}: {exc}") from exc
        return bus

    async def _on_disconnected(self) -> None:
        if self._nc.is_closed or self._nc.is_draining:
            return  # our own close: not a failure
        log.warning("NATS disconnected; failing open streams")
        for cb in list(self._disconnect_cbs):
            try:
                cb()
            except Exception:  # a faulty callback must not stop the others
                log.exception("on_disconnect callback failed")

    async def _on_error(self, exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    @property
    def is_connected(self) -> bool:
        """True while the connection is up (not reconnecting, not closed)."""
        return self._nc.is_connected

    @property
    def max_payload(self) -> int:
        """Largest message the server accepts (bytes)."""
        return self._nc.max_payload

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (sync) each time the connection drops."""
        self._disconnect_cbs.append(callback)

    async def publish(self, subject: str, data: bytes, reply: str = "",
                      headers: dict[str, str] | None = None) -> None:
        """Publish; BusDisconnected while reconnecting or closed (no silent buffering)."""
        if not self._nc.is_connected:
            raise BusDisconnected("NATS is not connected")
        try:
            await self._nc.publish(subject, data, reply=reply, headers=tracing.inject(headers))
        except (nats_errors.ConnectionClosedError, nats_errors.OutboundBufferLimitError) as exc:
            raise BusDisconnected(str(exc)) from exc

    async def subscribe(self, subject: str, handler: Handler, queue: str = "") -> _Sub:
        """Subscribe; ``handler`` gets a bus Msg. Handler exceptions are logged, not propagated."""
        async def cb(m: NatsMsg) -> None:
            try:
                with tracing.attached(m.headers):  # the sender's trace context, for the handler and its tasks
                    await handler(Msg(m.subject, m.data, m.reply or "", m.headers, self))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handler for %s failed", subject)
        sub = await self._nc.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=65536,
                                       pending_bytes_limit=256 * 1024 * 1024)
        return _Sub(sub)

    async def request(self, subject: str, data: bytes, timeout: float,
                      headers: dict[str, str] | None = None) -> Msg:
        """Request-reply with a deadline of ``timeout`` seconds."""
        if not self._nc.is_connected:
            raise BusDisconnected("NATS is not connected")
        try:
            m = await self._nc.request(subject, data, timeout=timeout, headers=tracing.inject(headers))
        except nats_errors.NoRespondersError as exc:
            raise NoResponders(f"no responders on {subject}") from exc
        except (nats_errors.TimeoutError, asyncio.TimeoutError) as exc:
            raise BusTimeout(f"no reply on {subject} within {timeout:.3g} s") from exc
        return Msg(m.subject, m.data, m.reply or "", m.headers, self)

    def new_inbox(self) -> str:
        """Unique inbox subject under this connection's prefix."""
        return self._nc.new_inbox()

    async def flush(self, timeout: float = 2.0) -> None:
        """Round-trip to the server; BusTimeout if it takes longer than ``timeout`` s."""
        try:
            await self._nc.flush(timeout=timeout)
        except (nats_errors.TimeoutError, asyncio.TimeoutError) as exc:
            raise BusTimeout("flush timed out") from exc

    async def close(self) -> None:
        """Drain (bounded to 5 s) then close."""
        if self._nc.is_closed:
            return
        if self._nc.is_connected:
            try:
                async with asyncio.timeout(5.0):
                    await self._nc.drain()
                return
            except (TimeoutError, nats_errors.Error):
                pass
        try:  # not connected (or drain failed): nothing to flush, close without waiting on the server
            async with asyncio.timeout(2.0):
                await self._nc.close()
        except (TimeoutError, nats_errors.Error) as exc:
            log.warning("NATS close: %s", exc)

    @property
    def client(self) -> nats.NATS:
        """The underlying nats-py client (for JetStream helpers in bus/ only)."""
        return self._nc

    def js(self, timeout: float = 5.0):
        """JetStream on this connection (``bus.jetstream.JetStream``: streams, consumers, KV, objects);
        ``timeout``: seconds per JetStream API request."""
        from bus.jetstream import JetStream
        return JetStream(self._nc, timeout)
