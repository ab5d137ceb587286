"""The Responses API (/v1/responses, as.api.v1.responses) through the official ``openai`` client and the
NATS API against the session stack (SmolLM2): create, stream, store/retrieve/input_items/delete, chaining,
background + cancel, errors, tenant isolation (docs/responses.md)."""

from __future__ import annotations

import asyncio
import time

import httpx
import nats
import openai
import orjson
import pytest

from bus import subjects
from tests.e2e.test_nats_api import dev_credentials, public_url
from tests.e2e.test_tenants import new_tenant

MODEL = "smollm2-135m-instruct"
PROMPT = "Name one colour."


def client(stack, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=key or stack.dev_api_key, timeout=120,
                         max_retries=0)


def test_create_retrieve_chain_isolation_delete(stack):
    c = client(stack)
    r = c.responses.create(model=MODEL, input=PROMPT, instructions="Answer briefly.", max_output_tokens=6,
                           temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.model.startswith(MODEL) and r.instructions == "Answer briefly." and r.max_output_tokens == 6
    [msg] = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == [] and r.output_text
    assert 1 <= r.usage.output_tokens <= 6 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    got = c.responses.retrieve(r.id)
    assert got.output_text == r.output_text and got.status == r.status
    assert got.usage.total_tokens == r.usage.total_tokens
    items = c.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", PROMPT)]
    # chaining: the previous input and output are the history of the next (instructions are not carried)
    r2 = c.responses.create(model=MODEL, input="Another one?", previous_response_id=r.id, max_output_tokens=4,
                            temperature=0)
    assert r2.previous_response_id == r.id and r2.status in ("completed", "incomplete")
    alone = c.responses.create(model=MODEL, input="Another one?", max_output_tokens=1, store=False)
    assert r2.usage.input_tokens > alone.usage.input_tokens + r.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(alone.id)  # store=false: not kept
    # another tenant: the id is unknown to it (404, never its content), and it cannot delete it
    _, _, key = new_tenant(stack, models=(MODEL,))
    other = client(stack, key)
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: other.responses.input_items.list(r.id),
                 lambda: other.responses.create(model=MODEL, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert c.responses.retrieve(r.id).id == r.id
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_stream_events_match_nonstream(stack):
    c = client(stack)
    kw = dict(model=MODEL, input=PROMPT, max_output_tokens=6, temperature=0)
    full = c.responses.create(**kw)
    with c.responses.stream(**kw) as s:
        events = list(s)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    terminal = "response.completed" if full.status == "completed" else "response.incomplete"
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          terminal]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == full.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    last = events[-1].response
    assert last.status == full.status and last.output[0].content[0].text == full.output_text
    assert last.usage.output_tokens == full.usage.output_tokens
    kept = c.responses.retrieve(last.id)  # streamed responses are stored too, with the items' final status
    assert kept.output_text == full.output_text and kept.output[0].status == last.output[0].status != "in_progress"
    if terminal == "response.completed":
        assert s.get_final_response().output_text == full.output_text


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


def test_tools_and_text_format_map_to_chat(stack):
    """Tools and text.format reach the chat pipeline (tool calling: docs/tools.md; structured output:
    docs/structured-outputs.md): whatever chat answers, the response carries the same items."""
    c = client(stack)
    ask = "What is the weather in Paris?"
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    kw = dict(input=ask, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=24)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}], tools=[chat_tool],
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                     max_tokens=24, temperature=0)
    r = c.responses.create(model=MODEL, temperature=0, **kw)
    msg = chat.choices[0].message
    if msg.tool_calls:  # call ids are random per run: compare name and arguments
        assert [(o.name, o.arguments) for o in r.output if o.type == "function_call"] == [
            (t.function.name, t.function.arguments) for t in msg.tool_calls]
    else:
        assert [o.content[0].text for o in r.output if o.type == "message"] == [msg.content]
    with c.responses.stream(model=MODEL, temperature=0, **kw) as s:
        events = list(s)
    final = events[-1].response
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in final.output] == [
        (o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in r.output]
    # a call and its result given as input items become the assistant tool_calls + tool messages of chat
    history = [{"role": "user", "content": ask},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": "{\"city\":\"Paris\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]
    follow = c.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=6, temperature=0)
    chat_follow = c.chat.completions.create(model=MODEL, tools=[chat_tool], max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert follow.usage.input_tokens == chat_follow.usage.prompt_tokens
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    j = c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=24, temperature=0,
                           text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}})
    jc = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24,
                                   temperature=0, response_format={"type": "json_schema", "json_schema": {
                                       "name": "colour", "schema": schema, "strict": True}})
    assert j.text.format.type == "json_schema" and j.output_text == jc.choices[0].message.content


