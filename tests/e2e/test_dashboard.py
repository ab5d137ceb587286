"""The operator dashboard in a real browser, and the Grafana dashboard's metric names, on the session stack.

* Headless Debian Chromium (``/usr/bin/chromium``, driven by the ``playwright`` package; never ``playwright
  install``) opens ``/dashboard``, gets the login form, logs in with the operator token
  (``<state-dir>/operator-token``), sees the model version with its worker; after a few requests the page's
  request count and tokens rise on their own (it refreshes every second) and the "data taken" time moves. A
  screenshot is kept: pytest's tmp dir and ``test-artifacts/dashboard.png`` (repo root, git-ignored).
* deploy/grafana/actorserve.json: every metric its PromQL names is served by the live gateway (operator
  token), scheduler or worker ``/metrics`` (their endpoints registered in etcd).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from actors.autoscaler.decisions import Decision, DecisionLog
from control.state.names import all_metrics_prefix, autoscaler_decisions_key
from control.state.registry import Registry

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACT = ROOT / "test-artifacts" / "dashboard.png"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
N_REQUESTS = 3
METRIC = re.compile(r"\b((?:actorserve|process)_[a-z0-9_]+)")


def _playwright_or_skip():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (Debian's chromium: `make browser` installs it with apt-get)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip("the python package playwright is not installed (pip install -e '.[test]')")
    return async_playwright


async def _chat(client: httpx.AsyncClient, sup, i: int, max_tokens: int = 2) -> None:
    body = {"model": "smollm2-135m-instruct", "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"dashboard check {i}: count to ten"}]}
    r = await client.post(sup.http_url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {sup.dev_api_key}"})
    assert r.status_code == 200, r.text


async def _field(page, name: str) -> str:
    return (await page.locator(f'section[data-model] [data-field="{name}"]').first.text_content()) or ""


async def _wait_for(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = await fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def test_dashboard_in_headless_chromium(stack, tmp_path):
    async_playwright = _playwright_or_skip()
    token = (stack.state_dir / "operator-token").read_text().strip()
    t0 = time.monotonic()
    # a decision as the autoscaler writes it (this stack runs none); only the history key, which nothing acts on
    reason = "dashboard test: queue 120 tokens > 2 s of capacity"
    log = DecisionLog(decisions=[Decision(time.time(), "pool", "worker/smollm2-135m-instruct/1/local", 1, 2, reason,
                                          {"queue_tokens": 120})])
    async with Registry.connect(stack.etcd_url) as reg:
        await reg.put_json(autoscaler_decisions_key(), log.to_json())
    try:
        await _browse(async_playwright, stack, token, tmp_path, t0, reason)
    finally:
        async with Registry.connect(stack.etcd_url) as reg:
            await reg.delete(autoscaler_decisions_key())


async def _browse(async_playwright, stack, token: str, tmp_path, t0: float, reason: str) -> None:
    async with async_playwright() as pw, httpx.AsyncClient() as client:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1360, "height": 1000})
            resp = await page.goto(stack.http_url + "/dashboard")
            assert resp.status == 401  # no session yet: the page shows its login form
            await page.locator("#login").wait_for(state="visible", timeout=5000)
            await page.fill("#token", token)
            async with page.expect_navigation():
                await page.click("#login-button")
            await page.locator("section[data-model]").first.wait_for(timeout=10000)
            assert "serving" in (await page.locator("section[data-model] table").first.text_content())
            before = int((await _field(page, "requests_60s")).split("/")[0])
            taken0 = await page.locator("#taken-at").get_attribute("data-ts")
            t_login = time.monotonic() - t0
            await asyncio.gather(*(_chat(client, stack, i) for i in range(N_REQUESTS)))

            async def updated():  # a 60-s window: requests of an earlier test may age out meanwhile, so
                n = int((await _field(page, "requests_60s")).split("/")[0])  # ours alone are the floor
                return n >= N_REQUESTS and n  # with the dev tenant shown below: our requests were counted
            t_sent = time.monotonic() - t0
            after = await _wait_for(updated, 10.0, "the request count to rise on the page")
            t_seen = time.monotonic() - t0
            taken1 = await page.locator("#taken-at").get_attribute("data-ts")
            assert float(taken1) > float(taken0)
            tps = await _field(page, "generation_tokens_per_s")
            assert float(tps) > 0, tps
            async def dev_shown():  # the tenant panel follows the scheduler's ~1 Hz load report
                return "dev" in (await page.locator("section[data-model]").first.text_content() or "")
            await _wait_for(dev_shown, 10.0, "the dev tenant in the tenant panel")
            assert reason in (await page.locator("#decisions").text_content())
            await page.wait_for_timeout(1100)  # one more refresh: sparklines with the new points
            shot = tmp_path / "dashboard.png"
            await page.screenshot(path=str(shot), full_page=True)
        finally:
            await browser.close()
    ARTIFACT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)
    print(f"\ndashboard: requests {before} -> {after}, {tps} generated tok/s; logged in {t_login:.1f} s, "
          f"requests done {t_sent:.1f} s, on the page {t_seen:.1f} s, all {time.monotonic() - t0:.1f} s; "
          f"screenshot {ARTIFACT}")


async def test_grafana_dashboard_names_only_live_metrics(stack):
    dash = json.loads((ROOT / "deploy" / "grafana" / "actorserve.json").read_text())
    wanted = {n for p in dash["panels"] for t in p.get("targets", []) for n in METRIC.findall(t["expr"])}
    token = (stack.state_dir / "operator-token").read_text().strip()
    async with httpx.AsyncClient() as client:
        await _chat(client, stack, 99, max_tokens=3)  # request histograms and tenant shares exist
        async with Registry.connect(stack.etcd_url) as reg:
            urls = [i["url"] for i in (await reg.get_prefix_json(all_metrics_prefix())).values()
                    if i.get("kind") in ("gateway", "scheduler", "worker")]
        assert len(urls) >= 3, urls
        texts = [(await client.get(stack.http_url + "/metrics", headers={"Authorization": f"Bearer {token}"})).text]
        texts += [(await client.get(u, timeout=5)).text for u in urls]
    served = {ln.split("{")[0].split(" ")[0] for t in texts for ln in t.splitlines() if ln and ln[0] != "#"}
    missing = sorted(n for n in wanted if n not in served)
    assert not missing, f"Grafana dashboard names metrics no live /metrics serves: {missing}"
    assert any(n.startswith("vllm:") for n in served)  # the vLLM-named aliases are live too
