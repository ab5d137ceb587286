"""Spend budgets against a real nats-server: 3 independent budget gates (3 NATS connections, as 3 gateways)
reserve concurrently for one tenant against a small budget and settle: never overspent at any moment, every
unspent reservation returned, spend = the exact actual cost; a dead gateway's reservation lapses."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from bus.messages import CompletionRecord
from control.state.tenants import Budget
from gateway import budgets as rules
from gateway.openai_format import ApiError

PRICING = {"prompt_per_1m": 100.0, "completion_per_1m": 200.0}  # 100 / 200 micro-USD per token
MANIFEST = {"name": "m", "version": "1", "context_length": 256, "pricing": PRICING}
BUDGET = Budget(0.1, "month")  # 100,000 micro-USD
BODY = {"model": "m@1", "prompt": "abcd", "max_tokens": 5}  # reserves 8 x 100 + 5 x 200 = 1,800 micro-USD


async def _gates(infra, n: int):
    import nats

    from bus.jetstream import JetStream
    from gateway.budget_store import BudgetGate

    async def manifests(name, version):
        return MANIFEST if (name, version) == ("m", "1") else None
    conns = [await nats.connect(infra.nats_url) for _ in range(n)]
    gates = [BudgetGate(JetStream(nc), budget_of=lambda t: BUDGET, manifests=manifests) for nc in conns]
    for g in gates:
        await g.open()
    return conns, gates


async def _spend(gate, tenant):
    e = await gate.kv.get(rules.spend_key(tenant))
    return rules.current(e.value if e else None, rules.period_id(BUDGET.period, time.time()), time.time())


async def test_three_gateways_never_overspend_and_return_every_reservation(infra):
    tenant = f"bud-{uuid.uuid4().hex[:8]}"
    conns, gates = await _gates(infra, 3)
    rng = random.Random(11)
    actual: list[int] = []  # micro-USD of every admitted request
    refused = 0
    violations: list[tuple[int, int]] = []
    reads: list[int] = []
    stop = asyncio.Event()

    async def monitor():
        while not stop.is_set():
            v = await _spend(gates[0], tenant)
            reads.append(1)
            if v["s"] + rules.reserved(v) > BUDGET.micro_usd:
                violations.append((v["s"], rules.reserved(v)))
            await asyncio.sleep(0.005)

    async def worker(g, w):
        """Send requests one after another until the budget refuses for good (spent, not reserved)."""
        nonlocal refused
        for i in range(1000):
            rid = f"w{w}q{i}{uuid.uuid4().hex[:6]}"
            headers: dict = {}
            try:
                hold = await g.reserve(tenant, BUDGET, "completions", dict(BODY), rid, 10_000, "m", "1", MANIFEST,
                                       headers)
            except ApiError as e:
                assert e.status == 429 and e.code == "budget_exhausted", e
                refused += 1
                if e.retry_after == 1.0:  # requests in flight hold the rest: retry soon
                    await asyncio.sleep(0.005)
                    continue
                return  # spent + this request's worst case > budget: done
            assert hold.amount == 1800 and float(headers["x-actorserve-budget-remaining-usd"]) >= 0
            await asyncio.sleep(rng.random() * 0.01)  # the request runs
            completion = rng.randint(1, 5)
            rec = CompletionRecord(rid, tenant, "m", "1", "ok", "stop", 3, completion, {}, worker_id="w",
                                   ts=time.time())
            await gates[rng.randrange(3)].settle(rec)  # the meter of any gateway settles it
            actual.append(300 + 200 * completion)
            await g.end(hold)

    try:
        mon = asyncio.create_task(monitor())
        t0 = time.monotonic()
        await asyncio.gather(*(worker(gates[w % 3], w) for w in range(24)))  # 8 concurrent per gateway
        wall = time.monotonic() - t0
        stop.set()
        await mon
        v = await _spend(gates[1], tenant)
        print(f"3 gates x 8 concurrent: {len(actual)} admitted, {refused} refused (budget_exhausted) in {wall:.2f} s; "
              f"spent {v['s']} of {BUDGET.micro_usd} micro-USD, reserved {rules.reserved(v)}, "
              f"{len(violations)} overspend observations in {len(reads)} monitor reads")
        assert not violations, violations[:5]
        assert v["s"] == sum(actual) <= BUDGET.micro_usd  # exact actual cost, never above the budget
        assert rules.reserved(v) == 0 and v["r"] == {}  # every unspent reservation returned
        assert BUDGET.micro_usd - v["s"] < 1800  # refused for good only once a worst case no longer fits
    finally:
        for nc in conns:
            await nc.close()


async def test_n_choices_settled_by_different_gateways_and_a_dead_gateways_hold_lapses(infra):
    tenant = f"bud-{uuid.uuid4().hex[:8]}"
    conns, gates = await _gates(infra, 3)
    try:
        body = {**BODY, "n": 3}
        hold = await gates[0].reserve(tenant, BUDGET, "completions", body, "multi", 10_000, "m", "1", MANIFEST, {})
        assert hold.amount == 800 + 3 * 5 * 200  # prompt once, 3 x max_tokens
        for i in range(3):  # choices <id>-0..2, each metered by another gateway
            rec = CompletionRecord(f"multi-{i}", tenant, "m", "1", "ok", "stop", 3, 2, {}, worker_id="w",
                                   choice_index=i)
            await gates[i].settle(rec)
            if i < 2:
                await gates[i].settle(rec)  # redelivered: no double charge while the request is open
        v = await _spend(gates[2], tenant)
        assert v["s"] == 300 + 3 * 400 and rules.reserved(v) == 0 and v["r"] == {}
        # a gateway that reserved and died: its reservation lapses after deadline + EXPIRY_MARGIN_S
        past = time.time() - rules.EXPIRY_MARGIN_S - 2
        await gates[1].reserve(tenant, BUDGET, "completions", dict(BODY), "dead", 1000, "m", "1", MANIFEST, {},
                               now=past)
        v = await _spend(gates[0], tenant)
        assert "dead" not in v["r"] and rules.reserved(v) == 0
        # its late completion record is charged, but only up to the room left
        await gates[0].settle(CompletionRecord("dead", tenant, "m", "1", "ok", "stop", 3, 5, {}, worker_id="w"))
        assert (await _spend(gates[0], tenant))["s"] == 1500 + 1300
    finally:
        for nc in conns:
            await nc.close()


async def test_unreachable_store_refuses(infra):
    from bus.kv import MemoryBuckets
    from gateway.budget_store import BudgetGate

    async def manifests(name, version):
        return MANIFEST

    gate = BudgetGate(MemoryBuckets(), budget_of=lambda t: BUDGET, manifests=manifests)
    await gate.open()

    class Broken:
        async def update(self, *a, **k):
            raise TimeoutError("nats away")
    gate.kv = Broken()
    with pytest.raises(ApiError) as ei:
        await gate.reserve("t", BUDGET, "completions", dict(BODY), "r", 1000, "m", "1", MANIFEST, {})
    assert ei.value.status == 503 and ei.value.code == "budget_unavailable"


def _verb(infra, *argv: str) -> int:
    """Run one CLI verb in this process (no interpreter start-up): its exit status."""
    from control.ops.cli import build_parser

    args = build_parser().parse_args([*argv, "--etcd", infra.etcd_url, "--nats", infra.nats_url])
    return args.func(args)


async def test_price_budget_and_usage_verbs(infra, registry, capsys):
    from control.state import names
    from control.state.tenants import TenantAdmin

    model = f"bm{uuid.uuid4().hex[:6]}"
    key = names.model_version_key(model, "1")
    assert await registry.put_json_if_rev(key, {"name": model, "version": "1", "artifact": "/x", "format": "gguf"}, 0)
    assert await asyncio.to_thread(_verb, infra, "models", "price", f"{model}@1", "--prompt-per-1m", "1") == 2
    assert "--prompt-per-1m and --completion-per-1m come together" in capsys.readouterr().err
    assert await asyncio.to_thread(_verb, infra, "models", "price", f"{model}@1", "--prompt-per-1m", "0.15",
                                   "--completion-per-1m", "0.6") == 0
    assert (await registry.get_json_rev(key))[0]["pricing"] == {"prompt_per_1m": 0.15, "completion_per_1m": 0.6}
    assert await asyncio.to_thread(_verb, infra, "models", "price", f"{model}@1", "--clear") == 0
    assert "pricing" not in (await registry.get_json_rev(key))[0]
    assert await asyncio.to_thread(_verb, infra, "models", "price", "nosuch@1", "--clear") == 1
    tenant = f"bt{uuid.uuid4().hex[:6]}"
    await TenantAdmin(registry).create(tenant, with_key=False)
    assert await asyncio.to_thread(_verb, infra, "tenants", "budget", tenant, "--usd", "2.5", "--period", "day") == 0
    assert (await TenantAdmin(registry).get(tenant)).budget == Budget(2.5, "day")
    capsys.readouterr()
    assert await asyncio.to_thread(_verb, infra, "usage", "--tenant", tenant, "--json") == 0
    import json
    rep = json.loads(capsys.readouterr().out)
    assert rep[0]["tenant"] == tenant and rep[0]["cost"]["budget"]["budget_usd"] == 2.5
    assert rep[0]["cost"]["budget"]["period"] == "day" and rep[0]["data"] == []
    assert await asyncio.to_thread(_verb, infra, "tenants", "budget", tenant, "--clear") == 0
    assert (await TenantAdmin(registry).get(tenant)).budget is None
    assert await asyncio.to_thread(_verb, infra, "tenants", "budget", tenant) != 0  # neither --usd nor --clear
