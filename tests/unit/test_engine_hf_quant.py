"""GPTQ, AWQ (GEMM) and FP8 Hugging Face directories (actors/worker/engine/hf_quant.py, issue [23] items 2-3).

Checkpoints are packed here from known float weights by the rules of their sources (written in this file, not
the engine's: AutoGPTQ ``qlinear_cuda_old.py`` ``pack`` with its ``zeros -= 1`` v1 convention, AutoAWQ
``gemm.py`` ``from_linear`` with the interleave ``[0, 2, 4, 6, 1, 3, 5, 7]``), the unpacking is checked on
hand-written words, and the reference is transformers holding the float weights each checkpoint means
(computed here from the packer's integers, scales and zeros).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from actors.worker.engine import hf_quant
from actors.worker.engine.arch_spec import UnsupportedModel
from actors.worker.engine.engine import EngineConfig, LLMEngine
from tests.engine_fixtures import prefill_logits

INT4_TOL = (0.08, 0.85)  # rel, top1 (tests/unit/test_engine_families.py QUANT_TOLERANCES["int4"])
BF16_TOL = (0.08, 0.8)  # tests/unit/test_engine_families.py test_bfloat16_within_tolerance
_G = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 260, (n,), generator=_G).tolist() for n in (40, 9)]
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


# --------------------------------------------------------------------------- hand-written words


def test_gptq_words_unpack_by_input_row_and_output_column():
    """qweight: input row 8 i + k in bits 4k; qzeros: output column 8 j + k in bits 4k (AutoGPTQ pack)."""
    word = torch.tensor([[0x87654321 - 2**32]], dtype=torch.int32)  # nibbles 1..8, lowest first
    assert hf_quant.unpack_rows(word)[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert hf_quant.unpack_cols(word)[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_gptq_v1_zero_is_stored_minus_one():
    """v1 (AutoGPTQ ``zeros -= 1``): a symmetric 4-bit zero 8 is stored as 7 in every nibble."""
    spec = hf_quant.QuantSpec("gptq", 4, 32, v1=True)
    t = {"qweight": torch.full((4, 8), 0x88888888 - 2**32, dtype=torch.int32),  # q = 8 everywhere
         "qzeros": torch.tensor([[0x77777777]], dtype=torch.int32), "scales": torch.full((1, 8), 0.5).half()}
    q, zero, scale, g = hf_quant.unpacked(spec, t, 32)
    assert zero.unique().tolist() == [8] and q.unique().tolist() == [8]
    assert hf_quant.dequantize_int4(q, zero, scale, g).abs().max() == 0
    v2 = hf_quant.unpacked(hf_quant.QuantSpec("gptq", 4, 32, v1=False), t, 32)[1]
    assert v2.unique().tolist() == [7]


def test_awq_words_unpack_with_the_interleave():
    """AutoAWQ packs columns 8 j + [0, 2, 4, 6, 1, 3, 5, 7][k] into bits 4k: columns 0..7 holding 0..7 give the
    word 0x75316420."""
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert hf_quant.unpack_cols(word, hf_quant.AWQ_ORDER)[0].tolist() == list(range(8))
    assert hf_quant.unpack_cols(word)[0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]  # without the interleave: wrong


# --------------------------------------------------------------------------- packers (the sources' rules)


def _pack_nibbles_rows(v: torch.Tensor) -> torch.Tensor:
    """int [r, c] -> int32 [r / 8, c]: row 8 i + k into bits 4k (AutoGPTQ qweight)."""
    r, c = v.shape
    out = torch.zeros(r // 8, c, dtype=torch.int64)
    for k in range(8):
        out |= v[k::8].long() << (4 * k)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def _pack_nibbles_cols(v: torch.Tensor, order=range(8)) -> torch.Tensor:
    """int [r, c] -> int32 [r, c / 8]: column 8 j + order[k] into bits 4k (GPTQ qzeros; AWQ with its order)."""
    r, c = v.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for k, src in enumerate(order):
        out |= v[:, src::8].long() << (4 * k)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


def _quantize(w: torch.Tensor, g: torch.Tensor, groups: int, sym: bool):
    """Asymmetric (or symmetric, zero 8) 4-bit per group: q [out, in] 0..15, zero [groups, out] int, scale
    half [groups, out]; ``g`` [in] the group of each input."""
    out_f = w.shape[0]
    scale = torch.empty(groups, out_f)
    zero = torch.empty(groups, out_f, dtype=torch.int64)
    for gi in range(groups):
        cols = w[:, g == gi]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            s = torch.maximum(-lo, hi) / 7.5
            z = torch.full((out_f,), 8)
        else:
            s = (hi - lo) / 15
            z = torch.round(-lo / s).long()
        scale[gi], zero[gi] = s, z
    scale = scale.half()
    sf = scale.float()[g].t()
    q = torch.clamp(torch.round(w / sf) + zero[g].t(), 0, 15).long()
    return q, zero, scale


def _gptq_tensors(w, group, sym, desc_act, v1=True, seed=0):
    out_f, in_f = w.shape
    groups = in_f // group
    g = torch.arange(in_f) // group
    if desc_act:  # act-order: inputs visited in a permuted order, each block of `group` of them one group
        perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(seed))
        g = torch.empty(in_f, dtype=torch.int64)
        g[perm] = torch.arange(in_f) // group
    q, zero, scale = _quantize(w, g, groups, sym)
    t = {"qweight": _pack_nibbles_rows(q.t()), "qzeros": _pack_nibbles_cols(zero - (1 if v1 else 0)),
         "scales": scale, "g_idx": g.to(torch.int32)}
    ref = scale.float()[g].t() * (q - zero[g].t()).float()
    return t, ref


def _awq_tensors(w, group):
    out_f, in_f = w.shape
    g = torch.arange(in_f) // group
    q, zero, scale = _quantize(w, g, in_f // group, sym=False)
    t = {"qweight": _pack_nibbles_cols(q.t(), hf_quant.AWQ_ORDER), "qzeros": _pack_nibbles_cols(zero, hf_quant.AWQ_ORDER),
         "scales": scale}
    ref = scale.float()[g].t() * (q - zero[g].t()).float()
    return t, ref


def _fp8_tensors(w, strategy):
    if strategy == "tensor":
        s = (w.abs().max() / 448.0).reshape(1)
        w8 = (w / s).to(torch.float8_e4m3fn)
        ref = w8.float() * s
    elif strategy == "channel":
        s = w.abs().amax(1, keepdim=True) / 448.0
        w8 = (w / s).to(torch.float8_e4m3fn)
        ref = w8.float() * s
    else:  # block 32 x 32, weight_scale_inv (the plain "fp8" form)
        blocks = w.reshape(w.shape[0] // 32, 32, w.shape[1] // 32, 32)
        s = blocks.abs().amax((1, 3)) / 448.0
        full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)
        w8 = (w / full).to(torch.float8_e4m3fn)
        return {"weight": w8, "weight_scale_inv": s}, w8.float() * full
    return {"weight": w8, "weight_scale": s.bfloat16(), "input_scale": torch.ones(1)}, w8.float() * s.bfloat16().float()


def _tiny_model():
    import transformers

    from tests.family_models import VARIANTS, Variant, _hf_config, _scale

    cfg = _hf_config(Variant("llama", {**VARIANTS["llama-plain"].config, "hidden_size": 128,
                                       "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}))
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _scale(model, 4)
    return model


@pytest.fixture(scope="module")
def tiny():
    return _tiny_model()


def _write_dir(model, folder: Path, qconfig: dict, make) -> tuple[str, dict[str, torch.Tensor]]:
    """The model's directory with each projection replaced by ``make(weight) -> (tensors, reference float)``;
    returns (path, {HF weight name: reference float32})."""
    from safetensors.torch import save_file

    from tests.family_models import write_tokenizer_json

    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(cfg))
    write_tokenizer_json(str(folder / "tokenizer.json"))
    tensors, refs = {}, {}
    for name, p in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.split(".", 3)[-1] in PROJ:
            t, ref = make(p.detach().float())
            tensors.update({f"{module}.{k}": v.contiguous() for k, v in t.items()})
            refs[name] = ref
        else:
            tensors[name] = p.detach().clone().contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder), refs


def _reference(model, refs):
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in refs:
                p.copy_(refs[name])
        return torch.cat([ref(torch.tensor([p])).logits[0].float() for p in PROMPTS])


def _engine(path, dtype="float32", quantization="auto"):
    return LLMEngine(EngineConfig(model_path=path, dtype=dtype, kv_cache_bytes=4 * 2**20, max_num_seqs=4,
                                  max_loras=0, quantization=quantization))


def _held(eng, layer, proj):
    lin = getattr(eng.model.layers[layer], proj)
    lin = getattr(lin, "linear", lin)
    return lin.dequantize().float() if hasattr(lin, "dequantize") else lin.weight.float()


_FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def _check(eng, model, refs, tol, exact=True):
    for i in range(model.config.num_hidden_layers if exact else 0):
        for proj, parts in _FUSED.items():
            ref = torch.cat([refs[f"model.layers.{i}.{p}.weight"] for p in parts])
            held = _held(eng, i, proj)
            assert torch.equal(held, ref), (i, proj, (held - ref).abs().max())
    ref = _reference(model, refs)
    ours = torch.cat([prefill_logits(eng, p) for p in PROMPTS])
    rel = ((ours - ref).norm() / ref.norm()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{eng.held}: rel {rel:.2e} top1 {top1:.3f}")
    assert rel <= tol[0] and top1 >= tol[1]
    return rel


# --------------------------------------------------------------------------- GPTQ / AWQ directories


@pytest.mark.parametrize("group,sym,v1", [(32, True, True), (64, False, True), (128, False, False)])
def test_gptq_directory_repacked_into_int4_bit_for_bit(tiny, tmp_path, group, sym, v1):
    """GPTQ groups of 32 / 64 / 128 (sym and asym; v1 and v2 zeros): every projection held as the engine's
    int4 groups with the checkpoint's integers, equal to the dequantized reference bit for bit on float32;
    logits within the int4 tolerance of transformers holding that reference."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": sym,
          "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    path, refs = _write_dir(tiny, tmp_path / "gptq", qc, lambda w: _gptq_tensors(w, group, sym, False, v1))
    eng = _engine(path)
    assert eng.quantization == "int4" and eng.held.startswith("int4 exact") and eng.held.endswith("(GPTQ) x 8"), eng.held
    _check(eng, tiny, refs, INT4_TOL)


