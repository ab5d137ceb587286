"""Issue [21] items 1-2 (decision 0046): Mistral's sliding window and Phi-3's fused projections and LongRoPE, from
Hugging Face directories and GGUF files, against transformers in float32.

Models: tests/family_models.py ``WINDOW_VARIANTS`` (tiny, random, scaled so attention is sharp): ``mistral`` with a
window of WINDOW = 16 tokens (prompts of 48 and 40 tokens); ``phi3`` with ``qkv_proj`` / ``gate_up_proj`` and
LongRoPE (original length 32, served up to 128; short and long factors far from 1).

LongRoPE is checked as full-sequence forwards on both sides of the threshold: an engine serving 128 positions
rotates with the long factors (vLLM's choice, rope.py) and equals transformers' full forward of any sequence longer
than 32; an engine served with ``max_model_len`` 32 rotates with the short factors and equals transformers on
sequences up to 32. Negative controls: window off, LongRoPE off, short factors only, no attention factor, gate and
up swapped move the logits by more than 100 x LOGIT_ATOL.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

from actors.worker.engine.arch_spec import UnsupportedModel
from actors.worker.engine.types import EngineRequest
from tests.engine_fixtures import prefill_logits
from tests.family_checks import (GEN_TOKENS, LOGIT_ATOL, assert_batched_equals_alone,
                                 assert_greedy_matches_transformers, assert_native_matches_torch_path,
                                 assert_two_ranks_equal_one, build_models, control_moves, engine_cache, greedy,
                                 hf_forward, our_logits, worst_logit_error)
from tests.family_models import ORIG_MAX, WINDOW, WINDOW_VARIANTS, build, write_gguf

_g = torch.Generator().manual_seed(11)
LONG = [torch.randint(3, 260, (n,), generator=_g).tolist() for n in (48, 40)]  # > ORIG_MAX and > WINDOW
SHORT = [torch.randint(3, 260, (n,), generator=_g).tolist() for n in (ORIG_MAX, 20, 7)]  # <= ORIG_MAX
assert min(map(len, LONG)) > max(ORIG_MAX, WINDOW) and max(map(len, SHORT)) <= ORIG_MAX
CASES = [(v, f) for v in WINDOW_VARIANTS for f in ("hf", "gguf")]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(build, WINDOW_VARIANTS, tmp_path_factory.mktemp("windows"))


@pytest.fixture(scope="module")
def engines(models):
    """engine(variant, format, native=True, max_model_len=None): float32 engines, made once per module."""
    with engine_cache(models) as get:
        yield get


def _worst(engine, model, prompts, chunked: bool = True) -> float:
    """Prefill, one-token steps and (chunked) a prefill chunked after WINDOW + 3 tokens, against transformers."""
    return worst_logit_error(engine, model, prompts, chunk_at=WINDOW + 3 if chunked else None)


# --------------------------------------------------------------------------------------- logits, greedy, batch


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_mistral_logits_match_transformers_beyond_the_window(models, engines, fmt):
    eng = engines("mistral", fmt)
    assert eng.model_config.sliding_window == WINDOW
    worst = _worst(eng, models["mistral"]["model"], LONG + SHORT)
    print(f"mistral/{fmt}: max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_logits_match_transformers_past_the_original_length(models, engines, fmt):
    """Served up to 128 positions: the long factors, transformers' full forward of sequences longer than 32."""
    eng = engines("phi3", fmt)
    assert eng.runner.position_limit > ORIG_MAX
    worst = _worst(eng, models["phi3"]["model"], LONG)
    print(f"phi3/{fmt} long side: max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_phi3_logits_match_transformers_within_the_original_length(models, engines, fmt):
    """Served with max_model_len 32: the short factors, transformers' full forward of sequences up to 32."""
    eng = engines("phi3", fmt, max_model_len=ORIG_MAX)
    worst = _worst(eng, models["phi3"]["model"], SHORT)
    print(f"phi3/{fmt} short side: max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL


def test_phi3_long_table_on_a_short_sequence_is_transformers_long_factors(models, engines):
    """The vLLM choice, pinned: served past 32, a short sequence is rotated with the long factors too (transformers'
    own full forward would use the short ones there: different logits), and equals transformers forced to the long
    factors."""
    model, prompt = models["phi3"]["model"], SHORT[1]
    ours = prefill_logits(engines("phi3", "hf"), prompt)
    assert (ours - hf_forward(model, prompt)).abs().max().item() > 100 * LOGIT_ATOL
    rot = model.model.rotary_emb
    hf_forward(model, LONG[0])  # transformers computes and keeps its long_inv_freq
    saved = rot.original_inv_freq
    try:
        rot.original_inv_freq = rot.long_inv_freq
        with torch.no_grad():
            forced = model(torch.tensor([prompt])).logits[0].float()
    finally:
        rot.original_inv_freq = saved
    assert (ours - forced).abs().max().item() <= LOGIT_ATOL


@pytest.mark.parametrize("variant,fmt", CASES)
def test_greedy_32_tokens_match_transformers(models, engines, variant, fmt):
    assert_greedy_matches_transformers(engines(variant, fmt), models[variant]["model"], LONG[0])


@pytest.mark.parametrize("variant,fmt", CASES)
def test_batched_equals_alone(engines, variant, fmt):
    assert_batched_equals_alone(engines(variant, fmt), LONG + SHORT[1:])


@pytest.mark.parametrize("variant", list(WINDOW_VARIANTS))
def test_native_kernels_run_these_models_and_match_the_torch_path(engines, variant):
    from actors.worker.engine import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("no C++ compiler here: only the torch path exists")
    native, torch_path = engines(variant, "hf"), engines(variant, "hf", native=False)
    assert native.model.kernels is not None and native.runner.native_off_reason is None
    assert_native_matches_torch_path(native, torch_path, LONG)


# --------------------------------------------------------------------------------------- the kernel's window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [16, 24])  # 16: the AVX-512 path where built; 24: the portable one
@pytest.mark.parametrize("window", [1, 5, 16, 37, 500])
def test_decode_kernel_window_against_sdpa(hd, window, dtype):
    """The native decode kernel's window: keys at positions >= len - window, for windows within a block, on a
    block edge, across blocks and wider than the context."""
    import torch.nn.functional as F

    from actors.worker.engine import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C++ compiler here: only the torch path exists")
    torch.manual_seed(0)
    bs, nb, H, Hkv = 16, 40, 4, 2
    kc, vc = torch.randn(nb, bs, Hkv, hd, dtype=dtype), torch.randn(nb, bs, Hkv, hd, dtype=dtype)
    lens = torch.tensor([1, 17, 200, 64, 33], dtype=torch.int32)
    tables = torch.stack([torch.randperm(nb)[:13] for _ in lens]).to(torch.int32)
    rows = torch.tensor([4, 0, 2, 6, 5], dtype=torch.int32)
    q = torch.randn(7, H, hd, dtype=dtype)
    out = torch.zeros(7, H, hd, dtype=dtype)
    kernels.paged_decode_attention(q, out, kc, vc, rows, tables, lens, hd ** -0.5, window)
    for s in range(5):
        n = int(lens[s])
        k = kc.index_select(0, tables[s].long()).reshape(-1, Hkv, hd)[:n].transpose(0, 1)
        v = vc.index_select(0, tables[s].long()).reshape(-1, Hkv, hd)[:n].transpose(0, 1)
        lo = max(0, n - window)
        ref = F.scaled_dot_product_attention(q[int(rows[s])].reshape(Hkv, 2, hd).float(), k[:, lo:].float(),
                                             v[:, lo:].float())
        tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)  # test_cpu_kernels
        torch.testing.assert_close(out[int(rows[s])].float(), ref.reshape(H, hd), **tol)


# --------------------------------------------------------------------------------------- negative controls


def _off(feature: str):
    def change(cfg, weights):
        if feature == "window":
            return dataclasses.replace(cfg, sliding_window=None)
        if feature == "longrope":
            return dataclasses.replace(cfg, rope_scaling=None, rope_short_factors=None, rope_long_factors=None,
                                       rope_attention_factor=1.0)
        if feature == "short_only":  # the short factors past the original length
            return dataclasses.replace(cfg, rope_long_factors=cfg.rope_short_factors)
        if feature == "attention_factor":
            return dataclasses.replace(cfg, rope_attention_factor=1.0)
        if feature == "gate_up_order":  # the fused tensor's halves the other way round
            for i in range(cfg.num_layers):
                g, u = weights[f"layers.{i}.w_gate"], weights[f"layers.{i}.w_up"]
                weights[f"layers.{i}.w_gate"], weights[f"layers.{i}.w_up"] = u, g
            return cfg
        raise AssertionError(feature)
    return change


CONTROLS = [("mistral", "window"), ("phi3", "longrope"), ("phi3", "short_only"), ("phi3", "attention_factor"),
            ("phi3", "gate_up_order")]


@pytest.mark.parametrize("variant,feature,fmt", [(v, f, fmt) for v, f in CONTROLS for fmt in ("hf", "gguf")])
def test_negative_control_switching_a_feature_off_moves_the_logits(models, variant, feature, fmt):
    path, prompt = models[variant][fmt], LONG[0]
    moved = control_moves(path, models[variant]["model"], prompt, _off(feature))
    print(f"{variant}/{fmt} without {feature}: max|dlogit| {moved:.2f}")
    assert moved > 100 * LOGIT_ATOL


def test_the_window_changes_nothing_within_it(models):
    path, prompt = models["mistral"]["hf"], LONG[0][:WINDOW]
    assert (our_logits(path, prompt, _off("window")) - our_logits(path, prompt)).abs().max().item() == 0.0


# --------------------------------------------------------------------------------------- refusals


def _refused(path: str, match: str) -> None:
    from actors.worker.engine.weights_cache import read_artifact

    with pytest.raises(UnsupportedModel, match=match):
        read_artifact(path, torch.float32)


def _edit_config(models, tmp_path, variant, edit) -> str:
    d = str(tmp_path / "x")
    shutil.copytree(models[variant]["hf"], d)
    cfg = json.loads(open(os.path.join(d, "config.json")).read())
    edit(cfg)
    open(os.path.join(d, "config.json"), "w").write(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edit,match", [
    (lambda c: (c["rope_parameters"].pop("partial_rotary_factor"), c.update(partial_rotary_factor=0.75)),
     "partial_rotary_factor"),  # Phi-4-mini's 0.75, written as transformers 4.x does
    (lambda c: c["rope_parameters"].update(long_factor=[1.0, 2.0]), "long_factor"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "'yarn'"),
    (lambda c: c.update(sliding_window=0), "sliding_window"),
])
def test_phi3_config_values_we_do_not_model_are_refused(models, tmp_path, edit, match):
    _refused(_edit_config(models, tmp_path, "phi3", edit), match)


