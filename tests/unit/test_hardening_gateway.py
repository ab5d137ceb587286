"""Gateway hardening (issue 21 item 4), in memory (MemoryBus, no etcd): NATS API requests whose reply subject
the caller may not subscribe to get no reply at all and are counted; the NATS cancel says whether some
gateway held the request (and only the caller's tenant's); ``GET /metrics`` needs the operator token, or
carries no per-tenant label without one; the operator token file. About 2 s in all."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from actors import metrics as m
from bus import subjects
from bus.memory import MemoryBus
from bus.nats_auth import OPERATOR_TOKEN_ENV, operator_token
from gateway.auth import unauthorized
from gateway.frontend import Frontend, FrontendConfig
from gateway.http import HttpFront
from gateway.nats_api import NatsApi, reply_allowed, unowned_inbox

KEYS = {"Bearer key-a": "a", "Bearer key-b": "b"}


class _Cache:
    """The slice of gateway.auth.TenantCache the NATS API uses: authenticate + the tenant ids."""

    tenants = {"a": object(), "b": object()}

    def authenticate(self, authorization):
        if authorization not in KEYS:
            raise unauthorized(None)
        return SimpleNamespace(id=KEYS[authorization])


def _tenancy():
    return SimpleNamespace(cache=_Cache(), quotas=None)


async def _gateway(bus: MemoryBus, gid: str) -> tuple[Frontend, NatsApi]:
    fe = Frontend(bus, SimpleNamespace(snapshot=None), FrontendConfig(gid, validator_ack_s=0.5))
    await fe.start()
    api = NatsApi(fe, _tenancy())
    await api.start()
    return fe, api


def _dropped(reason: str, endpoint: str) -> float:
    """Current value of actorserve_nats_api_dropped_total{reason, endpoint} (0 before the first)."""
    text = m.render_latest().decode()
    for line in text.splitlines():
        if line.startswith("actorserve_nats_api_dropped_total{") and f'reason="{reason}"' in line \
                and f'endpoint="{endpoint}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


_ids = iter(range(10**6))


async def _ask(bus: MemoryBus, subject: str, data: bytes, key: str, timeout: float = 2.0) -> dict:
    """Request-reply as the tenant of ``key``, from its own inbox ``_INBOX.<tenant>.t<n>``."""
    inbox = f"{subjects.tenant_inbox_prefix(KEYS['Bearer ' + key])}.t{next(_ids)}"
    got: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_reply(msg) -> None:
        if not got.done():
            got.set_result(orjson.loads(msg.data))
    sub = await bus.subscribe(inbox, on_reply)
    try:
        await bus.publish(subject, data, reply=inbox, headers={"Authorization": f"Bearer {key}"})
        async with asyncio.timeout(timeout):
            return await got
    finally:
        await sub.unsubscribe()


def test_reply_subject_rules():
    assert reply_allowed("a", "_INBOX.a.x") and reply_allowed("a", "_INBOX.a.x.y")
    for bad in ("_INBOX.b.x", "_INBOX.a", "_INBOX.ab.x", "_INBOX.a.>", "_INBOX.a.*", "_INBOX.a..x", "", None,
                "as.int.validate", "_INBOX_gateway.x"):
        assert not reply_allowed("a", bad), bad
    tenants = {"a", "b"}
    assert unowned_inbox("_INBOX.Zx81nuid", tenants) and unowned_inbox("_INBOX.Zx81nuid.7", tenants)
    for owned in ("_INBOX.a.x", "_INBOX.b", "_INBOX_worker.x", "as.int.cancel.x", "_INBOX.>", "", None):
        assert not unowned_inbox(owned, tenants), owned


async def test_foreign_reply_subjects_get_nothing_and_are_counted():
    """Tenant a's request (every endpoint) with b's inbox as reply: nothing is published anywhere, one drop
    is counted per request; the same request with a's own inbox is answered."""
    bus = MemoryBus()
    fe, api = await _gateway(bus, "gw-1")
    seen: list[str] = []

    async def spy(msg) -> None:
        seen.append(msg.subject)
    await bus.subscribe(">", spy)
    before = {(r, e): _dropped(r, e) for r in ("reply_outside_inbox", "unauthenticated") for e in ("chat", "cancel")}
    a = {"Authorization": "Bearer key-a"}
    await bus.publish(subjects.API_CHAT, orjson.dumps({"model": "m", "messages": []}), reply="_INBOX.b.stolen",
                      headers=a)
    await bus.publish(subjects.API_CANCEL, orjson.dumps({"request_id": "r1"}), reply="_INBOX.b.stolen", headers=a)
    await bus.publish(subjects.API_CHAT, b"{}", reply="as.int.validate", headers=a)  # internal subject: the same
    await bus.publish(subjects.API_CHAT, b"{}", reply="_INBOX.b.x")  # no key, b's inbox
    await bus.publish(subjects.API_CANCEL, b"{}", reply="_INBOX_gateway.x", headers={"Authorization": "Bearer no"})
    await asyncio.sleep(0.2)
    api_subjects = (subjects.API_CHAT, subjects.API_CANCEL)
    assert [s for s in seen if s not in api_subjects] == []  # no reply, no cancel, no hand-off
    assert _dropped("reply_outside_inbox", "chat") - before["reply_outside_inbox", "chat"] == 2
    assert _dropped("reply_outside_inbox", "cancel") - before["reply_outside_inbox", "cancel"] == 1
    assert _dropped("unauthenticated", "chat") - before["unauthenticated", "chat"] == 1
    assert _dropped("unauthenticated", "cancel") - before["unauthenticated", "cancel"] == 1
    # the caller's own inbox is answered (cancel: nobody holds r1), and a key-less caller on a plain inbox
    # learns its 401
    own = await _ask(bus, subjects.API_CANCEL, orjson.dumps({"request_id": "zz"}), "key-a")
    assert own == {"request_id": "zz", "found": False, "cancelled": False}
    anon = orjson.loads((await bus.request(subjects.API_CHAT, b"{}", 2.0)).data)  # reply _INBOX.mem.<n>
    assert anon["status"] == 401 and anon["error"]["code"] == "invalid_api_key"
    await api.stop()


