"""Metrics end to end (issue #8 item 2): a real stack with the tiny model.

~30 streamed requests of varied prompt and output lengths (3 at a time, so some queue) are timed by the
client (send -> first SSE event); then the gateway's public ``/metrics`` must hold a non-degenerate
``actorserve_time_to_first_token_seconds`` histogram (one observation per request, spread over >= 2
buckets) whose mean is within 30 % or 50 ms of the client's mean TTFT, and the request-level histograms
from completion records. Every actor's own ``/metrics`` is registered (leased) in etcd and answers with
``actorserve_*`` metrics; the worker exports its KV cache usage.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from control.state.names import all_metrics_prefix
from control.state.registry import Registry
from tests.e2e.helpers import tiny_deployment

N_REQUESTS = 30
CONCURRENCY = 3
KINDS = {"gateway", "validator", "scheduler", "worker", "jobs", "rollout"}


def families(text: str) -> dict:
    """``{family name: Metric}`` of a Prometheus text exposition."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def histogram(fams: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative ``[(le, count)]`` summed over label sets, total count, total sum) of histogram ``name``."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for s in fams[name].samples:
        if s.name == name + "_bucket":
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
        elif s.name == name + "_count":
            count += s.value
        elif s.name == name + "_sum":
            total += s.value
    return sorted(buckets.items()), count, total


async def streamed(client: httpx.AsyncClient, url: str, headers: dict, i: int, rng: random.Random) -> float:
    """Client TTFT (s) of one streamed chat request: send -> first ``data:`` event; reads it to the end."""
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.choice((1, 8, 24, 48, 72))))
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"{i}: {words}"}], "stream": True,
            "max_tokens": rng.choice((2, 8, 24, 48)), "ignore_eos": True}
    t0 = time.monotonic()
    ttft = None
    async with client.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:") and ttft is None:
                ttft = time.monotonic() - t0
            if line.strip() == "data: [DONE]":
                break
    assert ttft is not None
    return ttft


async def registered_endpoints(etcd_url: str, timeout: float = 20.0) -> dict:
    """``{kind: [info]}`` of ``/actorserve/metrics/`` once every kind is there (or the timeout)."""
    deadline = time.monotonic() + timeout
    async with Registry.connect(etcd_url) as reg:
        while True:
            by_kind: dict = {}
            for info in (await reg.get_prefix_json(all_metrics_prefix())).values():
                by_kind.setdefault(info["kind"], []).append(info)
            if KINDS <= set(by_kind) or time.monotonic() > deadline:
                return by_kind
            await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def metrics_stack(tmp_path_factory, tiny_gguf):
    with tiny_deployment(tmp_path_factory.mktemp("metrics"), tiny_gguf, {
            "worker": ["--kv-cache-bytes", "8000000", "--max-num-seqs", "4", "--no-progress"]}) as sup:
        yield sup


async def test_gateway_ttft_histogram_matches_client(metrics_stack):
    sup = metrics_stack
    headers = {"Authorization": f"Bearer {sup.dev_api_key}"}
    rng = random.Random(8)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient() as client:
        async def one(i: int) -> float:
            async with sem:
                return await streamed(client, sup.http_url + "/v1/chat/completions", headers, i, rng)
        client_ttfts = await asyncio.gather(*(one(i) for i in range(N_REQUESTS)))

        # the public /metrics needs the operator token (<state-dir>/operator-token), not an API key
        operator = {"Authorization": "Bearer " + (sup.state_dir / "operator-token").read_text().strip()}
        for refused in ({}, headers):
            r = await client.get(sup.http_url + "/metrics", headers=refused)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_operator_token", r.text
        # completion records reach the gateway just after the last chunk: wait for all of them
        for _ in range(50):
            fams = families((await client.get(sup.http_url + "/metrics", headers=operator)).text)
            _, n_e2e, _ = histogram(fams, "actorserve_e2e_request_latency_seconds") \
                if "actorserve_e2e_request_latency_seconds" in fams else ([], 0, 0)
            # worker gauges come from the workers' stats messages (every stats interval): wait for one too
            if n_e2e >= N_REQUESTS and "actorserve_kv_cache_usage_perc" in fams:
                break
            await asyncio.sleep(0.2)

    buckets, count, total = histogram(fams, "actorserve_time_to_first_token_seconds")
    per_bucket = [c - p for (_, c), (_, p) in zip(buckets, [(0.0, 0.0)] + buckets[:-1])]
    client_mean = sum(client_ttfts) / len(client_ttfts)
    gw_mean = total / count
    print(f"\nTTFT client mean {client_mean * 1e3:.1f} ms (min {min(client_ttfts) * 1e3:.1f}, "
          f"max {max(client_ttfts) * 1e3:.1f}); gateway histogram mean {gw_mean * 1e3:.1f} ms, count {count:.0f}, "
          f"non-empty buckets {sum(1 for c in per_bucket if c > 0)}: "
          + ", ".join(f"le={le:g}:{c:.0f}" for (le, _), c in zip(buckets, per_bucket) if c))
    assert count == N_REQUESTS
    assert sum(1 for c in per_bucket if c > 0) >= 2, buckets
    assert abs(gw_mean - client_mean) <= max(0.3 * client_mean, 0.050), (gw_mean, client_mean)

    # request-level histograms and counters from completion records, labelled by model and tenant
    for name in ("actorserve_e2e_request_latency_seconds", "actorserve_request_queue_time_seconds",
                 "actorserve_request_prefill_time_seconds", "actorserve_request_decode_time_seconds",
                 "actorserve_inter_token_latency_seconds"):
        _, n, _ = histogram(fams, name)
        assert n >= N_REQUESTS - 1, (name, n)  # itl: only requests with >= 2 tokens (all here)
    ok = [s for s in fams["actorserve_requests"].samples
          if s.name == "actorserve_requests_total" and s.labels.get("status") == "ok"]
    assert sum(s.value for s in ok) == N_REQUESTS
    assert {s.labels["model"] for s in ok} == {sup.model_ref} and {s.labels["tenant"] for s in ok} == {"dev"}
    gen = sum(s.value for s in fams["actorserve_generation_tokens"].samples if s.name.endswith("_total"))
    assert gen > 0
    assert "actorserve_kv_cache_usage_perc" in fams and "actorserve_event_loop_lag_seconds" in fams