def test_errors_name_the_field(stack):
    url, h = stack.http_url + "/v1/responses", {"Authorization": f"Bearer {stack.dev_api_key}"}
    cases = [({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
             ({"model": MODEL}, "input"),
             ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
             ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
             ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
             ({"model": MODEL, "input": "x", "temperature": 7}, "temperature"),
             ({"model": MODEL, "input": "x", "bogus": 1}, "bogus"),
             ({"model": MODEL, "input": "x", "background": True, "store": False}, "background")]
    for body, param in cases:
        r = httpx.post(url, json=body, headers=h, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url, json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    for method, path in (("GET", "/resp_0123"), ("DELETE", "/resp_0123"), ("GET", "/nope/input_items"),
                         ("POST", "/resp_0123/cancel")):
        r = httpx.request(method, url + path, headers=h)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert httpx.get(url + "/resp_0123").status_code == 401


def test_idempotency_key_replays_one_response(stack):
    url = stack.http_url + "/v1/responses"
    h = {"Authorization": f"Bearer {stack.dev_api_key}", "Idempotency-Key": f"k-{time.time_ns()}"}
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 4}
    first = httpx.post(url, json=body, headers=h, timeout=60)
    again = httpx.post(url, json=body, headers=h, timeout=60)
    assert first.status_code == again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    text = first.json()["output"][0]["content"][0]["text"]
    # the same key asking for a stream gets the stored response as its event stream (same ids, same text)
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=h, timeout=60) as r:
        assert r.status_code == 409  # a different body (stream: true) under the same key
    key2 = {**h, "Idempotency-Key": h["Idempotency-Key"] + "-s"}
    sbody = {**body, "stream": True}
    with httpx.stream("POST", url, json=sbody, headers=key2, timeout=60) as r:
        live = [orjson.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    with httpx.stream("POST", url, json=sbody, headers=key2, timeout=60) as r:
        assert r.headers["Idempotent-Replayed"] == "true"
        events = [orjson.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")]
    def kinds(evs):  # a replay sends a message's text as one delta
        out = [e["type"] for e in evs]
        return [k for i, k in enumerate(out) if k != "response.output_text.delta" or out[i - 1] != k]
    assert kinds(events) == kinds(live) and len(live) >= len(events) == 9
    assert events[-1]["response"]["id"] == live[-1]["response"]["id"]
    assert events[-1]["response"]["output"] == live[-1]["response"]["output"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
        "".join(e["delta"] for e in live if e["type"] == "response.output_text.delta")
    assert text  # the first, non-streamed response had text too


def _wait_terminal(c: openai.OpenAI, resp_id: str, timeout: float = 60):
    t_end = time.monotonic() + timeout
    while True:
        r = c.responses.retrieve(resp_id)
        if r.status in ("completed", "incomplete", "failed", "cancelled"):
            return r
        assert time.monotonic() < t_end, f"response {resp_id} still {r.status}"
        time.sleep(0.1)


def test_background_and_cancel(stack):
    c = client(stack)
    r = c.responses.create(model=MODEL, input=PROMPT, max_output_tokens=4, background=True, temperature=0)
    assert r.status in ("queued", "in_progress") and r.background is True and r.output == []
    done = _wait_terminal(c, r.id)
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens >= 1
    long = c.responses.create(model=MODEL, input="Write a long story about the sea.", max_output_tokens=400,
                              background=True)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)  # the run ends; its late result must not overwrite the cancel
    final = c.responses.retrieve(long.id)
    assert final.status == "cancelled" and (final.usage is None or final.usage.output_tokens < 400)
    with pytest.raises(openai.BadRequestError):
        fg = c.responses.create(model=MODEL, input="x", max_output_tokens=1)
        c.responses.cancel(fg.id)  # only background responses can be cancelled


async def _nats_ask(stack, body: dict) -> list[dict]:
    nc = await nats.connect(public_url(stack.nats_url), **dev_credentials(stack))
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("as.api.v1.responses", orjson.dumps(body), reply=inbox,
                         headers={"Authorization": f"Bearer {stack.dev_api_key}"})
        out = []
        while True:
            out.append(orjson.loads((await sub.next_msg(timeout=60)).data))
            if not body.get("stream") or out[-1].get("final") or "error" in out[-1]:
                return out
    finally:
        await nc.close()


def test_nats_responses_parity(stack):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 5, "temperature": 0}
    http = client(stack).responses.create(**body)
    [one] = asyncio.run(_nats_ask(stack, body))
    assert one["object"] == "response" and one["output"][0]["content"][0]["text"] == http.output_text
    events = asyncio.run(_nats_ask(stack, {**body, "stream": True}))
    assert events[0]["type"] == "response.created" and events[-1]["final"] is True
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == http.output_text
    [err] = asyncio.run(_nats_ask(stack, {"model": MODEL, "input": 5}))
    assert err["status"] == 400 and err["error"]["param"] == "input" and err["final"] is True


async def _tenant_nc(stack, tenant: str, key_id: str, key: str):
    """A tenant's own NATS connection; retried while its new NATS user is not yet loaded (about 1 s)."""
    t_end = time.monotonic() + 10
    while True:
        try:
            return await nats.connect(public_url(stack.nats_url), user=key_id, password=key,
                                      inbox_prefix=f"_INBOX.{tenant}", allow_reconnect=False, connect_timeout=2)
        except Exception:
            if time.monotonic() > t_end:
                raise
            await asyncio.sleep(0.2)


async def _call(nc, subject: str, body: dict, key: str) -> dict:
    msg = await nc.request(subject, orjson.dumps(body), timeout=60, headers={"Authorization": f"Bearer {key}"})
    return orjson.loads(msg.data)


async def _nats_stored_ops(stack, tenant: str, key_id: str, key: str) -> None:
    url, h = stack.http_url + "/v1/responses", {"Authorization": f"Bearer {stack.dev_api_key}"}
    dev = await nats.connect(public_url(stack.nats_url), **dev_credentials(stack))
    other = await _tenant_nc(stack, tenant, key_id, key)
    me = stack.dev_api_key
    try:
        r = await _call(dev, subjects.API_RESPONSES, {"model": MODEL, "input": [
            {"role": "user", "content": "Hi."}, {"role": "user", "content": PROMPT}], "max_output_tokens": 3}, me)
        ref = {"response_id": r["id"]}
        got = await _call(dev, subjects.API_RESPONSES_GET, ref, me)
        assert got["id"] == r["id"] and got == httpx.get(f"{url}/{r['id']}", headers=h).json()  # one answer, two fronts
        page = await _call(dev, subjects.API_RESPONSES_INPUT_ITEMS, {**ref, "limit": 1, "order": "asc"}, me)
        assert page == httpx.get(f"{url}/{r['id']}/input_items", params={"limit": 1, "order": "asc"}, headers=h).json()
        assert page["has_more"] is True and page["data"][0]["content"][0]["text"] == "Hi."
        rest = await _call(dev, subjects.API_RESPONSES_INPUT_ITEMS, {**ref, "order": "asc", "after": page["last_id"]},
                           me)
        assert [i["content"][0]["text"] for i in rest["data"]] == [PROMPT] and rest["has_more"] is False
        for body, param in (({**ref, "limit": 0}, "limit"), ({**ref, "order": "up"}, "order"),
                            ({**ref, "limit": True}, "limit"), ({"response_id": 5}, "response_id"),
                            ({}, "response_id")):
            err = await _call(dev, subjects.API_RESPONSES_INPUT_ITEMS, body, me)
            assert err["status"] == 400 and err["error"]["param"] == param and err["final"] is True, (body, err)
        # another tenant: the same 404 as an unknown id, for every operation, and the response stays
        unknown = await _call(dev, subjects.API_RESPONSES_GET, {"response_id": "resp_0123"}, me)
        assert unknown["status"] == 404
        for subject in subjects.API_RESPONSES_OPS:
            err = await _call(other, subject, ref, key)
            assert err["status"] == 404 and err["error"] == {**unknown["error"], "message": err["error"]["message"]}
            assert err["error"]["message"] == unknown["error"]["message"].replace("resp_0123", r["id"])
        # a key's reply subject must be its own tenant's inbox (as for create): else no reply at all (issue 21)
        with pytest.raises(nats.errors.TimeoutError):
            await dev.request(subjects.API_RESPONSES_GET, orjson.dumps(ref), timeout=1.0,
                              headers={"Authorization": f"Bearer {key}"})
        fg = await _call(dev, subjects.API_RESPONSES_CANCEL, ref, me)
        assert fg["status"] == 400 and fg["error"]["param"] == "response_id"  # not a background response
        assert await _call(dev, subjects.API_RESPONSES_DELETE, ref, me) == {"id": r["id"], "object": "response",
                                                                          "deleted": True}
        assert (await _call(dev, subjects.API_RESPONSES_GET, ref, me))["status"] == 404
        assert httpx.get(f"{url}/{r['id']}", headers=h).status_code == 404
        # background: cancelled over NATS, seen cancelled over HTTP; a second cancel answers the same
        bg = await _call(dev, subjects.API_RESPONSES, {"model": MODEL, "input": "Write a long story about the sea.",
                                                       "max_output_tokens": 400, "background": True}, me)
        assert bg["status"] in ("queued", "in_progress") and bg["final"] is True
        c1 = await _call(dev, subjects.API_RESPONSES_CANCEL, {"response_id": bg["id"]}, me)
        assert c1["status"] == "cancelled" and c1["id"] == bg["id"]
        await asyncio.sleep(0.5)  # the run ends; its late result must not overwrite the cancel
        assert httpx.get(f"{url}/{bg['id']}", headers=h).json()["status"] == "cancelled"
        again = await _call(dev, subjects.API_RESPONSES_CANCEL, {"response_id": bg["id"]}, me)
        assert again["status"] == "cancelled"
        await _call(dev, subjects.API_RESPONSES_DELETE, {"response_id": bg["id"]}, me)
    finally:
        await dev.close()
        await other.close()


def test_nats_stored_response_ops(stack):
    """as.api.v1.responses.get / input_items / delete / cancel: the HTTP answers, tenant-scoped."""
    tenant, key_id, key = new_tenant(stack, models=(MODEL,))
    asyncio.run(_nats_stored_ops(stack, tenant, key_id, key))


def test_background_stream_survives_disconnect(stack):
    """background + stream: the run's events; a client that leaves does not end the run (HTTP and NATS)."""
    c = client(stack)
    kw = dict(model=MODEL, input=PROMPT, max_output_tokens=6, temperature=0)
    events = list(c.responses.create(background=True, stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1].response
    assert last.background is True and last.output_text == c.responses.create(**kw).output_text
    kept = c.responses.retrieve(last.id)
    assert kept.status == last.status and kept.output_text == last.output_text
    assert kept.output[0].status != "in_progress"
    # leave after the first event: the response still completes and is stored
    url, h = stack.http_url + "/v1/responses", {"Authorization": f"Bearer {stack.dev_api_key}"}
    body = {**kw, "max_output_tokens": 40, "background": True, "stream": True}
    with httpx.stream("POST", url, json=body, headers=h, timeout=60) as r:
        first = next(orjson.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))
    done = _wait_terminal(c, first["response"]["id"])
    assert done.status in ("completed", "incomplete") and done.output_text and done.usage.output_tokens >= 1
    # NATS: the same events, the terminal one final; a cancelled one ends with response.failed (status cancelled)
    nats_events = asyncio.run(_nats_ask(stack, {**kw, "background": True, "stream": True}))
    assert [e["type"] for e in nats_events] == [e.type for e in events] and nats_events[-1]["final"] is True
    long = {**kw, "input": "Write a long story about the sea.", "max_output_tokens": 400}
    seen = []
    with c.responses.create(background=True, stream=True, **long) as s:
        for ev in s:
            seen.append(ev)
            if ev.type == "response.output_text.delta" and seen[-2].type != ev.type:  # the first delta
                assert c.responses.cancel(seen[0].response.id).status == "cancelled"
    assert seen[-1].type == "response.failed" and seen[-1].response.status == "cancelled"
    assert seen[-1].response.output[0].content[0].text  # what was generated before the cancel
    assert c.responses.retrieve(seen[0].response.id).status == "cancelled"
