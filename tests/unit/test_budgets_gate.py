"""Spend budgets through the gateway's code paths, on the in-memory KV twin: the pipeline's reserve / drop /
end, settlement and cost by the usage meter, no KV round trip without a budget or a price."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from bus.kv import MemoryBuckets
from bus.messages import CompletionRecord
from control.state.tenants import Budget, Tenant
from gateway import budgets as rules
from gateway import pipeline
from gateway.budget_store import BudgetGate, record_tokens
from gateway.models import ModelSnapshot
from gateway.openai_format import ApiError
from gateway.usage import UsageMeter

PRICED = {"context_length": 64, "pricing": {"prompt_per_1m": 100.0, "completion_per_1m": 200.0}}
SNAP = ModelSnapshot(versions={"m": {"1": PRICED}, "free": {"1": {"context_length": 64}}})
BODY = {"model": "m", "prompt": "abcd", "max_tokens": 5}  # reserves 8 x 100 + 5 x 200 = 1,800 micro-USD


class CountingKV:
    """Wraps a KV handle and counts its calls."""

    def __init__(self, kv) -> None:
        self.kv, self.calls = kv, 0

    async def get(self, key):
        self.calls += 1
        return await self.kv.get(key)

    async def update(self, key, change):
        self.calls += 1
        return await self.kv.update(key, change)


async def _gate(budgets: dict[str, Budget]):
    async def manifests(name, version):
        return SNAP.versions.get(name, {}).get(version)
    js = MemoryBuckets()
    gate = BudgetGate(js, budget_of=budgets.get, manifests=manifests)
    await gate.open()
    gate.kv = CountingKV(gate.kv)
    return js, gate


def _req(tenant: Tenant, body=BODY, rid="r1") -> pipeline.Request:
    return pipeline.Request(tenant.id, "completions", dict(body), rid, 5_000, {}, tenant)


class FakeFrontend:
    def __init__(self, fail: bool = False) -> None:
        self.resolver = SimpleNamespace(snapshot=SNAP)
        self.fail = fail

    async def submit(self, **kw):
        if self.fail:
            raise ApiError(503, "no validator", code="validator_unavailable")
        return SimpleNamespace(request_id=kw["request_id"])


async def _spend(gate, tenant_id):
    e = await gate.kv.kv.get(rules.spend_key(tenant_id))
    return e.value if e is not None else None


async def test_no_budget_or_no_price_means_no_kv_round_trip():
    _, gate = await _gate({"rich": Budget(1.0)})
    poor = Tenant("poor")  # no budget
    rich = Tenant("rich", budget=Budget(1.0))
    assert await pipeline.start(FakeFrontend(), _req(poor), budgets=gate) is not None
    started = await pipeline.start(FakeFrontend(), _req(rich, {**BODY, "model": "free"}), budgets=gate)
    assert started.hold is None and gate.kv.calls == 0
    started = await pipeline.start(FakeFrontend(), _req(rich, {**BODY, "model": "nosuch"}), budgets=gate)
    assert started.hold is None and gate.kv.calls == 0  # the submit answers the 404


async def test_pipeline_reserves_drops_on_failed_submit_and_ends_after_the_request():
    _, gate = await _gate({"t": Budget(0.01)})
    t = Tenant("t", budget=Budget(0.01))
    req = _req(t)
    with pytest.raises(ApiError):
        await pipeline.start(FakeFrontend(fail=True), req, budgets=gate)
    assert (await _spend(gate, "t"))["r"] == {}  # never submitted: dropped at once
    started = await pipeline.start(FakeFrontend(), _req(t, rid="r2"), budgets=gate)
    assert started.hold.amount == 1800 and started.hold.model == "m@1"
    v = await _spend(gate, "t")
    assert v["r"]["r2"]["e"] > time.time() + 60  # deadline (5 s) + EXPIRY_MARGIN_S
    await started.release()
    await started.release()  # idempotent
    v = await _spend(gate, "t")
    assert v["r"]["r2"]["e"] <= time.time() + rules.SETTLE_GRACE_S  # waits briefly for its records


async def test_budget_exhausted_through_the_pipeline():
    _, gate = await _gate({"t": Budget(0.003)})  # 3,000 micro-USD: one 1,800 reservation fits, not two
    t = Tenant("t", budget=Budget(0.003))
    first = await pipeline.start(FakeFrontend(), _req(t, rid="a"), budgets=gate)
    with pytest.raises(ApiError) as ei:
        await pipeline.start(FakeFrontend(), _req(t, rid="b"), budgets=gate)
    assert ei.value.status == 429 and ei.value.code == "budget_exhausted" and ei.value.retry_after == 1.0
    assert "month budget" in ei.value.message and first.hold is not None


async def test_meter_settles_and_records_cost():
    js, gate = await _gate({"t": Budget(1.0)})
    meter = UsageMeter(js, None, gate)
    await meter.open(consume=False)
    t = Tenant("t", budget=Budget(1.0))
    started = await pipeline.start(FakeFrontend(), _req(t, rid="r9"), budgets=gate)
    await meter.apply(CompletionRecord("r9", "t", "m", "1", "ok", "stop", 3, 4, {}, worker_id="w"))
    v = await _spend(gate, "t")
    assert v["s"] == 300 + 800 and v["r"] == {} and v["m"] == {"m@1": 1100}
    await started.release()  # after settlement: nothing left to end
    rows = await meter.usage("t")
    assert rows[0]["model"] == "m@1" and rows[0]["cost_usd"] == pytest.approx(1100e-6)
    # a tenant without a budget: its cost is recorded, its spend record untouched
    await meter.apply(CompletionRecord("x", "u", "m", "1", "ok", "stop", 10, 0, {}, worker_id="w"))
    assert (await meter.usage("u"))[0]["cost_usd"] == pytest.approx(1000e-6) and await _spend(gate, "u") is None
    assert (await gate.view("t", t.budget))["spent_usd"] == pytest.approx(0.0011)


def test_record_tokens():
    assert record_tokens(CompletionRecord("r", "t", "m", "1", "ok", "stop", 7, 3, {}, worker_id="w")) == (7, 3)
    assert record_tokens(CompletionRecord("r-1", "t", "m", "1", "ok", "stop", 7, 3, {}, worker_id="w",
                                          choice_index=1)) == (0, 3)  # the prompt counts once per request
    # a scheduler's refusal: never reached a worker, nothing generated
    assert record_tokens(CompletionRecord("r", "t", "m", "1", "error", "abort", 7, 0, {})) == (0, 0)
