"""Gemma 2 and Gemma 3 text from Hugging Face directories (issue [22] item 1, in part: gemma.py) against transformers
in float32 (its eager attention: SDPA has no soft-cap).

Models: tests/family_models.py ``GEMMA_VARIANTS`` (tiny, random, scaled): two layers, the first with a window of
16 tokens, the second full; Gemma 2 with attention / final soft-caps of 5 / 10 (low enough to bind) and
``query_pre_attn_scalar`` 32 (head_dim 16); Gemma 3 with q/k norms, a local RoPE base (10^4) beside the full
layers' linearly scaled one (10^6, x2). Prompts of 48, 40 and 7 tokens. Negative controls: each feature switched
off in our model moves the logits by more than 100 x LOGIT_ATOL.

GGUF: GEMMA_GGUF_VARIANTS (what a GGUF can say: no query_pre_attn_scalar, llama.cpp's layer patterns) written by
our test writer and by llama.cpp's convert_hf_to_gguf.py; our loader serves both at transformers' logits; the
spec's llama.cpp conventions are checked on metadata alone. Refused: LoRA adapters. Soft-capping speed:
bench/softcap_bench.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from actors.worker.engine import cpu_kernels
from actors.worker.engine.engine import EngineConfig, LLMEngine

from tests.family_checks import (LOGIT_ATOL, assert_batched_equals_alone, assert_greedy_matches_transformers,
                                 build_models, control_moves, engine_cache, worst_logit_error)
from tests.family_models import GEMMA_GGUF_VARIANTS, GEMMA_VARIANTS, build
from tests.moe_models import sentencepiece_dir
from tests.unit.test_engine_families import PROMPTS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(build, GEMMA_VARIANTS, tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="module")
def engines(models):
    """engine(variant): float32 engines of the Hugging Face directories, made once per module."""
    with engine_cache(models) as get:
        yield get


# native: decode attention by the C++ kernel (scale, window, soft-cap inside it) where it builds; else torch's
NATIVE = [True, False] if cpu_kernels.load() is not None else [False]


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_logits_match_transformers(models, engines, variant, native):
    worst = worst_logit_error(engines(variant, native=native), models[variant]["model"], PROMPTS, chunk_at=19)
    print(f"{variant} ({'native' if native else 'torch'} decode attention): max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_greedy_32_tokens_match_transformers(models, engines, variant, native):
    assert_greedy_matches_transformers(engines(variant, native=native), models[variant]["model"], PROMPTS[0])


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
@pytest.mark.parametrize("variant", list(GEMMA_VARIANTS))
def test_batched_equals_alone(engines, variant, native):
    assert_batched_equals_alone(engines(variant, native=native), PROMPTS)


def test_the_torch_path_and_why(engines):
    """The fused Llama kernels do not run Gemma (status says why); its decode attention does, when it builds."""
    eng = engines("gemma2")
    assert eng.model.kernels is None and "Gemma" in eng.runner.native_off_reason
    assert (eng.model.decode_kernels is not None) == (cpu_kernels.load() is not None)
    off = engines("gemma2", native=False)
    assert off.model.decode_kernels is None
    assert off.runner.native_off_reason is None  # not asked for: nothing to explain (as the Llama decoder)


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


# --------------------------------------------------------------------------------------- GGUF (llama.cpp's converter)

LLAMA_CPP = os.environ.get("ACTORSERVE_LLAMA_CPP_DIR", "/work/llama-build/llama.cpp")


def _convert(hf_dir: str, folder, outtype: str = "f32") -> str:
    """llama.cpp's convert_hf_to_gguf.py (the independent writer; ``ACTORSERVE_LLAMA_CPP_DIR``, default where
    docs/bench.md unpacks it) on ``hf_dir`` with a SentencePiece tokenizer (Gemma's kind). Returns the file."""
    script = os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        pytest.skip(f"llama.cpp sources not found at {LLAMA_CPP} (set ACTORSERVE_LLAMA_CPP_DIR; docs/bench.md)")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads a Gemma's SentencePiece tokenizer")
    src = sentencepiece_dir(hf_dir, folder / "sp")
    out = str(folder / f"llamacpp-{outtype}.gguf")
    env = {**os.environ, "PYTHONPATH": os.path.join(LLAMA_CPP, "gguf-py")}  # its own gguf-py, not ours
    proc = subprocess.run([sys.executable, os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py"), src, "--outtype",
                           outtype, "--outfile", out], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """{variant: {"model", "hf", "gguf", "folder"}} of GEMMA_GGUF_VARIANTS; "gguf": our writer's file
    (tests/family_models.py, llama.cpp's conventions)."""
    out = {}
    for name in GEMMA_GGUF_VARIANTS:
        folder = tmp_path_factory.mktemp(name)
        out[name] = {**build(name, folder), "folder": folder}
    return out


@pytest.mark.parametrize("variant", list(GEMMA_GGUF_VARIANTS))
def test_our_gguf_matches_transformers(gguf_models, variant):
    """Our writer's file (as llama.cpp's converter lays one out) served within LOGIT_ATOL; no llama.cpp needed."""
    _assert_gguf_serves_transformers(gguf_models[variant], gguf_models[variant]["gguf"], variant)


@pytest.mark.parametrize("variant", list(GEMMA_GGUF_VARIANTS))
def test_llama_cpp_converter_output_matches_transformers(gguf_models, variant):
    """llama.cpp's converter's file (norms folded to ``1 + w``, no query_pre_attn_scalar, windows by llama.cpp's
    layer pattern) read by our loader serves transformers' float32 logits within LOGIT_ATOL, prefill and step by
    step, and the same 32 greedy tokens."""
    m = gguf_models[variant]
    _assert_gguf_serves_transformers(m, _convert(m["hf"], m["folder"]), variant)


def _assert_gguf_serves_transformers(m: dict, path: str, variant: str) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    assert arch == variant.split("-")[0]
    eng = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=8 * 2**20, max_loras=0))
    cfg = eng.model_config
    assert cfg.architecture == ("gemma2" if arch == "gemma2" else "gemma3_text")
    assert cfg.layer_windows == tuple(16 if t == "sliding_attention" else 0
                                      for t in m["model"].config.layer_types)
    assert 0 in cfg.layer_windows and 16 in cfg.layer_windows
    worst = worst_logit_error(eng, m["model"], PROMPTS, chunk_at=19)
    print(f"{variant} ({path.rsplit('/', 1)[-1]}): max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL
    assert_greedy_matches_transformers(eng, m["model"], PROMPTS[0])


def test_gguf_spec_follows_llama_cpp_conventions():
    """gemma.from_gguf on metadata alone: Gemma 2's defaults (window 4096, caps 50 / 30), the 27B block counts'
    attention scale, a per-layer pattern array, and the refusals by key."""
    from actors.worker.engine import gemma
    from actors.worker.engine.arch_spec import ModelConfig, UnsupportedModel

    base = ModelConfig(num_layers=4, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=16, ffn_size=128,
                       vocab_size=300, context_length=128, rope_theta=10000.0, rms_eps=1e-6, architecture="gemma2")
    g2 = gemma.from_gguf({}, base)
    assert (g2.layer_windows, g2.attn_softcap, g2.final_softcap) == ((4096, 0, 4096, 0), 50.0, 30.0)
    assert g2.query_pre_attn_scalar == 16.0 and g2.architecture == "gemma2" and not g2.qk_norm
    big = gemma.from_gguf({}, dataclasses.replace(base, num_layers=46))
    assert big.query_pre_attn_scalar == 32.0  # 27B: hidden / heads
    g3 = dataclasses.replace(base, architecture="gemma3", num_layers=7)
    s3 = gemma.from_gguf({"gemma3.attention.sliding_window": 8}, g3)
    assert s3.layer_windows == (8, 8, 8, 8, 8, 0, 8) and s3.rope_local_theta == 10000.0 and s3.qk_norm
    assert s3.attn_softcap is None and s3.final_softcap is None and s3.architecture == "gemma3_text"
    full = gemma.from_gguf({}, g3)
    assert full.layer_windows == (0,) * 7 and full.rope_local_theta is None
    arr = gemma.from_gguf({"gemma3.attention.sliding_window": 8,
                           "gemma3.attention.sliding_window_pattern": [True, False] * 3 + [True]}, g3)
    assert arr.layer_windows == (8, 0, 8, 0, 8, 0, 8)
    with pytest.raises(UnsupportedModel, match="sliding_window_pattern"):
        gemma.from_gguf({"gemma3.attention.sliding_window": 8, "gemma3.attention.sliding_window_pattern": [True]}, g3)
    with pytest.raises(UnsupportedModel, match="attn_logit_softcapping"):
        gemma.from_gguf({"gemma3.attn_logit_softcapping": 50.0}, g3)
    with pytest.raises(UnsupportedModel, match="freq_base_swa"):
        gemma.from_gguf({"gemma2.rope.freq_base_swa": 500.0}, base)
    with pytest.raises(UnsupportedModel, match="sliding_window 0"):  # found by a tryout: llama.cpp masks every key
        gemma.from_gguf({"gemma2.attention.sliding_window": 0}, base)


def test_full_layers_keep_their_keys(models, engines):
    """A model with full-attention layers beside sliding ones releases no KV blocks behind the window (the sliding
    window of decision 0046 bounds every layer only when every layer slides): greedy decoding of a 48-token prompt
    (window 16) on the six-layer Gemma 3 diverged from transformers at its 4th token while it did."""
    from actors.worker.engine.arch_spec import kv_release_window

    for variant in GEMMA_VARIANTS:
        cfg = engines(variant).model_config
        assert 0 in cfg.layer_windows and cfg.sliding_window == 16
        assert kv_release_window(cfg) is None and engines(variant).scheduler.window is None
    assert kv_release_window(dataclasses.replace(cfg, layer_windows=(16, 8))) == 16
    assert kv_release_window(dataclasses.replace(cfg, layer_windows=None, sliding_window=8)) == 8
    assert kv_release_window(None) is None
