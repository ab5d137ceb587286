"""A reconnect does not wait 30 s for a silent server's TLS connection to close (bus/nats_bus.py
``_bound_transport_close``). Seen in the cluster test (tests/cluster): with TLS, a client of a nats-server
whose host was partitioned away noticed the silence after 2 PINGs, then stayed connected to nothing for
asyncio's 30 s TLS shutdown timeout. No server: a fake writer that never finishes closing. About 1 s."""

from __future__ import annotations

import asyncio
import time

from nats.aio.transport import TcpTransport

from bus import nats_bus


class _StuckTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _StuckWriter:
    def __init__(self) -> None:
        self.transport = _StuckTransport()

    async def wait_closed(self) -> None:
        await asyncio.sleep(60)  # a TLS close_notify the partitioned peer never answers


def test_wait_closed_is_bounded_and_aborts():
    nats_bus._bound_transport_close()
    nats_bus._bound_transport_close()  # idempotent: not wrapped twice
    t = TcpTransport()
    t._io_writer = _StuckWriter()
    t0 = time.monotonic()
    asyncio.run(t.wait_closed())
    assert time.monotonic() - t0 < nats_bus.TRANSPORT_CLOSE_S + 1.0
    assert t._io_writer.transport.aborted