def test_gptq_desc_act_with_a_permuting_g_idx_is_dequantized_and_says_so(tiny, tmp_path):
    """desc_act: g_idx permutes the inputs over the groups, so 32 consecutive inputs do not share a scale:
    dequantized at load (held dense in float32, exact), said in the held line."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False}
    path, refs = _write_dir(tiny, tmp_path / "gptq-act", qc, lambda w: _gptq_tensors(w, 32, False, True))
    eng = _engine(path)
    assert eng.held == "float32 (GPTQ g_idx) x 8", eng.held
    _check(eng, tiny, refs, INT4_TOL)


def test_awq_directory_repacked_into_int4_bit_for_bit(tiny, tmp_path):
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
    path, refs = _write_dir(tiny, tmp_path / "awq", qc, lambda w: _awq_tensors(w, 64))
    eng = _engine(path)
    assert eng.held.startswith("int4 exact") and eng.held.endswith("(AWQ) x 8"), eng.held
    _check(eng, tiny, refs, INT4_TOL)


def test_awq_packed_without_the_interleave_moves_the_logits(tiny, tmp_path):
    """Negative control: the same checkpoint packed in plain nibble order (no interleave) loads other weights,
    and its logits leave the tolerance: the interleave is what the comparison above checks."""
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}

    def plain(w):
        t, ref = _awq_tensors(w, 64)
        q = hf_quant.unpack_cols(t["qweight"], hf_quant.AWQ_ORDER)
        z = hf_quant.unpack_cols(t["qzeros"], hf_quant.AWQ_ORDER)
        return {**t, "qweight": _pack_nibbles_cols(q), "qzeros": _pack_nibbles_cols(z)}, ref
    path, refs = _write_dir(tiny, tmp_path / "awq-plain", qc, plain)
    eng = _engine(path)
    ref = _reference(tiny, refs)
    ours = torch.cat([prefill_logits(eng, p) for p in PROMPTS])
    assert ((ours - ref).norm() / ref.norm()).item() > INT4_TOL[0]


def test_bfloat16_gptq_within_one_rounding_of_scale_and_zero(tiny, tmp_path):
    """bfloat16: the integers unchanged, scale and zero (8 - zero) * scale rounded once to bfloat16 (AMX /
    torch int4) or half (Q4_1 blocks); logits within the bf16 bound of the float32 reference."""
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
    path, refs = _write_dir(tiny, tmp_path / "gptq-bf16", qc, lambda w: _gptq_tensors(w, 32, False, False))
    eng = _engine(path, dtype="bfloat16")
    assert "int4" in eng.held and "GPTQ" in eng.held, eng.held
    for proj, parts in _FUSED.items():
        ref = torch.cat([refs[f"model.layers.0.{p}.weight"] for p in parts])
        err = (_held(eng, 0, proj) - ref).abs().max().item()
        assert err <= ref.abs().max().item() * 2 ** -6, (proj, err)  # scale and zero: one rounding each
    _check(eng, tiny, refs, BF16_TOL, exact=False)


# --------------------------------------------------------------------------- FP8


@pytest.mark.parametrize("form", ["tensor", "channel", "block"])
def test_fp8_directory_dequantized_within_bf16_tolerance(tiny, tmp_path, form):
    """FP8 (compressed-tensors per tensor / per channel; the plain "fp8" form with 32 x 32 blocks of
    ``weight_scale_inv``): dequantized to the worker's dtype; float32 holds the reference exactly, bfloat16
    within the bf16 bound."""
    if form == "block":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                                "strategy": form}}}}
    path, refs = _write_dir(tiny, tmp_path / f"fp8-{form}", qc, lambda w: _fp8_tensors(w, form))
    eng32 = _engine(path)
    assert eng32.held == "float32 (FP8) x 8", eng32.held
    _check(eng32, tiny, refs, INT4_TOL)
    eng = _engine(path, dtype="bfloat16")
    assert eng.held == "bfloat16 (FP8) x 8", eng.held
    _check(eng, tiny, refs, BF16_TOL, exact=False)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 32}, "bits 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": False}, "zero_point"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "config_groups.g"),
])
def test_unsupported_quantization_configs_are_refused_by_name(qc, match):
    with pytest.raises(UnsupportedModel, match=match):
        hf_quant.quant_spec({"quantization_config": qc})


def test_a_directory_whose_tensors_do_not_fit_is_refused(tiny, tmp_path):
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}

    def broken(w):
        t, ref = _gptq_tensors(w, 32, True, False)
        return {k: v for k, v in t.items() if k != "qweight"}, ref
    path, _ = _write_dir(tiny, tmp_path / "broken", qc, broken)
    with pytest.raises(UnsupportedModel, match="without qweight"):
        _engine(path)


# --------------------------------------------------------------------------- the loaded form's bytes


@pytest.mark.parametrize("kind", ["gptq", "gptq-act", "fp8"])
def test_registry_estimate_is_the_loaded_forms_bytes(tiny, tmp_path, kind):
    """loaded_bytes (the registry's default memory_bytes) against the engine's measured weights (float32, no
    dense copies): within 10 % (the RoPE tables and half-precision block scales are not in the estimate); the
    int4 checkpoints estimate well below the dense size, the dequantized ones at it."""
    from actors.worker.engine.loaded_bytes import loaded_bytes

    if kind == "fp8":
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
        make = lambda w: _fp8_tensors(w, "channel")  # noqa: E731
    else:
        act = kind == "gptq-act"
        qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": act, "sym": False}
        make = lambda w: _gptq_tensors(w, 32, False, act)  # noqa: E731
    path, _ = _write_dir(tiny, tmp_path / kind, qc, make)
    eng = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=4 * 2**20, max_loras=0,
                                 quantization="auto", quant_dense_copy=False))
    est = loaded_bytes(path, dtype_bytes=4)
    dense = sum(p.numel() for p in tiny.parameters()) * 4
    print(kind, eng.held, est, eng.weights_bytes, dense)
    assert abs(est - eng.weights_bytes) <= 0.1 * eng.weights_bytes
    assert (est < 0.7 * dense) if kind == "gptq" else (est >= 0.95 * dense)


def test_fp8_projection_left_unquantized_is_read_as_is():
    """compressed-tensors ``ignore``: a projection without a scale is a plain float weight."""
    spec = hf_quant.QuantSpec("fp8", 8)
    w = torch.randn(4, 8).bfloat16()
    assert torch.equal(hf_quant.dequantize_fp8(spec, {"weight": w}), w.float())
    with pytest.raises(UnsupportedModel, match="float8_e4m3fn only"):
        hf_quant.dequantize_fp8(spec, {"weight": w.to(torch.int8), "weight_scale": torch.ones(1)})