def test_a_phi3_dir_with_a_misshapen_fused_tensor_is_refused(models, tmp_path):
    from safetensors.torch import load_file, save_file

    d = str(tmp_path / "x")
    shutil.copytree(models["phi3"]["hf"], d)
    file = os.path.join(d, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].clone()
    save_file(tensors, file, metadata={"format": "pt"})
    _refused(d, name)


def test_a_phi3_gguf_with_one_longrope_factor_tensor_is_refused(models, tmp_path):
    path = write_gguf(models["phi3"]["model"], str(tmp_path / "x.gguf"), drop=("rope_factors_short.weight",))
    _refused(path, "rope_factors_long")


def test_a_qwen2_gguf_with_a_sliding_window_is_refused(tmp_path):
    """Qwen2's window applies to some layers only (max_window_layers): not modelled, refused by its key."""
    from tests.family_models import hf_model

    path = write_gguf(hf_model("qwen2"), str(tmp_path / "q.gguf"), extra_uint32={"qwen2.attention.sliding_window": 8})
    _refused(path, "qwen2.attention.sliding_window")


def test_longrope_attention_factor_default_is_the_paper_s(models):
    from actors.worker.engine.hf_loader import read_config

    cfg = read_config(models["phi3"]["hf"])
    assert cfg.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(128 / ORIG_MAX) / math.log(ORIG_MAX)))


