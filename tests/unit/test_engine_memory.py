"""The bytes an engine holds (actors/worker/engine/memory.py): weights counted once per storage, and a memory
budget that gives the KV cache what the weights leave."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.memory import MIN_KV_BYTES, kv_bytes_for_budget, tensor_bytes
from tests.engine_fixtures import write_tiny_llama_gguf


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(10, 10)  # 400 bytes
    tied = SimpleNamespace(embed=a, lm_head=a[:5], layers=[SimpleNamespace(w=torch.zeros(4, dtype=torch.int8))])
    assert tensor_bytes(tied) == 400 + 4
    assert tensor_bytes({"x": [torch.zeros(2, dtype=torch.bfloat16)], "n": 3}) == 4


def test_a_budget_below_the_weights_names_both_figures():
    assert kv_bytes_for_budget(10 * MIN_KV_BYTES, MIN_KV_BYTES) == 9 * MIN_KV_BYTES
    with pytest.raises(ValueError, match=r"memory_budget_bytes 100 is too small: the loaded weights take 1000 bytes"):
        kv_bytes_for_budget(100, 1000)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        EngineConfig(model_path="x", memory_budget_bytes=-1)


def test_the_kv_cache_gets_what_the_weights_leave_of_the_budget(tmp_path):
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    plain = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20))
    assert plain.weights_bytes > 0 and plain.kv.num_bytes <= 2 * 2**20
    budget = plain.weights_bytes + 8 * 2**20
    eng = LLMEngine(EngineConfig(model_path=path, dtype="float32", memory_budget_bytes=budget))
    assert eng.weights_bytes == plain.weights_bytes
    held = eng.weights_bytes + eng.lora_reserve_bytes + eng.kv.num_bytes  # LoRA slots are reserved out of the budget
    assert eng.lora_reserve_bytes > 0 and budget - eng.kv.block_bytes < held <= budget
    no_lora = LLMEngine(EngineConfig(model_path=path, dtype="float32", memory_budget_bytes=budget, max_loras=0))
    assert no_lora.lora_reserve_bytes == 0 and no_lora.kv.num_bytes == eng.kv.num_bytes + eng.lora_reserve_bytes
    assert eng.max_model_len <= eng.kv.capacity_tokens
    with pytest.raises(ValueError, match="too small"):
        LLMEngine(EngineConfig(model_path=path, dtype="float32", memory_budget_bytes=plain.weights_bytes))


def _greedy(engine: LLMEngine, rid: str, prompt: list[int], n: int = 6) -> list[int]:
    from actors.worker.engine.types import EngineRequest
    from bus.messages import SamplingParams
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    return out


def test_an_engine_sharing_weights_holds_no_copy_and_decodes_the_same(tmp_path):
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    first = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20, max_loras=0))
    second = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=1 * 2**20, max_loras=0),
                       share_weights_of=first)
    assert second.model is first.model and second.weights_shared and not first.weights_shared
    assert second.kv.tensor.data_ptr() != first.kv.tensor.data_ptr() and second.kv.num_bytes <= 2**20
    assert tensor_bytes([first.model, second.model]) == first.weights_bytes  # one copy for both
    prompt = [5, 6, 7, 8, 9, 10]
    assert _greedy(first, "a", prompt) == _greedy(second, "b", prompt)
    other = write_tiny_llama_gguf(str(tmp_path / "other.gguf"), seed=1)
    with pytest.raises(ValueError, match="share_weights_of"):
        LLMEngine(EngineConfig(model_path=other, dtype="float32", max_loras=0), share_weights_of=first)


def test_resize_kv_only_when_idle_and_decoding_goes_on(tmp_path):
    from actors.worker.engine.types import EngineRequest
    from bus.messages import SamplingParams
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    eng = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20, max_loras=0))
    before = _greedy(eng, "a", [5, 6, 7])
    eng.add_request(EngineRequest("held", [5, 6], SamplingParams(max_tokens=50)))
    with pytest.raises(RuntimeError, match="idle"):
        eng.resize_kv(2**20)
    eng.abort_request("held")
    while eng.has_unfinished():
        eng.step()
    eng.resize_kv(2**20)
    assert eng.kv.num_bytes <= 2**20 and eng.stats().num_total_blocks == eng.kv.num_blocks
    assert eng.max_model_len <= eng.kv.capacity_tokens
    assert _greedy(eng, "b", [5, 6, 7]) == before
