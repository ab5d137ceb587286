"""Issue #8 item 1 end to end: one connected OpenTelemetry trace per request across gateway -> validator ->
scheduler -> worker, the context carried in NATS headers.

Runs the tiny model under ``tiny_deployment`` with ``ACTORSERVE_TRACES=file:<path>`` (every actor appends its
finished spans as JSON lines to one file), sends a few requests (chat, streamed chat, completions over HTTP; chat over the NATS API with the
client's own ``traceparent``, which the trace joins) and checks
each request's spans: one trace id, the six spans, the parent links, distinct traces per request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import httpx
import nats
import orjson

from tests.e2e.helpers import tiny_deployment

WORKER_ARGS = {"worker": ["--kv-cache-bytes", "8000000", "--no-progress"]}
NAMES = {"request", "auth", "validation", "queue", "prefill", "decode"}
PARENT = {"auth": "request", "validation": "request", "queue": "validation", "prefill": "queue", "decode": "queue"}
SERVICE = {"request": "gateway", "auth": "gateway", "validation": "validator", "queue": "scheduler",
           "prefill": "worker", "decode": "worker"}


def send(sup, endpoint: str, stream: bool = False) -> str:
    """One request; returns its request id (from the response id)."""
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    if endpoint == "chat":
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        url, body = "/v1/completions", {"prompt": "hello"}
    body.update(model="tiny", max_tokens=4, stream=stream)
    with httpx.Client(base_url=sup.http_url, timeout=60, headers=headers) as c:
        if not stream:
            r = c.post(url, json=body)
            assert r.status_code == 200, r.text
            return r.json()["id"].split("-", 1)[1]
        with c.stream("POST", url, json=body) as r:
            assert r.status_code == 200, r.read()
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return events[0]["id"].split("-", 1)[1]


async def _nats_chat(sup, traceparent: str) -> str:
    """One chat request on the NATS API (dev tenant's NATS user) carrying the client's ``traceparent``."""
    scheme, _, rest = sup.nats_url.partition("://")
    user = (Path(sup.state_dir) / "dev-nats-user").read_text().strip()
    nc = await nats.connect(f"{scheme}://{rest.rsplit('@', 1)[-1]}", user=user, password=sup.dev_api_key,
                            inbox_prefix="_INBOX.dev")
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        await nc.publish("as.api.v1.chat", orjson.dumps(body), reply=inbox,
                         headers={"Authorization": f"Bearer {sup.dev_api_key}", "traceparent": traceparent})
        reply = orjson.loads((await sub.next_msg(timeout=60)).data)
    finally:
        await nc.close()
    assert "error" not in reply, reply
    return reply["id"].split("-", 1)[1]


def read_spans(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trace_of(spans: list[dict], rid: str) -> str:
    """The trace id of the request's root span (asserting there is exactly one)."""
    roots = [s for s in spans if s["name"] == "request" and s["attributes"].get("actorserve.request_id") == rid]
    assert len(roots) == 1, f"{len(roots)} request spans for {rid}"
    return roots[0]["trace_id"]


def test_one_connected_trace_per_request(tmp_path, tiny_gguf):
    spans_file = tmp_path / "spans.jsonl"
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS,
                         env={"ACTORSERVE_TRACES": f"file:{spans_file}"}) as sup:
        rids = [send(sup, "chat"), send(sup, "chat", stream=True), send(sup, "completions"), send(sup, "chat")]
        client_trace, client_span = "ab" * 16, "cd" * 8  # a NATS API client that traces: its trace is joined
        rids.append(asyncio.run(_nats_chat(sup, f"00-{client_trace}-{client_span}-01")))
        t_end = time.monotonic() + 15
        while True:  # the gateway's span ends as its response is sent: give the files a moment
            spans = read_spans(spans_file)
            by_trace = defaultdict(list)
            for s in spans:
                by_trace[s["trace_id"]].append(s)
            complete = [rid for rid in rids if any(
                {x["name"] for x in t} >= NAMES and any(x["attributes"].get("actorserve.request_id") == rid for x in t)
                for t in by_trace.values())]
            if len(complete) == len(rids) or time.monotonic() > t_end:
                break
            time.sleep(0.2)

    traces = [trace_of(spans, rid) for rid in rids]
    assert len(set(traces)) == len(rids), "distinct requests must have distinct trace ids"
    assert traces[-1] == client_trace
    for rid, tid in zip(rids, traces):
        # every span naming this request belongs to its one trace
        assert {s["trace_id"] for s in spans if s["attributes"].get("actorserve.request_id") == rid} == {tid}
        mine = by_trace[tid]
        names = sorted(s["name"] for s in mine)
        assert names == sorted(NAMES), f"trace of {rid}: {names}"
        by_name = {s["name"]: s for s in mine}
        root = by_name["request"]
        assert root["parent_span_id"] == (client_span if tid == client_trace else "") and root["status"] != "ERROR"
        attrs = root["attributes"]
        assert attrs["actorserve.tenant"] and attrs["actorserve.model_version"].startswith("tiny@")
        assert attrs["actorserve.endpoint"] in ("chat", "completions")
        assert attrs.get("http.response.status_code", 200) == 200 and ("url.path" in attrs) != (tid == client_trace)
        ids = {s["span_id"] for s in mine}
        assert len(ids) == len(mine)
        for name, parent in PARENT.items():
            assert by_name[name]["parent_span_id"] == by_name[parent]["span_id"], f"{name} of {rid}"
        for s in mine:
            assert s["service"] == f"actorserve-{SERVICE[s['name']]}", s
            assert s["start"] <= s["end"] + 1e-6, s
        # explicit-time spans line up: queue ends at dispatch, before the worker starts prefill; decode follows
        assert by_name["queue"]["end"] <= by_name["prefill"]["start"] + 0.05
        assert abs(by_name["prefill"]["end"] - by_name["decode"]["start"]) < 1e-3
        assert root["start"] <= by_name["auth"]["start"] and by_name["decode"]["end"] <= root["end"] + 0.05
