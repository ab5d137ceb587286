"""The NATS cancel across gateways on a real nats-server with the per-role users (issue 21 item 4): the
gateway that receives ``as.api.v1.cancel`` is not the one holding the request; it finds the holder over
``as.int.gwcancel.<id>`` with the gateway role's own permissions, and the cancel goes out with the caller's
tenant. About 2 s."""

from __future__ import annotations

import asyncio
import time

import nats
import orjson
import pytest

from bus import subjects
from bus.nats_bus import NatsBus
from control.ops.embedded import EmbeddedNats
from gateway.frontend import Frontend, FrontendConfig
from gateway.nats_api import NatsApi
from tests.unit.test_hardening_gateway import KEYS, _tenancy


@pytest.fixture
async def server(tmp_path):
    srv = EmbeddedNats(tmp_path, auth=True)
    async with srv:
        yield srv


async def _front(srv: EmbeddedNats, gid: str) -> tuple[NatsBus, Frontend, NatsApi]:
    bus = await NatsBus.connect(srv.role_url("gateway"), name=gid)  # the gateway role's user and inbox
    fe = Frontend(bus, None, FrontendConfig(gid))
    await fe.start()
    return bus, fe, NatsApi(fe, _tenancy())


async def test_a_cancel_reaching_another_gateway_finds_the_holder(server):
    bus1, holder, holder_api = await _front(server, "gw-1")
    bus2, _, api = await _front(server, "gw-2")
    await bus1.subscribe(subjects.gateway_cancel_all(), holder_api._on_cancel_lookup)  # gw-1 serves no API here
    await api.start()  # so every public cancel reaches gw-2
    entry = holder.table.open("abc123", time.time() + 60, 60.0)
    entry.tenant = "a"
    clients = {t: await nats.connect(server.client_url, inbox_prefix=subjects.tenant_inbox_prefix(t))
               for t in ("a", "b")}
    cancels: list[tuple[str, str]] = []

    async def on_cancel(msg) -> None:
        cancels.append((msg.subject, orjson.loads(msg.data)["tenant"]))
    await clients["a"].subscribe(subjects.cancel_all(), cb=on_cancel)
    await clients["a"].flush()
    await bus1.flush()
    await bus2.flush()

    async def cancel(tenant: str, rid: str) -> dict:
        key = next(k for k, t in KEYS.items() if t == tenant)
        msg = await clients[tenant].request(subjects.API_CANCEL, orjson.dumps({"request_id": rid}), timeout=5,
                                            headers={"Authorization": key})
        return orjson.loads(msg.data)
    try:
        assert await cancel("b", "chatcmpl-abc123") == {"request_id": "chatcmpl-abc123", "found": False,
                                                        "cancelled": False}
        t0 = time.monotonic()
        assert await cancel("a", "chatcmpl-abc123") == {"request_id": "chatcmpl-abc123", "found": True,
                                                        "cancelled": True}
        assert time.monotonic() - t0 < 0.45  # the holder answered (not the look-up's 0.5 s give-up)
        async with asyncio.timeout(5):
            while not cancels:
                await asyncio.sleep(0.02)
        assert cancels == [(subjects.cancel("abc123"), "a")]
        assert (await cancel("a", "0123abcd"))["found"] is False
    finally:
        await api.stop()
        for nc in clients.values():
            await nc.close()
        await holder.stop()
        for bus in (bus1, bus2):
            await bus.close()
