"""Spend budgets end to end on the session stack (SmolLM2): a price set by `actorserve models price`, a budget
(TenantAdmin.set_budget, what `actorserve tenants budget` calls); one request fits, is settled from its
completion record, and the next one gets 429 ``budget_exhausted``; `GET /v1/usage` and `actorserve usage`
report the same spend. The CLI verbs run in this process (tests/integration/test_budgets.py covers their
errors)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx

MODEL = "smollm2-135m-instruct"
REF = f"{MODEL}@1"
# 0.1 USD per token: "Hi" + max_tokens 3 reserves (2 bytes + 4) x 0.1 + 3 x 0.1 = 0.9 USD
PRICE = ["--prompt-per-1m", "100000", "--completion-per-1m", "100000"]
BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True, "temperature": 0}


def _cli(stack, capsys, *argv: str) -> tuple[int, str, str]:
    """One CLI verb run in this process against the stack (no interpreter start-up): (status, stdout, stderr)."""
    from control.ops.cli import build_parser

    capsys.readouterr()
    args = build_parser().parse_args([*argv, "--etcd", stack.etcd_url, "--nats", stack.nats_url])
    status = args.func(args)
    out = capsys.readouterr()
    return status, out.out, out.err


def _admin(stack, fn):
    """Run ``await fn(TenantAdmin)`` against the stack's etcd (in-process: no CLI start-up)."""
    from control.state.registry import Registry
    from control.state.tenants import TenantAdmin

    async def go():
        async with Registry.connect(stack.etcd_url) as reg:
            return await fn(TenantAdmin(reg))
    return asyncio.run(go())


def _usage(stack, key: str) -> dict:
    return httpx.get(stack.gateway_url(0) + "/v1/usage", headers={"Authorization": f"Bearer {key}"},
                     timeout=10).json()


def test_budget_exhausted_after_spend_and_cost_report(stack, capsys):
    tenant = f"b-{uuid.uuid4().hex[:8]}"
    _, _, key = _admin(stack, lambda adm: adm.create(tenant, allowed_models=[MODEL]))
    status, out, err = _cli(stack, capsys, "models", "price", REF, *PRICE)
    assert status == 0 and "100000 USD per 1M prompt tokens" in out, err
    try:
        time.sleep(1.5)  # the gateway's model snapshot follows the registry watch (and re-reads every 1 s)
        _admin(stack, lambda adm: adm.set_budget(tenant, 1.2, "month"))
        t_end = time.time() + 10
        while _usage(stack, key)["cost"]["budget"] is None:
            assert time.time() < t_end, "the gateway never saw the budget"
            time.sleep(0.1)
        url = stack.gateway_url(0) + "/v1/completions"
        auth = {"Authorization": f"Bearer {key}"}
        first = httpx.post(url, json=BODY, headers=auth, timeout=60)
        assert first.status_code == 200, first.text
        assert float(first.headers["x-actorserve-budget-remaining-usd"]) <= 1.2 - 0.9 + 1e-9
        t_end = time.time() + 15
        while True:  # settled from the completion record: nothing reserved any more
            rep = _usage(stack, key)
            b = rep["cost"]["budget"]
            if b["spent_usd"] > 0 and b["reserved_usd"] == 0:
                break
            assert time.time() < t_end, rep
            time.sleep(0.1)
        prompt = first.json()["usage"]["prompt_tokens"]
        assert b["spent_usd"] == rep["data"][0]["cost_usd"] == round((prompt + 3) * 0.1, 6) <= 1.2
        second = httpx.post(url, json=BODY, headers=auth, timeout=60)  # 1.2 - spent < 0.9: refused
        err = second.json()["error"]
        assert second.status_code == 429 and err["code"] == "budget_exhausted", second.text
        assert err["type"] == "insufficient_quota" and "month budget" in err["message"]
        assert int(second.headers["Retry-After"]) >= 1
        job = httpx.post(stack.gateway_url(0) + "/v1/jobs", json={"endpoint": "/v1/completions", "body": BODY},
                         headers=auth, timeout=10)
        assert job.status_code == 202, job.text
        t_end = time.time() + 20
        while (rec := httpx.get(stack.gateway_url(0) + f"/v1/jobs/{job.json()['id']}", headers=auth,
                                timeout=10).json())["status"] not in ("completed", "failed"):
            assert time.time() < t_end, rec  # the jobs actor reserves too, and a spent budget fails the job
            time.sleep(0.1)
        assert rec["status"] == "failed" and rec["error"]["status_code"] == 429, rec
        assert rec["error"]["error"]["code"] == "budget_exhausted", rec
        status, out, err = _cli(stack, capsys, "usage", "--tenant", tenant, "--json")
        assert status == 0, err
        cli = json.loads(out)[0]
        assert cli["tenant"] == tenant and cli["cost"]["budget"]["spent_usd"] == b["spent_usd"]
    finally:
        async def clear(adm):
            from control.state import names
            k = names.model_version_key(MODEL, "1")
            for _ in range(20):
                m, rev = await adm.reg.get_json_rev(k)
                if await adm.reg.put_json_if_rev(k, {x: v for x, v in m.items() if x != "pricing"}, rev):
                    break
            await adm.set_budget(tenant, None)
        _admin(stack, clear)