async def test_cancel_is_found_by_the_gateway_holding_it_for_its_tenant_only():
    """Two gateways on one bus: the request is in flight at gw-1; the cancel reaches gw-2 (the only one in
    the API queue group here). Tenant a: found, cancel sent with a's tenant; tenant b or an unknown id:
    not found, no cancel; a non-string or missing request_id: 400 naming the field."""
    bus = MemoryBus()
    holder = Frontend(bus, SimpleNamespace(snapshot=None), FrontendConfig("gw-1"))
    await holder.start()
    holder_api = NatsApi(holder, _tenancy())
    await bus.subscribe(subjects.gateway_cancel_all(), holder_api._on_cancel_lookup)  # not the API subjects
    _, api = await _gateway(bus, "gw-2")
    entry = holder.table.open("abc123", time.time() + 60, 60.0, children=2)
    entry.tenant = "a"
    cancels: list[tuple[str, str]] = []

    async def on_cancel(msg) -> None:
        body = orjson.loads(msg.data)
        cancels.append((msg.subject, body["tenant"]))
    await bus.subscribe(subjects.cancel_all(), on_cancel)

    async def cancel(key: str, body) -> dict:
        return await _ask(bus, subjects.API_CANCEL, body if isinstance(body, bytes) else orjson.dumps(body), key)
    assert await cancel("key-b", {"request_id": "chatcmpl-abc123"}) == {
        "request_id": "chatcmpl-abc123", "found": False, "cancelled": False}
    assert cancels == []
    t0 = time.monotonic()
    assert await cancel("key-a", {"request_id": "chatcmpl-abc123"}) == {
        "request_id": "chatcmpl-abc123", "found": True, "cancelled": True}
    assert time.monotonic() - t0 < 0.4  # answered by the holder, not by the look-up's timeout
    await asyncio.sleep(0.05)
    assert sorted(cancels) == sorted((subjects.cancel(r), "a") for r in ("abc123", "abc123-0", "abc123-1"))
    assert (await cancel("key-a", {"request_id": "ffff"}))["found"] is False
    for body, code in (({"request_id": 5}, "invalid_type"), ({"request_id": ["abc123"]}, "invalid_type"),
                       ({}, "missing_required_parameter"), ([1], None)):
        err = await cancel("key-a", body)
        assert err["status"] == 400 and err["error"]["param"] == "request_id" and err["error"]["code"] == code, err
    err = await cancel("key-a", b"{nope")
    assert err["status"] == 400 and err["error"]["code"] == "invalid_json"
    await api.stop()


