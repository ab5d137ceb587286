"""actors/worker/load_phases.py: phase book-keeping of a model load (pure) and the engine's warm-up pass."""

from __future__ import annotations

import pytest

from actors.worker.load_phases import PHASES, LoadTimeline, describe


def test_marks_time_each_phase_from_the_previous_one():
    t = LoadTimeline(start=100.0)
    assert t.mark("registry", now=100.5) == 0.5
    t.add_all({"convert": 2.0, "artifact_read": 1.0, "kernels": 0.25}, now=104.0)
    t.mark("warmup", now=104.75)
    t.mark("first_token", now=110.0)
    assert list(t.as_dict()) == ["registry", "artifact_read", "convert", "kernels", "warmup", "first_token"]
    assert t.as_dict()["warmup"] == 0.75 and t.as_dict()["first_token"] == 5.25
    assert t.ready_s == pytest.approx(0.5 + 1.0 + 2.0 + 0.25 + 0.75)  # first_token is not part of the load
    assert t.line().startswith("loaded in 4.50 s: registry 0.50, artifact_read 1.00")


def test_a_phase_marked_twice_accumulates_and_time_never_runs_backwards():
    t = LoadTimeline(start=0.0)
    t.mark("kernels", now=1.0)
    t.mark("kernels", now=1.5)
    assert t.phases["kernels"] == 1.5
    assert t.mark("warmup", now=1.0) == 0.0  # a clock read before the last mark counts as no time


@pytest.mark.parametrize("phase,seconds", [("compile", 1.0), ("warmup", -0.1)])
def test_unknown_phase_or_negative_time_is_refused(phase, seconds):
    with pytest.raises(ValueError, match="load phase"):
        LoadTimeline(start=0.0).add(phase, seconds)


def test_status_line_from_a_worker_record():
    phases = {"registry": 0.91, "artifact_read": 3.02, "warmup": 0.4, "first_token": 1.26}
    line = describe(phases, 4.33)
    assert line == "loaded in 4.3 s (registry 0.9, artifact_read 3.0, warmup 0.4), first token 1.3 s after"
    assert describe({}) == "" and describe(None) == ""
    assert describe({"convert": 2.0}).startswith("loaded in 2.0 s")
    assert set(PHASES) >= set(phases)


def test_warm_up_leaves_no_trace_in_counters_cache_or_outputs(tmp_path):
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from actors.worker.engine.types import EngineRequest, SamplingParams
    from actors.worker.engine.warmup import PREFILL_LENS, warm_up
    from tests.engine_fixtures import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))

    def engine():
        return LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20, max_num_seqs=4))

    def run(eng):
        eng.add_request(EngineRequest("r", tuple(range(1, 41)), SamplingParams(temperature=0.0, max_tokens=6)))
        out = []
        while eng.has_unfinished():
            out += [t for o in eng.step() for t in o.new_token_ids]
        return out

    cold, warm = engine(), engine()
    assert set(cold.load_phases) == {"artifact_read", "convert", "kernels", "quantize"}
    assert warm_up(warm) > 0
    st = warm.stats()
    assert (st.num_steps, st.num_generated_tokens, st.num_prompt_tokens, st.max_batch_size_seen) == (0, 0, 0, 0)
    assert st.num_free_blocks == st.num_total_blocks and not warm.has_unfinished()
    assert st.extra.get("prefix_cache_query_tokens", 0) == 0
    assert warm.rates.prefill_tokens_per_s == 0 and not warm.rates.decode_ms  # cold steps: not measurements
    assert run(warm) == run(cold)  # same greedy tokens: nothing of the warm-up leaked into the request
    assert warm.stats().extra["prefix_cache_hit_tokens"] == 0  # the warm-up prompts (the same first tokens) were forgotten
    assert len(PREFILL_LENS) <= 4  # one batch within max_num_seqs


def test_converted_weights_cache_round_trip(tmp_path, monkeypatch):
    """A second load of the same artifact reads the cache (no GGUF parse) and gives the same logits; a
    corrupt cache file is removed and the GGUF read again; the folder is trimmed to its byte limit."""
    import torch

    from actors.worker.engine import weights_cache as wc
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from tests.engine_fixtures import prefill_logits, write_tiny_llama_gguf

    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    cfg = EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20, weights_cache=True)
    first = LLMEngine(cfg)
    files = list(wc.cache_dir().glob("*.safetensors"))
    assert not first.weights_cached and len(files) == 1
    monkeypatch.setattr("gguf.GGUFReader", lambda *a, **k: (_ for _ in ()).throw(AssertionError("GGUF parsed")))
    second = LLMEngine(cfg)
    assert second.weights_cached and second.quantization == first.quantization
    assert second.token_bytes == first.token_bytes and second.model_config == first.model_config
    prompt = list(range(1, 30))
    torch.testing.assert_close(prefill_logits(second, prompt), prefill_logits(first, prompt), rtol=0, atol=0)
    monkeypatch.undo()
    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(tmp_path / "cache"))
    files[0].write_bytes(b"not a safetensors file")
    third = LLMEngine(cfg)  # unreadable: removed, the GGUF read, the cache written again
    assert not third.weights_cached and wc.cache_dir().joinpath(files[0].name).stat().st_size > 100
    other = wc.cache_dir() / "old.safetensors"
    other.write_bytes(b"x" * 1000)
    import os
    os.utime(other, (1, 1))  # least recently used
    assert wc.trim(wc.cache_dir(), max_bytes=files[0].stat().st_size) == [other]


def test_quantized_packs_are_cached_and_rebuilt_exactly(tmp_path, monkeypatch):
    """float32 + int8 on the native kernels (QuantLinear): the second load takes the packs from the cache
    (no quantization call) and computes the same logits bit for bit."""
    import torch

    from actors.worker.engine import cpu_kernels, quant_blocks
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from tests.engine_fixtures import prefill_logits, write_tiny_llama_gguf

    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler: no native block-quantized kernels")
    monkeypatch.setenv("ACTORSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ACTORSERVE_BLOCK_QUANT", "1")
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    cfg = EngineConfig(model_path=path, dtype="float32", quantization="int8", kv_cache_bytes=2 * 2**20,
                       weights_cache=True)
    first = LLMEngine(cfg)
    assert isinstance(first.model.layers[0].qkv, quant_blocks.QuantLinear)
    monkeypatch.setattr(quant_blocks, "quantize_q8_0", lambda *a: (_ for _ in ()).throw(AssertionError("quantized")))
    second = LLMEngine(cfg)
    assert torch.equal(second.model.layers[0].qkv.packed, first.model.layers[0].qkv.packed)
    prompt = list(range(1, 30))
    torch.testing.assert_close(prefill_logits(second, prompt), prefill_logits(first, prompt), rtol=0, atol=0)
    with pytest.raises(ValueError, match="from_packed"):
        quant_blocks.QuantLinear.from_packed(first.model.layers[0].qkv.packed, 4, 64, None)