@pytest.mark.parametrize("variant", list(WINDOW_VARIANTS))
def test_two_ranks_equal_one(models, engines, variant):
    """The window and the LongRoPE table on every rank; Phi-3's split projections shard as Llama's."""
    assert_two_ranks_equal_one(models[variant]["hf"], engines(variant, "hf"), LONG)


@pytest.mark.parametrize("native", [True, False])
def test_blocks_before_the_window_are_released_and_generation_still_matches(models, engines, native):
    """Decision 0046: a Mistral sequence holds the blocks of its window, not of its whole context (48 + 32 tokens
    in blocks of 16 would be 5; the window of 16 needs at most 3), on the native kernels and on the torch path
    (which reads released entries' stand-ins and masks them), and the second request, whose prompt blocks come
    from the prefix cache, generates the same tokens."""
    eng = engines("mistral", "hf", native=native)
    model, prompt = models["mistral"]["model"], LONG[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=GEN_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=2)[0, len(prompt):].tolist()
    for rid in ("w1", "w2"):
        eng.add_request(EngineRequest(rid, tuple(prompt), greedy(GEN_TOKENS)))
        out, held = [], []
        while eng.has_unfinished():
            for o in eng.step():
                out.extend(o.new_token_ids)
            if eng.block_manager.has_seq(rid):
                held.append(eng.block_manager.num_held(rid))
        assert out == ref, rid
        assert held and max(held) <= -(-WINDOW // eng.config.block_size) + 2, held
