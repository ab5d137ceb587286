"""Tenants end to end on `up --gateways 3` with the tiny model: keys (401), live revocation on every
gateway, model access (404 like unknown, /v1/models filtered), rpm exact across 3 gateways,
Idempotency-Key across replicas (model runs once, 409, disconnect does not cancel), usage metering."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from bus import subjects
from bus.messages import CompletionRecord
from bus.nats_bus import NatsBus
from control.state.registry import Registry
from control.state.tenants import TenantAdmin
from tests.e2e.helpers import wait_until


@pytest.fixture(scope="module")
def gw3(tmp_path_factory, tiny_gguf):
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    sup = Supervisor(StackConfig(tmp_path_factory.mktemp("tenants-state"), port=0, gateways=3, supervise=False,
                                 model_file=tiny_gguf, model_name="tiny",
                                 actor_args={"worker": ["--kv-cache-bytes", "8000000", "--no-progress"],
                                 "scheduler": ["--max-queue-per-tenant", "1024"]}))
    sup.start()
    try:
        sup.wait_ready(timeout=120)
        yield sup
    finally:
        sup.stop()


def admin(sup, fn):
    """Run ``await fn(TenantAdmin)`` against the stack's etcd."""
    async def go():
        async with Registry.connect(sup.etcd_url) as reg:
            return await fn(TenantAdmin(reg))
    return asyncio.run(go())


def new_tenant(sup, models=("tiny",), **quotas) -> tuple[str, str, str]:
    """(tenant id, key id, key) of a fresh tenant."""
    name = f"t-{uuid.uuid4().hex[:8]}"

    async def fn(adm):
        _, key_id, key = await adm.create(name, allowed_models=list(models))
        if quotas:
            await adm.set_quota(name, **quotas)
        return name, key_id, key
    out = admin(sup, fn)
    picked_up(lambda: all(httpx.get(sup.gateway_url(i) + "/v1/models", headers=bearer(out[2]),
                                     timeout=10).status_code == 200 for i in range(sup.cfg.gateways)))
    return out


def picked_up(cond, timeout_s: float = 5.0) -> None:
    """Until every gateway saw an etcd edit (``cond()``); AssertionError after the timeout."""
    wait_until(cond, timeout_s, "gateways did not pick up the tenant edit")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


