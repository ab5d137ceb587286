"""Gemma 2 and Gemma 3 text from Hugging Face directories (issue [22] item 1, in part: gemma.py) against transformers
in float32 (its eager attention: SDPA has no soft-cap).

Models: tests/family_models.py ``GEMMA_VARIANTS`` (tiny, random, scaled): two layers, the first with a window of
16 tokens, the second full; Gemma 2 with attention / final soft-caps of 5 / 10 (low enough to bind) and
``query_pre_attn_scalar`` 32 (head_dim 16); Gemma 3 with q/k norms, a local RoPE base (10^4) beside the full
layers' linearly scaled one (10^6, x2). Prompts of 48, 40 and 7 tokens. Negative controls: each feature switched
off in our model moves the logits by more than 100 x LOGIT_ATOL.

Not here (and refused): GGUF files of either (``general.architecture`` gemma2 / gemma3), LoRA adapters; not
measured: a soft-capping kernel (the attention is explicit per sequence, the correct path only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.family_checks import (LOGIT_ATOL, assert_batched_equals_alone, assert_greedy_matches_transformers,
                                 build_models, control_moves, engine_cache, worst_logit_error)
from tests.family_models import GEMMA_VARIANTS, build
from tests.unit.test_engine_families import PROMPTS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(build, GEMMA_VARIANTS, tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="module")
def engines(models):
    """engine(variant): float32 engines of the Hugging Face directories, made once per module."""
    with engine_cache(models) as get:
        yield get


@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_logits_match_transformers(models, engines, variant):
    worst = worst_logit_error(engines(variant), models[variant]["model"], PROMPTS, chunk_at=19)
    print(f"{variant}: max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL


@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_greedy_32_tokens_match_transformers(models, engines, variant):
    assert_greedy_matches_transformers(engines(variant), models[variant]["model"], PROMPTS[0])


@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_batched_equals_alone(engines, variant):
    assert_batched_equals_alone(engines(variant), PROMPTS)


def test_the_torch_path_and_why(engines):
    eng = engines("gemma2")
    assert eng.model.kernels is None and "Gemma" in eng.runner.native_off_reason


def _off(feature: str):
    def change(cfg, weights):
        if feature == "attn_softcap":
            return dataclasses.replace(cfg, attn_softcap=None)
        if feature == "final_softcap":
            return dataclasses.replace(cfg, final_softcap=None)
        if feature == "window":
            return dataclasses.replace(cfg, layer_windows=(0,) * cfg.num_layers)
        if feature == "query_pre_attn_scalar":
            return dataclasses.replace(cfg, query_pre_attn_scalar=float(cfg.head_dim))
        if feature == "local_rope":
            return dataclasses.replace(cfg, rope_local_theta=None)
        raise AssertionError(feature)
    return change


CONTROLS = [("gemma2", f) for f in ("attn_softcap", "final_softcap", "window", "query_pre_attn_scalar")] + \
    [("gemma3", f) for f in ("window", "local_rope", "query_pre_attn_scalar")]


@pytest.mark.parametrize("variant,feature", CONTROLS)
def test_negative_control_switching_a_feature_off_moves_the_logits(models, variant, feature):
    path, prompt = models[variant]["hf"], PROMPTS[0]
    moved = control_moves(path, models[variant]["model"], prompt, _off(feature))
    print(f"{variant} without {feature}: max|dlogit| {moved:.2f}")
    assert moved > 100 * LOGIT_ATOL


def test_gemma_norms_are_offsets(models):
    """The checkpoint's norm weights are w in ``1 + w`` (folded at load): read as Llama's plain w, the logits
    move."""
    from actors.worker.engine.weights_cache import read_artifact

    art = read_artifact(models["gemma2"]["hf"], torch.float32)
    raw = models["gemma2"]["model"].model.layers[0].input_layernorm.weight
    assert torch.equal(art.weights["layers.0.attn_norm"], raw + 1.0)


def test_an_adapter_is_refused_by_name_before_any_step(engines):
    eng = engines("gemma2")
    with pytest.raises(ValueError, match="not supported for Gemma"):
        eng.runner.check_adapter("a", "/nonexistent", set())
