"""NATS API parity with the HTTP API (issue 4, item 8) and the tested docs/nats-api.md example."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import nats
import openai
import orjson
import pytest

MODEL = "smollm2-135m-instruct"
STORY = [{"role": "user", "content": "Tell me a short story about a dog."}]
ROOT = Path(__file__).resolve().parents[2]


def public_url(nats_url: str) -> str:
    """The NATS URL without the internal user's credentials."""
    scheme, _, rest = nats_url.partition("://")
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}"


def dev_credentials(stack) -> dict:
    """nats.connect keyword arguments of the dev tenant's NATS user (user = key id, password = API key)."""
    user = (Path(stack.state_dir) / "dev-nats-user").read_text().strip()
    return {"user": user, "password": stack.dev_api_key, "inbox_prefix": "_INBOX.dev"}


async def _ask(stack, subject: str, body: dict | bytes) -> list[dict]:
    """Every reply message of one request, up to the one marked final (or the single non-streaming one),
    sent as the dev tenant's NATS user with its API key."""
    nc = await nats.connect(public_url(stack.nats_url), **dev_credentials(stack))
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    await nc.publish(subject, data, reply=inbox, headers={"Authorization": f"Bearer {stack.dev_api_key}"})
    out = []
    streaming = isinstance(body, dict) and body.get("stream") is True
    while True:
        msg = orjson.loads((await sub.next_msg(timeout=60)).data)
        out.append(msg)
        if not streaming or msg.get("final") or "error" in msg:
            break
    await nc.close()
    return out


def ask(stack, subject: str, body) -> list[dict]:
    return asyncio.run(_ask(stack, subject, body))


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=stack.dev_api_key, timeout=120, max_retries=0)


def test_nats_streaming_parity_n_seed_logprobs_usage(stack):
    body = {"model": MODEL, "messages": STORY, "n": 2, "seed": 5, "temperature": 0.8, "max_tokens": 10,
            "logprobs": True, "top_logprobs": 1}
    http = client(stack).chat.completions.create(**body)
    [full] = ask(stack, "as.api.v1.chat", body)
    assert [c["message"]["content"] for c in full["choices"]] == [c.message.content for c in http.choices]
    assert full["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    chunks = ask(stack, "as.api.v1.chat", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["final"] is True and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"]
    assert all(c["usage"] is None for c in chunks[:-1])
    texts, finishes = {}, {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
            if ch["finish_reason"]:
                finishes[ch["index"]] = finishes.get(ch["index"], 0) + 1
    assert texts == {c.index: c.message.content for c in http.choices} and finishes == {0: 1, 1: 1}
    plain = ask(stack, "as.api.v1.completions", {"model": MODEL, "prompt": ["Hi", "Yo"], "max_tokens": 3,
                                                  "stream": True})
    assert plain[-1]["final"] is True and "actorserve_timing" in plain[-1]
    assert all("usage" not in c for c in plain)
    assert sorted({ch["index"] for c in plain for ch in c["choices"]}) == [0, 1]


@pytest.mark.parametrize("endpoint,body", [
    ("chat", {"model": MODEL, "messages": STORY, "n": 9}),
    ("chat", {"model": MODEL, "messages": STORY, "top_logprobs": 2}),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
    ("chat", {"model": "no-such-model", "messages": STORY}),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 9000}], "stream": True}),
    ("completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}),
    ("completions", b"{not json"),
])
def test_nats_errors_equal_http_errors(stack, endpoint, body):
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    r = httpx.post(f"{stack.http_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                   content=data, headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {stack.dev_api_key}"}, timeout=60)
    [reply] = ask(stack, f"as.api.v1.{endpoint}", data)
    assert reply["status"] == r.status_code and reply["final"] is True
    assert reply["error"] == r.json()["error"]


def test_docs_example_runs(stack):
    doc = (ROOT / "docs" / "nats-api.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ACTORSERVE_NATS": public_url(stack.nats_url),
                               "ACTORSERVE_API_KEY": stack.dev_api_key,
                               "ACTORSERVE_NATS_USER": dev_credentials(stack)["user"], "ACTORSERVE_TENANT": "dev"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout and "choice 0:" in proc.stdout and "choice 1:" in proc.stdout


def operator_headers(stack) -> dict:
    """``Authorization`` of the operator token (``<state-dir>/operator-token``) for the gateway's /metrics."""
    return {"Authorization": "Bearer " + (Path(stack.state_dir) / "operator-token").read_text().strip()}


def dropped_count(stack, endpoint: str, reason: str = "reply_outside_inbox") -> float:
    """``actorserve_nats_api_dropped_total{endpoint, reason}`` on the gateway's /metrics (0 if absent)."""
    text = httpx.get(stack.http_url + "/metrics", headers=operator_headers(stack), timeout=10).text
    for line in text.splitlines():
        if line.startswith("actorserve_nats_api_dropped_total{") and f'endpoint="{endpoint}"' in line \
                and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _cancel_and_foreign_replies(stack) -> None:
    nc = await nats.connect(public_url(stack.nats_url), **dev_credentials(stack))
    admin = await nats.connect(stack.nats_url)  # the internal user: may read every inbox
    auth = {"Authorization": f"Bearer {stack.dev_api_key}"}

    async def cancel(body) -> dict:
        msg = await nc.request("as.api.v1.cancel", orjson.dumps(body), timeout=10, headers=auth)
        return orjson.loads(msg.data)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        long = {"model": MODEL, "messages": STORY, "max_tokens": 400, "ignore_eos": True, "stream": True}
        await nc.publish("as.api.v1.chat", orjson.dumps(long), reply=inbox, headers=auth)
        rid = orjson.loads((await sub.next_msg(timeout=60)).data)["id"]
        assert await cancel({"request_id": rid}) == {"request_id": rid, "found": True, "cancelled": True}
        n = 1
        while True:  # the stream ends soon after, far short of 400 tokens
            last = orjson.loads((await sub.next_msg(timeout=30)).data)
            n += 1
            if last.get("final") or "error" in last:
                break
        assert n < 200 and last["final"] is True, (n, last)
        assert last["status"] == 408 and last["error"]["code"] == "cancelled", last
        assert await cancel({"request_id": rid}) == {"request_id": rid, "found": False, "cancelled": False}
        bad = await cancel({"request_id": 5})
        assert bad["status"] == 400 and bad["error"]["param"] == "request_id" and bad["final"] is True
        # a reply subject outside the caller's inbox: nothing is published there, the drop is counted
        before = dropped_count(stack, "chat"), dropped_count(stack, "cancel")
        spy = await admin.subscribe("_INBOX.other.>")
        await admin.flush()
        await nc.publish("as.api.v1.chat", orjson.dumps({**long, "max_tokens": 2}), reply="_INBOX.other.x",
                         headers=auth)
        await nc.publish("as.api.v1.cancel", orjson.dumps({"request_id": rid}), reply="_INBOX.other.x", headers=auth)
        await nc.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await spy.next_msg(timeout=1.5)
        assert (dropped_count(stack, "chat"), dropped_count(stack, "cancel")) == (before[0] + 1, before[1] + 1)
    finally:
        await nc.close()
        await admin.close()


def test_nats_cancel_says_found_and_foreign_replies_get_nothing(stack):
    """Issue 21 item 4: the cancel reply says whether the request was in flight (and ends it), a second
    cancel or a malformed id says otherwise; a request or cancel whose reply subject lies outside the
    caller's tenant inbox gets no message anywhere and is counted. About 5 s on the SmolLM2 stack."""
    asyncio.run(_cancel_and_foreign_replies(stack))
