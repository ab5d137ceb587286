"""Chunked prefill mixed with decodes (tiny GGUF, float32): a 2,048-token prompt prefills in chunks
under ``max_num_batched_tokens`` while running streams keep producing one token every step, and
the chunked prompt's logits equal the unchunked ones within tolerance."""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.engine_fixtures import write_tiny_llama_gguf

# float32; chunks see the same K/V but through a masked cached-prefix path instead of one causal
# call, so only summation order differs (measured ~1e-6 on logits of magnitude ~1).
LOGIT_ATOL = 1e-4
LONG = 2048


@pytest.fixture(scope="module")
def tiny_long_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tinylong") / "tiny.gguf"), context_length=4096)


def make(path, budget):
    return LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=4 * 2**20,
                                  max_num_batched_tokens=budget, enable_prefix_caching=False))


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def long_prompt():
    return tuple((i * 31) % 250 + 3 for i in range(LONG))


def capture(engine, rid):
    got = []
    orig = engine.runner.forward

    def forward(plan):
        out = orig(plan)
        ids = [s.seq_id for s in plan.seqs if s.samples]
        if rid in ids:
            got.append(out[ids.index(rid)].clone())
        return out

    engine.runner.forward = forward
    return got


def test_long_prompt_does_not_stall_running_streams(tiny_long_path):
    engine = make(tiny_long_path, 256)
    for i in range(4):
        engine.add_request(EngineRequest(f"s{i}", tuple(range(3 + i, 13 + i)), greedy(200)))
    engine.step()
    engine.step()
    engine.add_request(EngineRequest("long", long_prompt(), greedy(1)))
    steps = 0
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert all(len(outs[f"s{i}"].new_token_ids) == 1 for i in range(4)), steps  # no stall
        if "long" in outs:
            break
    assert steps >= LONG // 256  # it really was chunked (4 decode tokens share each 256-token step)


def test_chunked_prefill_logits_equal_unchunked(tiny_long_path):
    results = []
    for budget in (256, 4096):
        engine = make(tiny_long_path, budget)
        got = capture(engine, "long")
        engine.add_request(EngineRequest("long", long_prompt(), greedy(1)))
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        results.append((got[0], steps))
    (chunked, n_chunked), (whole, n_whole) = results
    assert n_chunked == LONG // 256 and n_whole == 1
    diff = (chunked - whole).abs().max().item()
    print(f"chunked vs whole: max|diff| {diff:.2e}")
    assert diff <= LOGIT_ATOL
