"""The chaos harness's own logic (tests/chaos/load.py, report.py) against canned HTTP answers
(httpx.MockTransport: no sockets): how each ending is classified, gateway failover, the table."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from tests.chaos import report
from tests.chaos.load import ChaosClient, JobRecord, Outcome, PhaseResult

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events)


CHUNK = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]}
FINAL = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}


def run(handler, kind: str = "chat", killed=(), grace_s: float = 5.0) -> tuple[Outcome, ChaosClient]:
    """One request of ``kind`` answered by ``handler``; the outcome and the client."""
    async def go():
        client = ChaosClient(URLS, "sk", "tiny", deadline_ms=10 if grace_s < 1 else 10_000, grace_s=grace_s,
                             transport=httpx.MockTransport(handler))
        client.killed.update(killed)
        try:
            return await client.one(kind, 0), client
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_plain_outcomes():
    ok = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}]}
    assert run(lambda r: httpx.Response(200, json=ok))[0].outcome == "completed"
    err = {"error": {"message": "busy", "type": "overloaded", "param": None, "code": "queue_full"}}
    out = run(lambda r: httpx.Response(503, json=err, headers={"Retry-After": "1"}))[0]
    assert (out.outcome, out.status, out.detail) == ("retryable", 503, "queue_full")
    assert run(lambda r: httpx.Response(429, json=err, headers={"Retry-After": "2"}))[0].outcome == "retryable"
    assert run(lambda r: httpx.Response(503, json=err))[0].outcome == "failed"  # no Retry-After
    assert run(lambda r: httpx.Response(400, json=err))[0].outcome == "failed"
    assert run(lambda r: httpx.Response(200, json={"choices": []}))[0].outcome == "failed"


def test_stream_outcomes():
    def stream(body: bytes):
        return lambda r: httpx.Response(200, content=body, headers={"Content-Type": "text/event-stream"})
    assert run(stream(sse(CHUNK, FINAL, b"[DONE]")), "chat-stream")[0].outcome == "completed"
    lost = {"error": {"message": "worker died", "type": "server_error", "param": None, "code": "worker_lost"}}
    out = run(stream(sse(CHUNK, lost, b"[DONE]")), "completion-stream")[0]
    assert (out.outcome, out.detail) == ("retryable", "in-stream worker_lost")
    odd = {"error": {"message": "?", "type": "invalid_request_error", "param": None, "code": "something"}}
    assert run(stream(sse(CHUNK, odd)), "chat-stream")[0].outcome == "failed"
    assert run(stream(sse(CHUNK)), "chat-stream")[0].outcome == "failed"  # ended without a final chunk
    flagged = {"error": {**odd["error"], "status": 503, "retryable": True, "retry_after": 1}}
    assert run(stream(sse(CHUNK, flagged, b"[DONE]")), "chat-stream")[0].outcome == "retryable"
    refused = {"error": {**lost["error"], "status": 400, "retryable": False}}  # the flag wins over the code
    assert run(stream(sse(CHUNK, refused, b"[DONE]")), "chat-stream")[0].outcome == "failed"


def test_transport_errors_and_failover():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)
    out, client = run(refuse, killed={0, 1})
    assert out.outcome == "retryable" and out.detail == "ConnectError"
    assert client.pick_gateway() != out.gateway  # the refused gateway is skipped for a while
    out, _ = run(refuse)  # a gateway that was not killed: not excused
    assert out.outcome == "failed"


def test_no_final_answer_is_hung():
    async def slow(request):
        await asyncio.sleep(5)
        return httpx.Response(200, json={})
    out, _ = run(slow, grace_s=0.05)
    assert out.outcome == "hung"


def test_counts_and_table():
    res = PhaseResult("worker", fault_at=10.0, recovered_s=2.5)
    res.requests = [Outcome("chat", 0, 9.5, "completed", 200, "", 1.0),  # in flight at the fault
                    Outcome("chat", 1, 11.0, "retryable", 503, "worker_lost", 0.1),
                    Outcome("chat", 0, 12.0, "hung", 0, "", 15.0)]
    res.jobs = [JobRecord(0, "a", "accepted", "completed"), JobRecord(1, "b", "accepted", "failed"),
                JobRecord(0, "c", "accepted", "in_progress"), JobRecord(1, None, "retryable")]
    c = res.counts()
    assert (c["sent"], c["completed"], c["retryable"], c["failed"], c["hung"], c["in_flight_at_fault"]) == \
        (3, 1, 1, 0, 1, 1)
    assert (c["jobs_submitted"], c["jobs_completed"], c["jobs_failed"], c["jobs_lost"], c["jobs_refused"]) == \
        (3, 1, 1, 1, 1)
    table = report.render_table([res, PhaseResult("baseline")])
    lines = table.splitlines()
    assert lines[0].startswith("| fault") and lines[-1].startswith("| total") and "2.5" in lines[2]
    assert report.totals([res, res])["hung"] == 2


def test_refuses_non_loopback():
    with pytest.raises(ValueError):
        ChaosClient(["http://example.com:8000"], "sk", "tiny")
