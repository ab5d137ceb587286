"""Spend budgets live across 3 gateway processes (issue 20 target "never overspent across 3 gateways under
concurrent load, unspent reservations returned"), run by ``make cluster-test`` (collected only with
``ACTORSERVE_CLUSTER=1``). No root needed; the tiny random-weight model.

24 clients (8 per gateway) send priced requests of one tenant until its budget refuses them for good
(``budget_exhausted`` without Retry-After 1); then: spent <= budget, spent = the sum of the admitted
requests' actual costs (from their responses' usage), nothing left reserved, and what is left is less than one
more request's worst case. Prints the figures.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from control.state import names
from control.state.registry import Registry
from control.state.tenants import TenantAdmin
from tests.engine_fixtures import write_tiny_llama_gguf

pytestmark = [pytest.mark.cluster]

MODEL = "tiny"
PRICE_PER_TOKEN = 0.01  # USD (10,000 USD per 1M tokens, prompt and completion alike)
BUDGET_USD = 2.0
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
WORST = (2 + 4 + 4) * PRICE_PER_TOKEN  # (bytes + SPECIAL_SLACK) prompt + max_tokens


@pytest.fixture(scope="module")
def gw3(tmp_path_factory):
    from control.ops.supervisor import Supervisor
    from control.ops.stack_config import StackConfig

    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_llama_gguf(path)
    # watch_registry=False: this test starts and edits nothing but tiny@1's price (no version reconciling needed)
    sup = Supervisor(StackConfig(tmp_path_factory.mktemp("budgets-state"), port=0, gateways=3, supervise=False,
                                 watch_registry=False, model_file=path, model_name=MODEL,
                                 actor_args={"worker": ["--kv-cache-bytes", "8000000", "--no-progress"],
                                 "scheduler": ["--max-queue-per-tenant", "1024"]}))
    sup.start()
    try:
        sup.wait_ready(timeout=120)
        yield sup
    finally:
        sup.stop()


async def _setup(sup, tenant: str) -> str:
    async with Registry.connect(sup.etcd_url) as reg:
        key = names.model_version_key(MODEL, "1")
        for _ in range(20):
            m, rev = await reg.get_json_rev(key)
            price = PRICE_PER_TOKEN * 1e6
            if await reg.put_json_if_rev(key, {**m, "pricing": {"prompt_per_1m": price, "completion_per_1m": price}},
                                         rev):
                break
        adm = TenantAdmin(reg)
        _, _, api_key = await adm.create(tenant, allowed_models=[MODEL])
        await adm.set_budget(tenant, BUDGET_USD, "total")
        return api_key


async def _client(http: httpx.AsyncClient, url: str, auth: dict, costs: list[float], refusals: list[int]) -> None:
    while True:
        r = await http.post(url, json=BODY, headers=auth, timeout=60)
        if r.status_code == 200:
            u = r.json()["usage"]
            costs.append((u["prompt_tokens"] + u["completion_tokens"]) * PRICE_PER_TOKEN)
            continue
        assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exhausted", r.text
        refusals.append(1)
        if r.headers.get("Retry-After") != "1":
            return  # spent + worst case > budget: refused for good
        await asyncio.sleep(0.05)


def test_three_gateways_never_overspend_live(gw3):
    tenant = f"b-{uuid.uuid4().hex[:8]}"
    api_key = asyncio.run(_setup(gw3, tenant))
    auth = {"Authorization": f"Bearer {api_key}"}
    t_end = time.time() + 15
    while httpx.get(gw3.gateway_url(2) + "/v1/usage", headers=auth, timeout=10).json()["cost"]["budget"] is None:
        assert time.time() < t_end
        time.sleep(0.1)
    time.sleep(1.5)  # every gateway's model snapshot has the price

    async def run() -> tuple[list[float], list[int], float]:
        costs: list[float] = []
        refusals: list[int] = []
        t0 = time.monotonic()
        async with httpx.AsyncClient() as http:
            await asyncio.gather(*(_client(http, gw3.gateway_url(i % 3) + "/v1/completions", auth, costs, refusals)
                                   for i in range(24)))
        return costs, refusals, time.monotonic() - t0
    costs, refusals, wall = asyncio.run(run())
    t_end = time.time() + 20
    while True:
        rep = httpx.get(gw3.gateway_url(0) + "/v1/usage", headers=auth, timeout=10).json()
        b = rep["cost"]["budget"]
        if b["reserved_usd"] == 0 and rep["data"] and rep["data"][0]["requests"] == len(costs):
            break
        assert time.time() < t_end, rep
        time.sleep(0.2)
    print(f"3 gateways x 8 clients: {len(costs)} admitted, {len(refusals)} budget_exhausted in {wall:.1f} s; "
          f"spent {b['spent_usd']:.6f} of {BUDGET_USD} USD, reserved {b['reserved_usd']}, "
          f"unbilled {b['unbilled_usd']}")
    assert b["spent_usd"] <= BUDGET_USD
    assert b["spent_usd"] == pytest.approx(sum(costs), abs=1e-9)  # exactly what the admitted requests cost
    assert b["reserved_usd"] == 0 and b["unbilled_usd"] == 0 and b["in_flight"] == 0
    assert BUDGET_USD - b["spent_usd"] < WORST + 1e-9  # the budget was used up to the last worst case
