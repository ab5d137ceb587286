"""Multi-version worker hosts end to end (issue [11] item 1; actors/worker/host.py): ``up --workers 1
--multi-model`` (real nats-server, etcd, supervisor, schedulers, gateway), tiny random-weight models.

* A second version of the same artifact, registered live, is loaded into the one worker process on demand
  (no new process), shares its weights (one copy in the host's bytes), and retiring it frees its bytes.
* With a budget that holds one of two models with distinct artifacts, alternating traffic makes the host evict
  and load again: every request succeeds, and the host counts the evictions.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from control.state.registry import Registry
from tests.e2e.helpers import tiny_deployment
from tests.e2e.test_registry_live import alive, cli

ENGINE = ["--no-progress", "--dtype", "float32", "--quantization", "none", "--max-loras", "0", "--no-warmup"]


def chat(sup, model: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(sup.http_url + "/v1/chat/completions", timeout=timeout,
                      headers={"Authorization": f"Bearer {sup.dev_api_key}"},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def host_record(sup) -> dict:
    async def read():
        async with Registry.connect(sup.etcd_url) as reg:
            return await reg.list_hosts()
    records = list(asyncio.run(read()).values())
    assert len(records) == 1, records
    return records[0]


def served_within(sup, model: str, seconds: float = 90) -> httpx.Response:
    t_end = time.monotonic() + seconds
    while True:
        r = chat(sup, model)
        if r.status_code == 200:
            return r
        assert time.monotonic() < t_end, f"{model} not served within {seconds:.0f} s: {r.status_code} {r.text}"
        time.sleep(0.3)


def test_a_second_version_is_hosted_by_the_same_process_sharing_weights(tmp_path, tiny_gguf):
    args = {"worker": ENGINE + ["--kv-floor-bytes", str(2**20), "--memory-budget-bytes", str(64 * 2**20)]}
    with tiny_deployment(tmp_path / "state", tiny_gguf, args, multi_model=True) as sup:
        pids = json.loads((sup.state_dir / "pids.json").read_text())
        worker_pid = pids["worker-0"]
        assert chat(sup, "tiny").status_code == 200
        one = host_record(sup)
        assert [r["model"] for r in one["resident"]] == ["tiny@1"] and one["pid"] == worker_pid
        weights = one["resident"][0]["weights_bytes"]
        assert weights > 0

        assert cli(sup, "models", "register", "tiny", "2", "--artifact", tiny_gguf).returncode == 0
        assert served_within(sup, "tiny@2").json()["model"] == "tiny@2"
        two = host_record(sup)
        rows = {r["model"]: r for r in two["resident"]}
        assert set(rows) == {"tiny@1", "tiny@2"} and two["pid"] == worker_pid
        assert rows["tiny@2"]["shared"] and rows["tiny@2"]["weights_bytes"] == weights
        # one copy of the weights: what the host holds is the weights once plus both KV caches
        assert two["held_bytes"] == weights + rows["tiny@1"]["kv_bytes"] + rows["tiny@2"]["kv_bytes"]
        assert two["held_bytes"] <= two["budget_bytes"]
        recorded = json.loads((sup.state_dir / "pids.json").read_text())
        assert not any(k.startswith("worker-tiny-2") for k in recorded)  # no process of its own
        assert "scheduler-tiny-2" in recorded and alive(worker_pid)

        assert cli(sup, "models", "retire", "tiny", "2").returncode == 0
        t_end = time.monotonic() + 30
        while any(r["model"] == "tiny@2" for r in host_record(sup)["resident"]):
            assert time.monotonic() < t_end, "tiny@2 still resident 30 s after its retirement"
            time.sleep(0.3)
        gone = host_record(sup)
        assert gone["held_bytes"] == weights + rows["tiny@1"]["kv_bytes"] or gone["held_bytes"] < two["held_bytes"]
        assert chat(sup, "tiny").status_code == 200


def test_alternating_traffic_over_a_budget_for_one_evicts_and_reloads_without_failures(tmp_path, tiny_gguf):
    from tests.engine_fixtures import write_tiny_llama_gguf

    other = write_tiny_llama_gguf(str(tmp_path / "other.gguf"), seed=7)
    floor = 4 * 2**20  # the KV floor dominates: a tiny model's weights are about 0.4 MiB
    budget = 2**20 + floor + floor // 2  # one model's weights and KV, never two
    args = {"worker": ENGINE + ["--kv-floor-bytes", str(floor), "--memory-budget-bytes", str(budget)]}
    with tiny_deployment(tmp_path / "state", tiny_gguf, args, multi_model=True) as sup:
        weights = host_record(sup)["resident"][0]["weights_bytes"]
        assert 2 * (weights + floor) > budget >= weights + floor, (weights, budget)
        p = cli(sup, "models", "register", "other", "1", "--artifact", other)
        assert p.returncode == 0, p.stderr
        served_within(sup, "other")  # the gateway and the dev tenant know it; the host evicted tiny@1 for it
        statuses = []
        for i in range(6):
            model = "tiny" if i % 2 == 0 else "other"
            r = chat(sup, model, timeout=120)
            statuses.append((model, r.status_code, r.text[:200]))
        assert all(code == 200 for _, code, _ in statuses), statuses
        rec = host_record(sup)
        assert rec["evictions"] >= 6 and rec["loads"] >= 7, rec
        assert rec["failed_loads"] == 0 and rec["forced_evictions"] == 0 and len(rec["resident"]) == 1
        assert rec["held_bytes"] <= rec["budget_bytes"]

        # a version no host can hold: its queued request ends at once with 503 + Retry-After, named
        big = write_tiny_llama_gguf(str(tmp_path / "big.gguf"), seed=9)  # never loaded: its manifest's need counts
        p = cli(sup, "models", "register", "big", "1", "--artifact", big, "--memory-bytes", str(64 * 2**20))
        assert p.returncode == 0, p.stderr
        t_end = time.monotonic() + 60
        while (r := chat(sup, "big")).status_code == 404:  # until the gateway and the dev tenant know it
            assert time.monotonic() < t_end, r.text
            time.sleep(0.3)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_resident", r.text
        assert "budget" in r.json()["error"]["message"] and float(r.headers["retry-after"]) >= 1



def put_sleep(sup, worker_id: str, want: str) -> None:
    from control.state.names import sleep_key

    async def put():
        async with Registry.connect(sup.etcd_url) as reg:
            await reg.put_json(sleep_key(worker_id), {"want": want, "by": "test", "ts": time.time()})
    asyncio.run(put())


def rows_when(sup, check, what: str, seconds: float = 30) -> dict:
    t_end = time.monotonic() + seconds
    while True:
        rec = host_record(sup)
        rows = {r["model"]: r for r in rec["resident"]}
        if check(rows):
            return rec
        assert time.monotonic() < t_end, f"{what}: not within {seconds:.0f} s: {rec}"
        time.sleep(0.2)


def test_a_sleeping_versions_memory_is_lent_to_another_versions_load_and_handed_back(tmp_path, tiny_gguf):
    """Issue [28] on a host: tiny@1 sleeps (its KV cache freed, weights kept); other@1, which would not fit beside
    an awake tiny@1, loads into the room; a request for tiny@1 wakes it and other@1 sleeps to hand the room back;
    alternating requests swap them again. Nothing is evicted or reloaded, and no request fails."""
    from tests.engine_fixtures import write_tiny_llama_gguf

    other = write_tiny_llama_gguf(str(tmp_path / "other.gguf"), seed=7)
    floor = 4 * 2**20
    budget = 2**20 + floor + floor // 2  # both weights and one KV cache; never two KV caches
    args = {"worker": ENGINE + ["--kv-floor-bytes", str(floor), "--kv-cache-bytes", str(floor),
                                "--memory-budget-bytes", str(budget)]}
    with tiny_deployment(tmp_path / "state", tiny_gguf, args, multi_model=True) as sup:
        assert chat(sup, "tiny").status_code == 200
        one = host_record(sup)
        row = one["resident"][0]
        weights, kv = row["weights_bytes"], row["kv_bytes"]
        assert kv >= floor and 2 * weights + kv <= budget < 2 * (weights + floor), (weights, kv, budget)

        put_sleep(sup, row["worker_id"], "sleep")
        asleep = rows_when(sup, lambda r: r["tiny@1"]["state"] == "sleeping", "tiny@1 asleep")
        assert asleep["held_bytes"] <= one["held_bytes"] - kv + 2**16, (one, asleep)  # the KV cache was freed
        assert asleep["resident"][0]["weights_bytes"] == weights  # the weights were kept

        assert cli(sup, "models", "register", "other", "1", "--artifact", other).returncode == 0
        assert served_within(sup, "other").status_code == 200  # loaded into tiny@1's room
        lent = rows_when(sup, lambda r: set(r) == {"tiny@1", "other@1"}, "other@1 beside the sleeper")
        rows = {r["model"]: r for r in lent["resident"]}
        assert rows["tiny@1"]["state"] == "sleeping" and rows["other@1"]["kv_bytes"] >= floor
        assert lent["evictions"] == 0 and lent["held_bytes"] <= budget

        statuses = []
        for model in ("tiny", "other", "tiny", "other", "tiny"):
            r = chat(sup, model, timeout=120)
            statuses.append((model, r.status_code, r.text[:200]))
        assert all(code == 200 for _, code, _ in statuses), statuses
        back = rows_when(sup, lambda r: r["tiny@1"]["state"] == "serving", "tiny@1 awake")
        rows = {r["model"]: r for r in back["resident"]}
        assert rows["other@1"]["state"] == "sleeping" and rows["tiny@1"]["kv_bytes"] >= floor, back
        assert back["handbacks"] >= 3 and back["wakes"] >= 3, back  # each swap: one sleeps, the other wakes
        assert back["evictions"] == 0 and back["loads"] == 2 and back["failed_loads"] == 0, back
        assert back["held_bytes"] <= budget
