"""Prefix-cache isolation between tenants on the session stack (SmolLM2; issue [11] item 2): the scheduler derives
each request's cache salt from its version and tenant (or the tenant's cache-sharing group), so a tenant's
prompt never hits another tenant's cached blocks; the same prompt within one tenant does (the positive
control), and two tenants an operator put in one group share. Hits are read per tenant from the worker's
``/metrics`` (``actorserve_tenant_prefix_cache_hits``)."""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx

from control.state.names import all_metrics_prefix
from tests.e2e.test_budgets import MODEL, _admin

# ~150 prompt tokens (9 full 16-token blocks), distinct per run so earlier tests' cache entries cannot match
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(120))


def complete(stack, key: str, text: str) -> int:
    """Complete 1 token; the response's ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field)."""
    r = httpx.post(stack.gateway_url(0) + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "prompt": text, "max_tokens": 1, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def tenant_hits(stack) -> dict[str, float]:
    """Prefix-cache hit tokens per tenant, summed over the stack's workers' ``/metrics``."""
    from control.state.registry import Registry

    async def urls() -> list[str]:
        async with Registry.connect(stack.etcd_url) as reg:
            return [i["url"] for i in (await reg.get_prefix_json(all_metrics_prefix())).values()
                    if i.get("kind") == "worker"]
    out: dict[str, float] = {}
    for url in asyncio.run(urls()):
        for line in httpx.get(url, timeout=5).text.splitlines():
            if line.startswith("actorserve_tenant_prefix_cache_hits") and 'tenant="' in line:
                tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                out[tenant] = out.get(tenant, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_hits(stack, tenant: str, at_least: float, timeout: float = 10.0) -> dict[str, float]:
    t_end = time.time() + timeout
    while True:
        hits = tenant_hits(stack)
        if hits.get(tenant, 0.0) >= at_least or time.time() > t_end:
            return hits
        time.sleep(0.3)


def test_no_prefix_hit_across_tenants_unless_they_share_a_group(stack):
    run = uuid.uuid4().hex[:8]
    a, b, c, d = (f"iso-{x}-{run}" for x in "abcd")
    keys = {t: _admin(stack, lambda adm, t=t: adm.create(t, allowed_models=[MODEL]))[2] for t in (a, b, c, d)}
    for t in (c, d):
        _admin(stack, lambda adm, t=t: adm.set_cache_group(t, f"grp-{run}"))
    time.sleep(2.5)  # the scheduler re-reads tenant records every 2 s

    p = prompt(f"isolation {run}")
    cached = [complete(stack, keys[a], p),
              complete(stack, keys[b], p),  # another tenant, same prompt: must miss
              complete(stack, keys[a], p)]  # positive control: a's own prompt hits
    assert cached[0] == cached[1] == 0 and cached[2] >= 16 * 8 and cached[2] % 16 == 0, cached  # the usage field
    hits = wait_hits(stack, a, 16)
    assert hits.get(a, 0.0) >= 16 * 8, hits
    assert hits.get(b, 0.0) == 0.0, hits

    q = prompt(f"group {run}")
    complete(stack, keys[c], q)
    complete(stack, keys[d], q)  # same cache-sharing group: hits c's blocks
    hits = wait_hits(stack, d, 16)
    assert hits.get(d, 0.0) >= 16 * 8, hits
    assert hits.get(c, 0.0) == 0.0 and hits.get(b, 0.0) == 0.0, hits