async def test_every_actor_registers_its_metrics_endpoint(metrics_stack):
    by_kind = await registered_endpoints(metrics_stack.etcd_url)
    assert KINDS <= set(by_kind), by_kind
    pids = set(metrics_stack.pids.values())
    async with httpx.AsyncClient() as client:
        for kind, infos in sorted(by_kind.items()):
            for info in infos:
                assert info["url"].startswith("http://127.0.0.1:") and info["pid"] in pids, info
                r = await client.get(info["url"], timeout=5)
                assert r.status_code == 200
                fams = families(r.text)
                assert "actorserve_event_loop_lag_seconds" in fams, (kind, sorted(fams))
                if kind == "worker":
                    kv = [s for s in fams["actorserve_kv_cache_usage_perc"].samples]
                    assert kv and all(0.0 <= s.value <= 1.0 for s in kv), kv
                    assert "actorserve_generation_tokens_per_second" in fams
                    load = {s.labels["phase"]: s.value for s in fams["actorserve_model_load_seconds"].samples}
                    assert {"registry", "artifact_read", "convert", "kernels", "quantize", "warmup",
                            "credits", "register"} <= set(load) and all(v >= 0 for v in load.values()), load
                if kind == "scheduler":
                    assert "actorserve_num_requests_waiting" in fams


async def test_worker_record_and_status_show_the_load_by_phase(metrics_stack):
    """Issue [11] item 3: the worker's etcd record carries its load phases (first_token once it served
    one: the TTFT test above ran first or this one streams a request) and ``actorserve status`` prints them."""
    sup = metrics_stack
    async with httpx.AsyncClient() as client:
        await streamed(client, sup.http_url + "/v1/chat/completions",
                       {"Authorization": f"Bearer {sup.dev_api_key}"}, 0, random.Random(2))
    async with Registry.connect(sup.etcd_url) as reg:
        for _ in range(30):
            workers = await reg.list_workers(*sup.model_ref.split("@"))
            rec = next(iter(workers.values()), {})
            if "first_token" in rec.get("load_phases", {}):
                break
            await asyncio.sleep(0.2)
    phases = rec["load_phases"]
    assert list(phases)[:3] == ["registry", "artifact_read", "convert"] and "first_token" in phases, rec
    assert rec["load_s"] == pytest.approx(sum(v for k, v in phases.items() if k != "first_token"), abs=0.01)
    out = subprocess.run([sys.executable, "-m", "control.ops.cli", "status", "--state-dir", str(sup.state_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "loaded in " in out.stdout and "first token" in out.stdout and "warmup" in out.stdout, out.stdout
    # residency (issue [11] items 1 and 4): bytes of weights and KV per resident version, in all three places
    mem = rec["memory"]
    (row,) = mem["resident"]
    assert row["model"] == sup.model_ref and row["weights_bytes"] > 0 and row["kv_bytes"] > 0, mem
    assert mem["budget_bytes"] >= mem["weights_bytes"] + mem["kv_bytes"] and row["quantization"], mem
    assert f"resident {sup.model_ref} {row['quantization']}" in out.stdout, out.stdout
    (winfo,) = (await registered_endpoints(sup.etcd_url))["worker"]
    async with httpx.AsyncClient() as client:
        fams = families((await client.get(winfo["url"], timeout=5)).text)
    got = {s.labels["kind"]: s.value for s in fams["actorserve_worker_resident_bytes"].samples}
    assert got == {"weights": row["weights_bytes"], "kv": row["kv_bytes"]}, got


async def test_scheduler_exports_tokens_served_per_tenant_and_its_share(metrics_stack):
    """Issue [17] item 4: the active scheduler's ``/metrics`` counts tokens served per tenant (from the
    workers' heartbeats) and exports the tenant's share of the service next to its weight's share."""
    sup = metrics_stack
    async with httpx.AsyncClient() as client:
        await streamed(client, sup.http_url + "/v1/chat/completions",
                       {"Authorization": f"Bearer {sup.dev_api_key}"}, 0, random.Random(1))
        (info,) = (await registered_endpoints(sup.etcd_url))["scheduler"]
        for _ in range(20):  # a heartbeat (4 Hz) carries the served tokens
            fams = families((await client.get(info["url"], timeout=5)).text)
            fam = fams.get("actorserve_tenant_service_tokens")
            served = {s.labels["kind"]: s.value for s in (fam.samples if fam else [])
                      if s.name.endswith("_total") and s.labels.get("tenant") == "dev"}
            if served.get("completion", 0) > 0:
                break
            await asyncio.sleep(0.25)
    assert served.get("prompt", 0) > 0 and served.get("completion", 0) > 0, served
    share = {s.labels["tenant"]: s.value for s in fams["actorserve_tenant_service_share"].samples}
    due = {s.labels["tenant"]: s.value for s in fams["actorserve_tenant_weight_share"].samples}
    assert share == {"dev": 1.0} and due == {"dev": 1.0}, (share, due)