def test_dev_key_file_and_401s(gw3):
    dev = (gw3.state_dir / "dev-api-key").read_text().strip()
    assert dev == gw3.dev_api_key
    url = gw3.gateway_url(1) + "/v1/completions"
    assert httpx.post(url, json=BODY, headers=bearer(dev), timeout=60).status_code == 200
    for headers in ({}, bearer("sk-as-wrong"), {"Authorization": "Basic abc"}):
        r = httpx.post(url, json=BODY, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(gw3.gateway_url(2) + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(gw3.gateway_url(2) + "/v1/models/tiny", timeout=30).status_code == 401


def test_model_access_and_revocation_on_every_gateway(gw3):
    name, key_id, key = new_tenant(gw3, models=())
    urls = [gw3.gateway_url(i) for i in range(3)]
    assert httpx.get(urls[0] + "/v1/models", headers=bearer(key)).json()["data"] == []  # empty list = none
    denied = httpx.post(urls[1] + "/v1/completions", json=BODY, headers=bearer(key), timeout=30)
    unknown = httpx.post(urls[1] + "/v1/completions", json={**BODY, "model": "nope"}, headers=bearer(key), timeout=30)
    assert denied.status_code == unknown.status_code == 404
    one = [httpx.get(urls[0] + f"/v1/models/{m}", headers=bearer(key), timeout=30) for m in ("tiny", "nope")]
    assert [r.status_code for r in one] == [404, 404] and one[0].json()["error"]["code"] == "model_not_found"
    assert denied.json()["error"]["message"].replace("tiny", "X") == unknown.json()["error"]["message"].replace(
        "nope", "X")
    admin(gw3, lambda adm: adm.allow_models(name, ["tiny"]))
    picked_up(lambda: {m["id"] for m in httpx.get(urls[2] + "/v1/models", headers=bearer(key)).json()["data"]}
               == {"tiny", "tiny@1"})
    assert httpx.post(urls[2] + "/v1/completions", json=BODY, headers=bearer(key), timeout=60).status_code == 200
    picked_up(lambda: httpx.get(urls[0] + "/v1/models/tiny@1", headers=bearer(key), timeout=30).status_code == 200)
    got = httpx.get(urls[0] + "/v1/models/tiny@1", headers=bearer(key), timeout=30).json()
    assert got["id"] == "tiny@1" and got["object"] == "model"
    t0 = time.monotonic()
    admin(gw3, lambda adm: adm.revoke_key(key_id))
    pending = set(range(3))
    while pending and time.monotonic() - t0 < 1.0:
        for i in list(pending):
            if httpx.get(urls[i] + "/v1/models", headers=bearer(key), timeout=5).status_code == 401:
                pending.discard(i)
    print(f"revocation effective on 3 gateways after {time.monotonic() - t0:.3f} s")
    assert not pending


class Resp:
    """Status, headers and JSON body of one response (aiohttp: a light client keeps 100 req/s on 2 cores)."""

    def __init__(self, status: int, headers: dict, body: dict) -> None:
        self.status_code, self.headers, self.body = status, headers, body

    def json(self) -> dict:
        return self.body


async def _burst(sup, key: str, n: int, split: tuple[int, ...], seconds: float) -> list[Resp]:
    """``n`` requests, gateway i getting split[i] of them, sent evenly within ``seconds``."""
    import aiohttp

    targets = [i for i, k in enumerate(split) for _ in range(k)]
    urls = [sup.gateway_url(i) + "/v1/completions" for i in range(len(split))]

    async def one(c, url):
        async with c.post(url, json={**BODY, "max_tokens": 1}) as r:
            return Resp(r.status, dict(r.headers), await r.json())
    conn = aiohttp.TCPConnector(limit=300)
    async with aiohttp.ClientSession(connector=conn, headers=bearer(key),
                                     timeout=aiohttp.ClientTimeout(total=60)) as c:
        t0, tasks = time.monotonic(), []
        for j in range(n):
            await asyncio.sleep(max(0.0, t0 + j * seconds / n - time.monotonic()))
            tasks.append(asyncio.create_task(one(c, urls[targets[(j * 7919) % n]])))  # interleave gateways
        sent = time.monotonic() - t0
        out = await asyncio.gather(*tasks)
    print(f"{n} requests sent in {sent:.1f} s")
    assert sent < 10.0, f"sending took {sent:.1f} s"
    return out


def test_rpm_100_exact_across_three_gateways(gw3):
    _, _, key = new_tenant(gw3, rpm=100)
    rs = asyncio.run(_burst(gw3, key, 1000, (700, 200, 100), 9.0))
    quota_429 = [r for r in rs if r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"]
    ok = [r for r in rs if r.status_code == 200]
    other = [(r.status_code, r.json().get("error", {}).get("code")) for r in rs if r not in ok and r not in quota_429]
    print(f"rpm=100 over 3 gateways: {len(ok)} x 200, {len(quota_429)} x quota 429, other (status, code): {other}")
    assert 99 <= len(ok) <= 101 and len(ok) + len(quota_429) == 1000
    r = quota_429[-1]
    assert int(r.headers["Retry-After"]) >= 1
    assert r.headers["x-ratelimit-limit-requests"] == "100" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    assert ok[0].headers["x-ratelimit-limit-requests"] == "100"
    more = asyncio.run(_burst(gw3, key, 20, (0, 0, 20), 1.0))
    assert [r.status_code for r in more] == [429] * 20


async def _keyed(sup, key: str, idem: str, body: dict, gateways: list[int]) -> tuple[list[httpx.Response], int]:
    """Send the same keyed request to several gateways at once; return the responses and how many
    completion records the model produced for them."""
    bus = await NatsBus.connect(sup.nats_url, name="test-idem")
    recs: list[CompletionRecord] = []

    async def on(m):
        recs.append(CompletionRecord.decode(m.data))
    sub = await bus.subscribe(subjects.done("tiny", "1"), on)
    async with httpx.AsyncClient(timeout=60) as c:
        rs = await asyncio.gather(*(c.post(sup.gateway_url(g) + "/v1/completions", json=body,
                                           headers={**bearer(key), "Idempotency-Key": idem}) for g in gateways))
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    await bus.close()
    return rs, len(recs)


def test_idempotency_key_across_gateways(gw3):
    name, _, key = new_tenant(gw3)
    body = {"model": "tiny", "prompt": "idempotent", "max_tokens": 24, "ignore_eos": True, "temperature": 1.0}
    rs, runs = asyncio.run(_keyed(gw3, key, "order-1", body, [0, 1, 2, 0]))
    assert [r.status_code for r in rs] == [200] * 4
    assert len({r.json()["id"] for r in rs}) == 1 and len({r.json()["choices"][0]["text"] for r in rs}) == 1
    assert runs == 1, "the model must run once"
    rs2, runs2 = asyncio.run(_keyed(gw3, key, "order-1", body, [2]))  # later: replayed
    assert rs2[0].json() == rs[0].json() and rs2[0].headers["Idempotent-Replayed"] == "true" and runs2 == 0
    conflict, _ = asyncio.run(_keyed(gw3, key, "order-1", {**body, "max_tokens": 3}, [1]))
    assert conflict[0].status_code == 409 and conflict[0].json()["error"]["code"] == "idempotency_key_conflict"
    _, _, other_key = new_tenant(gw3)  # keys are per tenant
    other, runs3 = asyncio.run(_keyed(gw3, other_key, "order-1", body, [1]))
    assert other[0].status_code == 200 and other[0].json()["id"] != rs[0].json()["id"] and runs3 == 1


def test_keyed_stream_survives_disconnect_and_replays(gw3):
    _, _, key = new_tenant(gw3)
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 40, "ignore_eos": True, "stream": True}
    headers = {**bearer(key), "Idempotency-Key": "stream-1"}
    with httpx.stream("POST", gw3.gateway_url(0) + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    # hung up after the first event: the run goes on; another gateway replays the whole stream
    t_end = time.time() + 30
    while True:
        r = httpx.post(gw3.gateway_url(1) + "/v1/completions", json=body, headers=headers, timeout=60)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        if events and events[-1] == "[DONE]":
            break
        assert time.time() < t_end
    assert events[0] == first[6:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks for ch in c["choices"] if ch.get("finish_reason")) == 1
    assert len({c["id"] for c in chunks}) == 1


def test_usage_metered_identically_streamed_or_not(gw3):
    _, _, key = new_tenant(gw3)
    body = {"model": "tiny", "prompt": "count", "max_tokens": 5, "ignore_eos": True}
    url = gw3.gateway_url(2) + "/v1/completions"
    assert httpx.post(url, json=body, headers=bearer(key), timeout=60).status_code == 200
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=bearer(key), timeout=60) as r:
        assert r.status_code == 200 and r.read()
    t_end = time.time() + 10
    while True:
        rows = httpx.get(gw3.gateway_url(0) + "/v1/usage", headers=bearer(key), timeout=10).json()["data"]
        if rows and rows[0]["requests"] == 2:
            break
        assert time.time() < t_end, rows
        time.sleep(0.2)
    assert rows[0]["model"] == "tiny@1" and rows[0]["completion_tokens"] == 10
    assert rows[0]["prompt_tokens"] % 2 == 0
    # an abandoned stream is metered too, by the tokens generated before the cancel took effect
    long = {"model": "tiny", "prompt": "abandon", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=long, headers=bearer(key), timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
    t_end = time.time() + 10
    while True:
        rows = httpx.get(gw3.gateway_url(1) + "/v1/usage", headers=bearer(key), timeout=10).json()["data"]
        if rows[0]["requests"] == 3:
            break
        assert time.time() < t_end, rows
        time.sleep(0.2)
    assert rows[0]["by_status"].get("cancelled") == 1 and 10 < rows[0]["completion_tokens"] < 410
    dev_rows = httpx.get(gw3.gateway_url(0) + "/v1/usage", headers=bearer(gw3.dev_api_key)).json()
    assert dev_rows["tenant"] == "dev"  # own tenant only


def test_idempotency_survives_gateway_restart_and_crash(gw3, tmp_path):
    """A replayed result outlives its gateway process; a run whose gateway was SIGKILLed is taken over
    by another replica once the owner's heartbeat is stale (and runs once more)."""
    import signal

    from control.ops.ports import free_port
    from tests.e2e.conftest import ActorProcs

    _, _, key = new_tenant(gw3)
    procs = ActorProcs(gw3, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def start_gateway():
        procs.start(f"gw-extra-{time.monotonic_ns()}", "gateway", "--port", str(port), "--gateway-id", "gw-extra")
        t_end = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    time.sleep(0.5)  # tenants loaded right after the listener in practice; be safe
                    return
            except httpx.HTTPError:
                pass
            assert time.time() < t_end, "extra gateway did not start"
            time.sleep(0.2)
    try:
        start_gateway()
        body = {"model": "tiny", "prompt": "restart", "max_tokens": 4}
        headers = {**bearer(key), "Idempotency-Key": "restart-1"}
        first = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert first.status_code == 200
        procs.stop_all()
        start_gateway()
        again = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert again.json() == first.json() and again.headers["Idempotent-Replayed"] == "true"

        # crash mid-run: the owner dies, gateway 0 takes over after the stale heartbeat
        long = {"model": "tiny", "prompt": "crash", "max_tokens": 400, "ignore_eos": True, "stream": True}
        headers = {**bearer(key), "Idempotency-Key": "crash-1"}
        with httpx.stream("POST", url + "/v1/completions", json=long, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
            for p in procs.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(gw3.gateway_url(0) + "/v1/completions", json=long, headers=headers, timeout=60)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        print(f"takeover after a crashed owner answered in {time.monotonic() - t0:.1f} s")
        assert r.status_code == 200 and events[-1] == "[DONE]"
    finally:
        procs.stop_all()


# -- async jobs -------------------------------------------------------------------------------------


def _wait_job(sup, key: str, job_id: str, statuses: tuple[str, ...], timeout: float = 60) -> dict:
    t_end = time.time() + timeout
    while True:
        job = httpx.get(sup.gateway_url(0) + f"/v1/jobs/{job_id}", headers=bearer(key), timeout=10).json()
        if job.get("status") in statuses:
            return job
        assert time.time() < t_end, job
        time.sleep(0.2)


def test_job_lifecycle_batch_and_isolation(gw3):
    _, _, key = new_tenant(gw3)
    _, _, other = new_tenant(gw3)
    url = gw3.gateway_url(1) + "/v1/jobs"
    r = httpx.post(url, json={"endpoint": "/v1/completions",
                              "body": {"model": "tiny", "prompt": "job", "max_tokens": 3}}, headers=bearer(key))
    assert r.status_code == 202 and r.json()["status"] == "validating" and r.json()["id"].startswith("job_")
    job_id = r.json()["id"]
    job = _wait_job(gw3, key, job_id, ("completed", "failed"))
    assert job["status"] == "completed" and job["result"]["object"] == "text_completion"
    assert job["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    # another tenant sees nothing: not the job, not its results, not in its list, cannot cancel it
    for method, path in (("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/results"),
                         ("DELETE", f"/v1/jobs/{job_id}")):
        resp = httpx.request(method, gw3.gateway_url(2) + path, headers=bearer(other))
        assert resp.status_code == 404 and job_id not in resp.text.replace(f"'{job_id}'", "")
    assert httpx.get(url, headers=bearer(other)).json()["data"] == []
    assert [j["id"] for j in httpx.get(url, headers=bearer(key)).json()["data"]] == [job_id]
    # the batch form: JSONL in, JSONL out
    lines = "\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}],
                                           "max_tokens": 2}}) for i in range(3))
    r = httpx.post(url, content=lines, headers={**bearer(key), "Content-Type": "application/jsonl"})
    assert r.status_code == 202, r.text
    batch = _wait_job(gw3, key, r.json()["id"], ("completed", "failed"))
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    out = httpx.get(gw3.gateway_url(2) + f"/v1/jobs/{batch['id']}/results", headers=bearer(key)).text
    rows = [json.loads(x) for x in out.splitlines()]
    assert [x["custom_id"] for x in rows] == ["c0", "c1", "c2"]
    assert all(x["response"]["body"]["object"] == "chat.completion" for x in rows)
    page = httpx.get(url + "?limit=1", headers=bearer(key)).json()
    assert page["has_more"] and page["data"][0]["id"] == batch["id"]
    # idempotent submission
    body = {"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "once", "max_tokens": 2}}
    h = {**bearer(key), "Idempotency-Key": "job-1"}
    a, b = httpx.post(url, json=body, headers=h), httpx.post(gw3.gateway_url(2) + "/v1/jobs", json=body, headers=h)
    assert a.status_code == b.status_code == 202 and a.json()["id"] == b.json()["id"]
    assert httpx.post(url, json={**body, "deadline_ms": 5000}, headers=h).status_code == 409


def test_job_cancel_and_survives_jobs_actor_crash(gw3, tmp_path):
    import signal

    from tests.e2e.conftest import ActorProcs

    _, _, key = new_tenant(gw3)
    url = gw3.gateway_url(0) + "/v1/jobs"
    long = {"endpoint": "/v1/completions",
            "body": {"model": "tiny", "prompt": "long", "max_tokens": 450, "ignore_eos": True}}
    job_id = httpx.post(url, json=long, headers=bearer(key)).json()["id"]
    _wait_job(gw3, key, job_id, ("in_progress",))
    assert httpx.delete(url + f"/{job_id}", headers=bearer(key)).json()["status"] in ("cancelling", "cancelled")
    job = _wait_job(gw3, key, job_id, ("cancelled", "completed"), timeout=30)
    assert job["status"] == "cancelled"

    # the jobs actor dies mid-job: the job is redelivered (ack wait) to its replacement and completes
    job_id = httpx.post(url, json=long, headers=bearer(key)).json()["id"]
    _wait_job(gw3, key, job_id, ("in_progress",))
    actor = gw3.actor("jobs-0")
    actor.proc.send_signal(signal.SIGKILL)
    actor.proc.wait(10)
    procs = ActorProcs(gw3, tmp_path)
    try:
        procs.start("jobs-replacement", "jobs")
        t0 = time.monotonic()
        job = _wait_job(gw3, key, job_id, ("completed", "failed"), timeout=60)
        print(f"job recovered after a jobs-actor crash in {time.monotonic() - t0:.1f} s (attempts {job['attempts']})")
        assert job["status"] == "completed" and job["attempts"] == 2
        assert job["result"]["usage"]["completion_tokens"] == 450
    finally:
        procs.stop_all()


def test_jobs_survive_nats_server_restart(gw3, tmp_path):
    """nats-server SIGKILLed and restarted (same port, same file storage) while jobs are queued and one
    is running: every accepted job still completes. (Last in this module: it restarts the bus.)"""
    from tests.e2e.conftest import ActorProcs

    procs = ActorProcs(gw3, tmp_path)
    if gw3.actor("jobs-0").proc.poll() is not None:  # killed by the crash test above
        procs.start("jobs-for-nats-restart", "jobs")
    try:
        _nats_restart_with_jobs(gw3)
    finally:
        procs.stop_all()


def _nats_restart_with_jobs(gw3) -> None:
    _, _, key = new_tenant(gw3)
    url = gw3.gateway_url(0) + "/v1/jobs"
    body = {"endpoint": "/v1/completions",
            "body": {"model": "tiny", "prompt": "survive", "max_tokens": 300, "ignore_eos": True}}
    ids = [httpx.post(url, json=body, headers=bearer(key)).json()["id"] for _ in range(6)]
    _wait_job(gw3, key, ids[0], ("in_progress",))
    gw3.stack.nats.kill()
    time.sleep(1.0)
    gw3.stack.nats.start()
    t0 = time.monotonic()
    for job_id in ids:
        job = _wait_job(gw3, key, job_id, ("completed", "failed", "expired"), timeout=90)
        print(f"{job_id}: done {time.monotonic() - t0:.1f} s after the restart, attempts {job.get('attempts')}, "
              f"ran {job['completed_at'] - job['in_progress_at']:.1f} s")
        assert job["status"] == "completed" and job["result"]["usage"]["completion_tokens"] == 300, job
    print(f"6 jobs completed {time.monotonic() - t0:.1f} s after a nats-server restart")


async def _nats_tenant(sup, key_id: str, key: str, tenant: str):
    """A tenant's own NATS connection (user = key id, password = key) and the errors it receives."""
    import nats
    errors: list[str] = []

    async def on_error(e):
        errors.append(str(e))
    scheme, _, rest = sup.nats_url.partition("://")
    nc = await nats.connect(f"{scheme}://{rest.rsplit('@', 1)[-1]}", user=key_id, password=key,
                            inbox_prefix=f"_INBOX.{tenant}", allow_reconnect=False, connect_timeout=5,
                            error_cb=on_error)
    return nc, errors


async def _nats_ask(nc, body: dict, key: str | None, reply: str | None = None) -> list[dict]:
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    await nc.publish("as.api.v1.completions", json.dumps(body).encode(), reply=reply or inbox, headers=headers)
    out = []
    if reply:  # sent elsewhere: nothing may come back here
        with pytest.raises(Exception):
            await sub.next_msg(timeout=1.0)
        return out
    while True:
        msg = json.loads((await sub.next_msg(timeout=30)).data)
        out.append(msg)
        if not body.get("stream") or msg.get("final") or "error" in msg:
            return out


def test_nats_users_isolate_tenants(gw3):
    """Issue #5 item 7: per-tenant NATS users. A tenant reads only its own inbox, publishes only to the API,
    cannot direct replies into another tenant's inbox, and a revoked key is cut off."""
    a, a_kid, a_key = new_tenant(gw3)
    b, b_kid, b_key = new_tenant(gw3)
    body = {"model": "tiny", "prompt": "secret of a", "max_tokens": 6, "ignore_eos": True, "stream": True}

    async def scenario():
        t_end = time.monotonic() + 10
        while True:  # the supervisor installs the new users within about 0.5 s
            try:
                na, a_errors = await _nats_tenant(gw3, a_kid, a_key, a)
                nb, b_errors = await _nats_tenant(gw3, b_kid, b_key, b)
                break
            except Exception:
                assert time.monotonic() < t_end, "tenant NATS users were not installed"
                await asyncio.sleep(0.2)
        spies = [await nb.subscribe(s) for s in (f"_INBOX.{a}.>", "_INBOX.>", ">", "as.int.>")]
        own_b = await nb.subscribe(f"_INBOX.{b}.>")
        await nb.flush()
        chunks = await _nats_ask(na, body, a_key)  # a's stream reaches a ...
        assert chunks[-1]["final"] and sum(len(c.get("choices", [])) for c in chunks) >= 1
        for spy in spies:  # ... and none of b's subscriptions outside its inbox
            with pytest.raises(Exception):
                await spy.next_msg(timeout=0.3)
        t_end = time.monotonic() + 5
        while sum("permissions violation" in e.lower() for e in b_errors) < 4:
            assert time.monotonic() < t_end, b_errors
            await asyncio.sleep(0.05)
        # no key (a's inbox), b's key (a's inbox), a's key into b's inbox: no reply anywhere, since the gateway
        # never publishes where the caller may not subscribe (issue 21; counted, docs/nats-api.md)
        probe = await na.subscribe(f"_INBOX.{a}.probe")
        for key, reply in ((None, f"_INBOX.{a}.probe"), (b_key, f"_INBOX.{a}.probe"), (a_key, f"_INBOX.{b}.stolen")):
            await _nats_ask(na, {**body, "stream": False}, key, reply=reply)
        for sub in (probe, own_b):
            with pytest.raises(Exception):
                await sub.next_msg(timeout=0.5)
        await na.publish(subjects.cancel("x" * 8), b"{}")  # internal subjects: refused by nats-server
        await na.flush()
        t_end = time.monotonic() + 5  # the server's -ERR reaches the error callback asynchronously
        while not any("permissions violation" in e.lower() for e in a_errors):
            assert time.monotonic() < t_end, a_errors
            await asyncio.sleep(0.05)
        # revoking a's key removes its NATS user and disconnects it
        async with Registry.connect(gw3.etcd_url) as reg:
            await TenantAdmin(reg).revoke_key(a_kid)
        t_end = time.monotonic() + 5
        while not na.is_closed:
            assert time.monotonic() < t_end, "revoked key's NATS connection still open"
            await asyncio.sleep(0.1)
        with pytest.raises(Exception):
            await _nats_tenant(gw3, a_kid, a_key, a)
        await nb.close()

    asyncio.run(scenario())
