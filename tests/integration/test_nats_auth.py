"""NATS users of the embedded nats-server (bus/nats_auth.py): the internal user may do anything, a
tenant key's user may only publish to the public API and read its own inbox, and a removed user is cut
off by the reload. Real nats-server."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import NoServersError

from control.ops.embedded import EmbeddedNats
from control.ops.embedded_server import http_get_json
from bus.nats_auth import tenant_users
from control.state.tenants import _key_entry, new_api_key


def _records(**keys_by_tenant):
    return {tid: {"id": tid, "keys": {kid: _key_entry(key)}} for tid, (kid, key) in keys_by_tenant.items()}


async def _connect(url, user=None, password=None, **kw):
    errors: list[Exception] = []

    async def on_error(e):
        errors.append(e)
    nc = await nats.connect(url, user=user, password=password, allow_reconnect=False, connect_timeout=5,
                            error_cb=on_error, **kw)
    return nc, errors


async def _reload(srv, users) -> None:
    """Install ``users`` and wait until nats-server has applied the reload (its /varz config_load_time
    moves): a fixed sleep raced the reload on a loaded machine (a tenant connected, then had no rights)."""
    before = http_get_json(f"{srv.monitor_url}/varz")["config_load_time"]
    assert srv.set_tenant_users(users)
    await _wait_for(lambda: http_get_json(f"{srv.monitor_url}/varz")["config_load_time"] != before)


async def _delivered(reader, writer, pattern: str, subject: str, reply: str = "", tries: int = 10):
    """The message ``writer`` publishes on ``subject`` as read by ``reader`` subscribed to ``pattern``.
    Each try subscribes afresh and waits 0.5 s: nats-server applies a new user's permissions
    asynchronously, so the first try after a reload can be refused (seen 1 in 10 runs, before and after
    the wait for config_load_time). nats.errors.TimeoutError after ``tries`` tries."""
    for _ in range(tries):
        sub = await reader.subscribe(pattern)
        await reader.flush()
        await writer.publish(subject, b"m", reply=reply)
        try:
            return await sub.next_msg(timeout=0.5)
        except nats.errors.TimeoutError:
            await sub.unsubscribe()
    raise nats.errors.TimeoutError


async def _wait_for(cond, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.05)


async def test_tenant_users_are_confined_to_the_api_and_their_inbox(tmp_path):
    acme, other = new_api_key(), new_api_key()
    srv = EmbeddedNats(tmp_path, auth=True)
    async with srv:
        await _reload(srv, tenant_users(_records(acme=acme, other=other)))
        with pytest.raises(Exception):  # no credentials: refused
            await nats.connect(srv.url, allow_reconnect=False, connect_timeout=3, max_reconnect_attempts=0)
        internal, _ = await _connect(srv.client_url)
        tenant, errors = await _connect(srv.url, acme[0], acme[1], inbox_prefix="_INBOX.acme")
        try:
            # the internal user reads everything, including what the tenant publishes to the API
            got = await _delivered(internal, tenant, "as.api.v1.chat", "as.api.v1.chat", reply="_INBOX.acme.x")
            assert got.reply == "_INBOX.acme.x"
            # own inbox: allowed
            assert (await _delivered(tenant, internal, "_INBOX.acme.>", "_INBOX.acme.y")).data == b"m"
            # another tenant's inbox, everything, internal subjects: permission errors, nothing delivered
            for subject in ("_INBOX.other.>", ">", "as.int.>", "_INBOX.>"):
                sub = await tenant.subscribe(subject)
                await tenant.flush()
                await internal.publish("_INBOX.other.z", b"secret")
                with pytest.raises(nats.errors.TimeoutError):
                    await sub.next_msg(timeout=0.3)
            spy = await internal.subscribe("as.int.validate")
            await internal.flush()
            await tenant.publish("as.int.validate", b"forged")
            with pytest.raises(nats.errors.TimeoutError):
                await spy.next_msg(timeout=0.5)
            await _wait_for(lambda: sum("ermissions violation" in str(e) for e in errors) >= 5)
            # revoking the user (reload without it) disconnects the tenant; the internal user stays
            only_other = tenant_users(_records(other=other))
            assert srv.set_tenant_users(only_other)
            await _wait_for(lambda: tenant.is_closed, timeout=10)
            assert internal.is_connected
            with pytest.raises((NoServersError, Exception)):
                await nats.connect(srv.url, user=acme[0], password=acme[1], allow_reconnect=False,
                                   connect_timeout=3, max_reconnect_attempts=0)
            assert not srv.set_tenant_users(list(only_other))  # unchanged: no reload
        finally:
            await tenant.close()
            await internal.close()


def test_revoked_and_legacy_keys_get_no_user():
    kid, key = new_api_key()
    rec = {"t": {"keys": {kid: {**_key_entry(key), "revoked": 1.0},
                          "kold": {"hash": "sha256:x", "prefix": "sk-as-x", "revoked": None}}}}
    assert tenant_users(rec) == []
    rec["t"]["keys"][kid]["revoked"] = None
    [u] = tenant_users(rec)
    assert u["user"] == kid and u["password"].startswith("$2b$")
    assert u["permissions"]["subscribe"]["allow"] == ["_INBOX.t.>"]
