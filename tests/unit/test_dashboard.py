"""The operator dashboard's routes and credential (gateway/dashboard.py), on an in-memory bus.

Login with the operator token sets an HttpOnly, SameSite=Strict session cookie that is not the token; the page
and its JSON answer 401 without it (API keys and wrong tokens included); a foreign Origin cannot log in; without
a token configured the dashboard is open but shows no tenant. The JSON carries what the bus delivered
(completion records, a scheduler's load report with tenant shares).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from bus import subjects
from bus.memory import MemoryBus
from bus.messages import ActorLoad, CompletionRecord
from gateway import dashboard as dash
from gateway.frontend import Frontend, FrontendConfig
from gateway.http import HttpFront


def _front(token, bus=None) -> HttpFront:
    fe = Frontend(bus or MemoryBus(), SimpleNamespace(snapshot=None), FrontendConfig("gw-d"))
    return HttpFront(fe, operator_token=token)


def test_session_cookie_is_an_expiring_mac_of_the_token_not_the_token():
    now = time.time()
    v = dash.session_value("s3cret", int(now) + 60)
    assert "s3cret" not in v and dash.session_valid(v, "s3cret", now)
    assert not dash.session_valid(v, "other-token", now)  # a rotated token voids it
    assert not dash.session_valid(v, "s3cret", now + 61)  # expired
    head, mac = v.split(".")
    assert not dash.session_valid(f"{int(head) + 3600}.{mac}", "s3cret", now)  # expiry moved: MAC breaks
    for bad in (None, "", "x.y", ".", "12"):
        assert not dash.session_valid(bad, "s3cret", now)


def test_page_is_self_contained_and_its_csp_allows_only_its_own_script_and_style():
    html, csp = dash.page()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing from another origin
    for tag in ("script", "style"):
        [body] = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp


async def test_login_cookie_then_data_and_refusals():
    async with TestClient(TestServer(_front("s3cret").app())) as client:
        for headers in ({}, {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer wrong"}):
            r = await client.get("/dashboard/data", headers=headers)
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_operator_token", headers
        r = await client.get("/dashboard")
        assert r.status == 401 and 'action="/dashboard/login"' in await r.text()  # the login form
        r = await client.post("/dashboard/login", data={"token": "key-a"}, allow_redirects=False)
        assert r.status == 401 and not r.cookies
        r = await client.post("/dashboard/login", data={"token": "s3cret"}, allow_redirects=False,
                              headers={"Origin": "http://evil.example"})
        assert r.status == 403 and not r.cookies
        r = await client.post("/dashboard/login", data={"token": "s3cret"}, allow_redirects=False,
                              headers={"Origin": "null"})  # an opaque origin is not ours either
        assert r.status == 403
        r = await client.post("/dashboard/login", data={"token": "s3cret"}, allow_redirects=False,
                              headers={"Origin": f"https://{client.host}:{client.port}"})  # TLS proxy in front
        assert r.status == 303 and r.headers["Location"] == "/dashboard"
        cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/dashboard" in cookie
        assert "s3cret" not in cookie
        r = await client.get("/dashboard")
        assert r.status == 200 and "Content-Security-Policy" in r.headers
        r = await client.get("/dashboard/data")
        body = await r.json()
        assert r.status == 200 and body["tenants_visible"] is True and r.headers["Cache-Control"] == "no-store"
        r = await client.post("/dashboard/logout", allow_redirects=False)
        assert r.status == 303
        client.session.cookie_jar.clear()
        assert (await client.get("/dashboard/data")).status == 401
        r = await client.get("/dashboard/data", headers={"Authorization": "Bearer s3cret"})  # scripts
        assert r.status == 200


async def test_without_a_token_it_is_open_and_hides_tenants():
    async with TestClient(TestServer(_front(None).app())) as client:
        r = await client.get("/dashboard")
        assert r.status == 200
        body = await (await client.get("/dashboard/data")).json()
        assert body["tenants_visible"] is False and body["versions"] == []
        r = await client.post("/dashboard/login", data={"token": "x"}, allow_redirects=False)
        assert r.status == 400 and (await r.json())["error"]["param"] == "token"


async def test_data_shows_records_and_scheduler_report_from_the_bus():
    bus = MemoryBus()
    async with TestClient(TestServer(_front("s3cret", bus).app())) as client:
        auth = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/dashboard/data", headers=auth)).status == 200  # starts listening
        for i in range(4):
            rec = CompletionRecord(f"r{i}", "acme", "m", "1", "ok", "stop", 10, 5,
                                   {"validation_ms": 2, "queue_ms": 3, "prefill_ms": 15 + i, "decode_ms": 40})
            await bus.publish(subjects.done("m", "1"), rec.encode())
        load = ActorLoad("scheduler", "sched-1", time.time(), 1.0, name="m", version="1", queue_len=3,
                         queue_tokens=120.0, workers=1, tenants=[["acme", 0.75, 0.5], ["globex", 0.25, 0.5]])
        await bus.publish(subjects.load_subject("scheduler", "sched-1"), load.encode())
        await asyncio.sleep(0.05)
        body = await (await client.get("/dashboard/data", headers=auth)).json()
    [v] = body["versions"]
    assert v["model"] == "m@1" and v["traffic"]["requests_60s"] == 4
    assert v["traffic"]["ttft_ms_p50"] == 21.0 and v["traffic"]["itl_ms_p99"] == 10.0  # 2+3+16; 40/(5-1)
    assert v["queue"]["queue_len"] == 3 and v["queue"]["queue_tokens"] == 120.0
    assert v["tenants"] == [{"tenant": "acme", "service_share": 0.75, "weight_share": 0.5},
                            {"tenant": "globex", "service_share": 0.25, "weight_share": 0.5}]


async def test_feed_listens_only_while_watched():
    """No page open: no subscription; the first read subscribes; ``idle_s`` after the last read it stops."""
    from gateway.dashboard_feed import DashboardFeed

    feed = DashboardFeed(MemoryBus(), None, None, idle_s=0.1)
    assert feed._subs == []
    snap = await feed.snapshot(show_tenants=True)
    assert len(feed._subs) == 2 and snap["versions"] == [] and snap["errors"] == {}
    await asyncio.sleep(0.35)
    assert feed._subs == []
    await feed.snapshot(show_tenants=False)  # a new read listens again
    assert len(feed._subs) == 2
    await feed.stop()
    assert feed._subs == []


async def test_an_unreadable_login_form_is_a_400_naming_the_field():
    """A form body that is not UTF-8, or names an unknown charset, is refused with 400 (never a 500)."""
    async with TestClient(TestServer(_front("s3cret").app())) as client:
        for body, ctype in ((b"token=\xff\xfe", "application/x-www-form-urlencoded"),
                            (b"token=s3cret", "application/x-www-form-urlencoded; charset=nope")):
            r = await client.post("/dashboard/login", data=body, headers={"Content-Type": ctype},
                                  allow_redirects=False)
            assert r.status == 400, (ctype, await r.text())
            err = (await r.json())["error"]
            assert err["param"] == "token" and err["code"] == "invalid_form" and not r.cookies