def _metrics_front(token) -> HttpFront:
    fe = Frontend(MemoryBus(), SimpleNamespace(snapshot=None), FrontendConfig("gw-m"))
    return HttpFront(fe, operator_token=token)


async def test_metrics_needs_the_operator_token_or_hides_tenants():
    c = m.meter().create_counter("actorserve_test_hardening_total", description="test only")
    c.add(2, {"tenant": "acme", "model": "x@1"})
    c.add(3, {"tenant": "globex", "model": "x@1"})
    async with TestClient(TestServer(_metrics_front("s3cret").app())) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer key-a"},
                        {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
            r = await client.get("/metrics", headers=headers)
            body = await r.json()
            assert r.status == 401 and body["error"]["code"] == "invalid_operator_token", headers
            assert set(body["error"]) == {"message", "type", "param", "code"}
        r = await client.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        text = await r.text()
        assert r.status == 200 and 'tenant="acme"' in text and 'tenant="globex"' in text
    async with TestClient(TestServer(_metrics_front(None).app())) as client:
        r = await client.get("/metrics")
        text = await r.text()
        assert r.status == 200 and "tenant=" not in text
        [line] = [ln for ln in text.splitlines() if ln.startswith("actorserve_test_hardening_total{")]
        assert 'model="x@1"' in line and float(line.rsplit(" ", 1)[1]) == 5.0
        assert re.search(r"^actorserve_event_loop_lag_seconds|^python_gc", text, re.M)  # the rest is served


def test_operator_token_file_is_private_stable_and_only_for_gateways(tmp_path, monkeypatch):
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    token = operator_token(tmp_path)
    path = tmp_path / "operator-token"
    assert len(token) >= 40 and path.stat().st_mode & 0o777 == 0o600 and operator_token(tmp_path) == token
    monkeypatch.setenv(OPERATOR_TOKEN_ENV, "inherited")
    sup = Supervisor(StackConfig(tmp_path, port=0, supervise=False, watch_registry=False))
    assert sup.factory.env("gateway")[OPERATOR_TOKEN_ENV] == token
    assert OPERATOR_TOKEN_ENV not in sup.factory.env("worker")


def test_jetstream_permissions_name_each_role_s_streams():
    """No role gets the whole JetStream API any more; each gets the API of its own streams only (the
    server-side check is tests/integration/test_nats_roles.py)."""
    from bus import streams
    from control.ops.nats_roles import ROLES, platform_streams, role_permissions

    def api_streams(role: str, op: str = "allow") -> set[str]:
        pats = role_permissions(role)["publish"].get(op, [])
        assert subjects.js_api_all() not in pats and "$JS.API.INFO" not in pats, role
        return {p.split(".")[4] for p in pats if p.startswith(subjects.JS_API + ".STREAM.INFO.")}
    kv = {streams.kv_stream(b) for b in (streams.USAGE_BUCKET, streams.QUOTA_BUCKET, streams.IDEM_BUCKET,
                                         streams.JOBS_BUCKET, streams.RESPONSES_BUCKET)}
    assert api_streams("gateway") == {"AS_DONE", "AS_JOBS", "OBJ_as_job_data", *kv}
    assert api_streams("jobs") == {"AS_JOBS", "KV_as_jobs", "KV_as_quota", "OBJ_as_job_data"}  # quota: spend budgets
    assert api_streams("scheduler") == {subjects.ANY_STREAM}
    assert api_streams("scheduler", "deny") == set(platform_streams()) == {"AS_DONE", "AS_JOBS", "OBJ_as_job_data", *kv}
    assert all(not api_streams(r) for r in ROLES if r not in ("gateway", "jobs", "scheduler"))
    assert subjects.js_stream_api("AS_JOBS")[0] == "$JS.API.STREAM.INFO.AS_JOBS"
    for bad in ("a.b", ">", ""):
        with pytest.raises(ValueError):
            subjects.js_stream_api(bad)
