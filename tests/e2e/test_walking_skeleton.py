"""Acceptance checks of the walking skeleton against real processes, nats-server and etcd."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import orjson
import pytest

from bus import subjects
from bus.messages import CompletionRecord
from bus.nats_bus import NatsBus
from control.state.registry import Registry
from tests.e2e.helpers import latest_worker_stats

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MODEL = "smollm2-135m-instruct"


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=stack.dev_api_key, timeout=120, max_retries=0)


def auth(stack) -> dict:
    """Authorization header with the stack's development key (<state-dir>/dev-api-key)."""
    return {"Authorization": f"Bearer {stack.dev_api_key}"}


def test_openai_client_chat_and_stream(stack):
    c = client(stack)
    r = c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=48)
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.model == f"{MODEL}@1" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    deltas = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=48, stream=True) if ch.choices]
    assert "".join(deltas) == text


def test_completions_endpoint(stack):
    r = client(stack).completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text and r.usage.prompt_tokens > 0 and r.usage.completion_tokens <= 8


def test_models_and_health(stack):
    ids = [m.id for m in client(stack).models.list().data]
    assert MODEL in ids and f"{MODEL}@1" in ids
    assert httpx.get(stack.http_url + "/healthz").status_code == 200
    assert httpx.get(stack.http_url + "/readyz").status_code == 200


async def _nats_chat(stack, body: dict) -> list[dict]:
    bus = await NatsBus.connect(stack.nats_url, name="test-client", inbox_prefix="_INBOX.dev")
    inbox = bus.new_inbox()
    got: list[dict] = []
    done = asyncio.Event()

    async def on_msg(msg):
        obj = orjson.loads(msg.data)
        got.append(obj)
        if obj.get("final") or not body.get("stream"):
            done.set()
    sub = await bus.subscribe(inbox, on_msg)
    await bus.publish(subjects.API_CHAT, orjson.dumps(body), reply=inbox,
                      headers={"Authorization": f"Bearer {stack.dev_api_key}"})
    async with asyncio.timeout(120):
        await done.wait()
    await sub.unsubscribe()
    await bus.close()
    return got


def test_nats_api_same_text(stack):
    http_text = client(stack).chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                                      max_tokens=48).choices[0].message.content
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 48}
    [reply] = asyncio.run(_nats_chat(stack, body))
    assert reply["choices"][0]["message"]["content"] == http_text
    chunks = asyncio.run(_nats_chat(stack, {**body, "stream": True}))
    assert chunks[-1]["final"] is True and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")) == http_text


def test_nats_api_errors(stack):
    [reply] = asyncio.run(_nats_chat(stack, {"model": "no-such-model", "messages": QUESTION}))
    assert reply["status"] == 404 and reply["error"]["code"] == "model_not_found"
    [reply] = asyncio.run(_nats_chat(stack, {"model": MODEL, "messages": []}))
    assert reply["status"] == 400 and reply["error"]["param"] == "messages"


def test_concurrent_streams_are_batched(stack):
    before = asyncio.run(latest_worker_stats(stack.nats_url))
    results: list[int] = []

    def one(i: int) -> None:
        n = 0
        for ch in client(stack).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to one hundred, request {i}."}],
                max_tokens=64, temperature=0.8, seed=i, stream=True, extra_body={"ignore_eos": True},
                stream_options={"include_usage": True}):
            if ch.usage:
                n = ch.usage.completion_tokens
        results.append(n)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == [64] * 8
    time.sleep(1.5)  # one stats period
    after = asyncio.run(latest_worker_stats(stack.nats_url))
    steps = after.num_steps - before.num_steps
    tokens = after.num_generated_tokens - before.num_generated_tokens
    assert tokens >= 8 * 64
    assert steps < tokens / 2, f"{steps} steps for {tokens} tokens: not batched"


def test_prompt_over_context_is_400_before_sse(stack):
    long = "hello " * 9000  # > 8192 tokens
    body = {"model": MODEL, "messages": [{"role": "user", "content": long}], "stream": True}
    r = httpx.post(stack.http_url + "/v1/chat/completions", json=body, timeout=60, headers=auth(stack))
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "maximum context length" in err["message"]


