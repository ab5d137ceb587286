"""An idempotent request that ends in a retryable error keeps its ``Retry-After`` (gateway/idempotency.py).

Seen in the cluster test (tests/cluster): during a scheduler failover, requests sent with an
``Idempotency-Key`` got 503 ``scheduler_unavailable`` without ``Retry-After``, while the same request
without the header carried it, so a client could not tell that it should retry.
"""

from __future__ import annotations

from bus.errors import ServeError
from gateway.idempotency import LiveRun, _result
from gateway.merge import ChoiceMerger
from gateway.pipeline import Outcome


def _outcome(detail: dict | None) -> Outcome:
    return Outcome(ChoiceMerger("chat", "r1", "tiny@1", {}, {}, 1),
                   failure=ServeError.from_wire(detail) if detail is not None else None)


def test_error_before_output_keeps_retry_after():
    err = {"status": 503, "message": "no scheduler", "type": "unavailable", "code": "scheduler_unavailable",
           "retryable": True, "retry_after": 1.0}
    for stream in (False, True):
        headers, body = _result(_outcome(err), LiveRun(stream=stream))
        assert headers["Retry-After"] == "1", (stream, headers)
        assert body["error"]["code"] == "scheduler_unavailable"


def test_success_has_no_retry_after():
    headers, _ = _result(_outcome(None), LiveRun(stream=False))
    assert "Retry-After" not in headers


def test_store_trouble_is_a_503_not_a_500():
    """The as_idem bucket failing (JetStream without a leader during a partition) answers 503 +
    Retry-After (``idempotency_unavailable``); it escaped as an aiohttp 500 before."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from bus.kv import KvError
    from gateway.idempotency import IdempotencyStore
    from gateway.openai_format import ApiError

    class DownKv:
        async def get(self, key):
            raise KvError("get: JetStream system temporarily unavailable")

    store = IdempotencyStore(js=None, gateway_id="gw-0")
    store.kv = DownKv()
    req = SimpleNamespace(tenant_id="t", endpoint="chat", body={"stream": True}, headers={}, deadline_ms=1000)
    with pytest.raises(ApiError) as info:
        asyncio.run(store.handle(None, None, req, "key-1"))
    assert info.value.status == 503 and info.value.code == "idempotency_unavailable"
    assert info.value.http_headers()["Retry-After"] == "1"


def test_result_is_stored_through_a_store_outage():
    """A finished run whose store answers errors for a while (JetStream re-electing after a partition
    heals) still stores its result, so a later request with the key replays it instead of taking the
    claim over and running the model a second time (seen in the cluster test: two texts for one key)."""
    import asyncio

    from bus.kv import KvError, MemoryBuckets
    from gateway.idempotency import IdempotencyStore, running_record

    async def go() -> dict:
        store = IdempotencyStore(MemoryBuckets(), "gw-0")
        await store.open()
        kv = store.kv
        rev = await kv.create("i.t.k", running_record("bh", "gw-0", deadline=1e12, now=0.0))
        real_get, fails = kv.get, [2]

        async def flaky_get(key):
            if fails[0]:
                fails[0] -= 1
                raise KvError("get: JetStream system temporarily unavailable")
            return await real_get(key)
        kv.get = flaky_get
        await store._finish("i.t.k", "bh", rev, 200, {}, {"ok": 1}, None, within_s=5.0)
        return (await real_get("i.t.k")).value

    rec = asyncio.run(go())
    assert rec["state"] == "done" and rec["json"] == {"ok": 1}, rec