def test_bad_requests_are_4xx(stack):
    url = stack.http_url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json", **auth(stack)})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(url, json={"model": "nope", "messages": QUESTION}, headers=auth(stack))
    assert r.status_code == 404
    r = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "temperature": "hot"}, headers=auth(stack))
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(url, json={"model": MODEL, "messages": QUESTION, "deadline_ms": -5}, headers=auth(stack))
    assert r.status_code == 400 and r.json()["error"]["param"] == "deadline_ms"


def _register_tiny(stack, tiny_gguf: str) -> None:
    async def go():
        async with Registry.connect(stack.etcd_url) as reg:
            await reg.put_model_version("tiny", "1", {"artifact": tiny_gguf, "format": "gguf",
                                                      "context_length": 512})
            from control.state.tenants import DEV_TENANT, TenantAdmin
            adm = TenantAdmin(reg)
            dev = await adm.get(DEV_TENANT)
            await adm.allow_models(DEV_TENANT, [*dev.allowed_models, "tiny"])  # up allowed only its model
    asyncio.run(go())


async def _worker_keys(etcd_url: str) -> dict:
    async with Registry.connect(etcd_url) as reg:
        return await reg.list_workers("tiny", "1")


@pytest.fixture
def tiny_version(stack, tiny_gguf):
    """Registers ``tiny@1`` for one test, then retires it (so the stack's readiness is unaffected)."""
    _register_tiny(stack, tiny_gguf)
    yield "tiny@1"

    async def retire():
        async with Registry.connect(stack.etcd_url) as reg:
            await reg.delete_model_version("tiny", "1")
    asyncio.run(retire())


def test_killed_worker_leaves_and_gets_no_work(stack, tiny_version, actor_procs):
    actor_procs.start("sched-tiny", "scheduler", "--model", "tiny@1")
    victim = actor_procs.start("wk-victim", "worker", "--model", "tiny@1", "--worker-id", "wk-victim",
                               "--no-progress", "--kv-cache-bytes", "4000000")
    actor_procs.start("wk-keep", "worker", "--model", "tiny@1", "--worker-id", "wk-keep", "--no-progress",
                      "--kv-cache-bytes", "4000000")
    t_end = time.time() + 90
    while set(asyncio.run(_worker_keys(stack.etcd_url))) != {"wk-victim", "wk-keep"}:
        assert time.time() < t_end, "tiny workers did not register"
        time.sleep(0.3)
    os.kill(victim.pid, signal.SIGKILL)
    t_kill = time.time()
    while "wk-victim" in asyncio.run(_worker_keys(stack.etcd_url)):
        assert time.time() - t_kill <= 3 + 1, "killed worker's key outlived TTL + 1 s"
        time.sleep(0.1)
    records = asyncio.run(_served_by(stack, 12))
    assert len(records) == 12
    assert {r.worker_id for r in records} == {"wk-keep"}
    assert all(r.status == "ok" for r in records)


async def _served_by(stack, n: int) -> list[CompletionRecord]:
    bus = await NatsBus.connect(stack.nats_url, name="test-done")
    recs: list[CompletionRecord] = []
    sub = await bus.subscribe(subjects.done("tiny", "1"), lambda m: _append(recs, m))
    async with httpx.AsyncClient(timeout=60, headers=auth(stack)) as hc:
        rs = await asyncio.gather(*[hc.post(stack.http_url + "/v1/completions",
                                            json={"model": "tiny@1", "prompt": f"hi {i}", "max_tokens": 4})
                                    for i in range(n)])
    assert [r.status_code for r in rs] == [200] * n, [r.text for r in rs if r.status_code != 200]
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    await bus.close()
    return recs


async def _append(recs: list, msg) -> None:
    recs.append(CompletionRecord.decode(msg.data))


def test_client_disconnect_cancels_generation(stack):
    before = asyncio.run(latest_worker_stats(stack.nats_url))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True,
            "deadline_ms": 600_000}  # long enough for all 2000 tokens, or admission refuses it (deadline_unmeetable)
    with httpx.stream("POST", stack.http_url + "/v1/chat/completions", json=body, timeout=60,
                      headers=auth(stack)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # got generated text: now hang up
    t_end = time.time() + 10
    while True:
        after = asyncio.run(latest_worker_stats(stack.nats_url))
        if after.num_aborted > before.num_aborted:
            break
        assert time.time() < t_end, "disconnect did not cancel the generation"
    assert after.num_generated_tokens - before.num_generated_tokens < 2000
    assert after.num_running == 0
