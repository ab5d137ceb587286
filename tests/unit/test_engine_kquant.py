"""GGUF 4-bit blocks held at the file's precision (actors/worker/engine/kquant.py, issue [23] item 1).

Reference: ``gguf.quants.dequantize`` (gguf-py, llama.cpp's own Python reader) and, for the K-quant files of an
independent writer, llama.cpp's ``llama-quantize`` (built from the sources docs/bench.md unpacks; path in
``$LLAMA_QUANTIZE``, else /work/llama-build/quant-build/bin/llama-quantize), or where only its library is built,
the ``llama_model_quantize`` it calls (``$LIBLLAMA``); the tests that need one are skipped when both are absent.  Logits: against transformers holding the weights gguf dequantizes the file to.
"""

from __future__ import annotations

import os
import subprocess
import warnings

import numpy as np
import pytest
import torch

import gguf
from gguf.quants import dequantize as gguf_dequantize

from actors.worker.engine import kquant
from actors.worker.engine.engine import EngineConfig, LLMEngine
from tests.engine_fixtures import prefill_logits

QUANT_TOLERANCES = {"int8": (0.12, 0.85), "int4": (0.08, 0.85)}  # rel, top1 (tests/unit/test_engine_families.py)
LLAMA_QUANTIZE = os.environ.get("LLAMA_QUANTIZE", "/work/llama-build/quant-build/bin/llama-quantize")
LIBLLAMA = os.environ.get("LIBLLAMA", os.path.join(os.path.dirname(LLAMA_QUANTIZE), "libllama.so"))
FTYPES = {"Q2_K": 10, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}  # llama.h enum llama_ftype
needs_quantize = pytest.mark.skipif(not (os.access(LLAMA_QUANTIZE, os.X_OK) or os.path.isfile(LIBLLAMA)),
                                    reason=f"neither llama-quantize ({LLAMA_QUANTIZE}) nor libllama ({LIBLLAMA}) "
                                           "is built (docs/bench.md)")


def llama_quantize(src: str, dst: str, kind: str) -> None:
    """llama.cpp's quantizer: the ``llama-quantize`` binary, else the function it calls,
    ``llama_model_quantize`` of libllama (ctypes; ``llama_model_quantize_params`` as include/llama.h of the
    sources docs/bench.md unpacks declares it: the binary is preferred, the struct is version-bound)."""
    if os.access(LLAMA_QUANTIZE, os.X_OK):
        subprocess.run([LLAMA_QUANTIZE, src, dst, kind, "1"], check=True, capture_output=True, timeout=120)
        return
    import ctypes

    class Params(ctypes.Structure):
        _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
                    ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
                    ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                    ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
                    ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
                    ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t)]
    lib = ctypes.CDLL(LIBLLAMA)
    lib.llama_model_quantize_default_params.restype = Params
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(Params)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPES[kind], 1
    assert lib.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) == 0, kind


def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes of a [rows, cols] tensor of ``type_name`` with finite half scales (|d| ~ 0.01; the second
    half, Q4_1's m or Q4_K's dmin, 4 d as llama.cpp's quantizers give for centred weights)."""
    nbytes, per = kquant._BLOCK[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    halves = 1 if type_name == "Q4_0" else 2
    h = (rng.standard_normal((rows, cols // per, 1)) * 0.01 * np.array([1.0, 4.0])[:halves]).astype(np.float16)
    raw[..., :2 * halves] = h.view(np.uint8).reshape(rows, cols // per, 2 * halves)
    return raw


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_decoded_blocks_equal_gguf_dequantize(type_name):
    """q * scale - mn equals gguf's dequantization: bit for bit for Q4_1 / Q4_K; Q4_0 as numbers (gguf's
    d * (q - 8) gives -0.0 where d < 0 and q = 8, ours +0.0)."""
    rows, cols = 16, 512
    raw = _random_blocks(type_name, rows, cols)
    ref = gguf_dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[type_name])
    q, s, mn = kquant.decode_int4(raw, type_name, rows, cols)
    assert q.max() <= 15 and q.dtype == np.uint8
    ours = kquant.dequantize(*(torch.from_numpy(a) for a in (q, s, mn))).numpy()
    if type_name == "Q4_0":
        assert np.array_equal(ours, ref)
    else:
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_k_scales_on_hand_written_bytes():
    """ggml's get_scale_min_k4 on a hand-written 12-byte field: sub-blocks 0-3 in the low 6 bits of bytes 0-7,
    4-7 split between the nibbles of bytes 8-11 and the top 2 bits of bytes 0-7."""
    sc = [1, 2, 3, 63, 40, 17, 5, 62]
    mn = [7, 0, 33, 9, 48, 1, 60, 31]
    b = [0] * 12
    for j in range(4):
        b[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        b[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6)
        b[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4)
    got_sc, got_mn = kquant.k_scales(np.array([b], dtype=np.uint8))
    assert got_sc[0].tolist() == sc and got_mn[0].tolist() == mn


def test_q4_k_nibble_order_on_a_hand_written_block():
    """One Q4_K block: d = 1, dmin = 0, scale j = j + 1: weight i of sub-block j is (j + 1) * q with q the
    low nibble of byte 32 (j // 2) + i % 32 for even j, the high nibble for odd j."""
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    scales = list(range(1, 9))
    for j in range(4):
        block[4 + j] = scales[j] | ((scales[j + 4] >> 4) << 6)
        block[12 + j] = scales[j + 4] & 15
    qs = (np.arange(128) * 7 % 256).astype(np.uint8)
    block[16:] = qs
    q, s, mn = kquant.decode_int4(block, "Q4_K", 1, 256)
    for j in range(8):
        nib = (qs[32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2))) & 15
        assert q[0, 32 * j:32 * j + 32].tolist() == nib.tolist() and s[0, j] == j + 1 and mn[0, j] == 0
    ref = gguf_dequantize(block[None], gguf.GGMLQuantizationType.Q4_K)  # the layout as gguf-py reads it
    assert np.array_equal(kquant.dequantize(*(torch.from_numpy(a) for a in (q, s, mn))).numpy(), ref)


def test_float32_int4_holds_the_files_values_bit_for_bit():
    """float32: Int4Linear with the file's integers and float32 scale / zero; its weights (read back through
    the packed kernel) equal gguf's dequantization bit for bit, and the product is x @ W^T."""
    rows, cols = 32, 512
    raw = _random_blocks("Q4_K", rows, cols, seed=1)
    ref = torch.from_numpy(gguf_dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K).copy())
    q, s, mn = (torch.from_numpy(a) for a in kquant.decode_int4(raw, "Q4_K", rows, cols))
    lin, form = kquant.int4_linear(q, s, mn, torch.float32, "o")
    assert form == "int4 exact"
    assert torch.equal(lin.dequantize().view(torch.int32), ref.view(torch.int32))
    x = torch.randn(3, cols)
    torch.testing.assert_close(lin(x), x @ ref.t(), atol=1e-4, rtol=1e-4)


def test_bfloat16_int4_rounds_scale_and_zero_once():
    """bfloat16: the integers unchanged, scale and zero rounded once to bfloat16 (or half, for Q4_1 blocks)."""
    rows, cols = 32, 512
    raw = _random_blocks("Q4_K", rows, cols, seed=2)
    q, s, mn = (torch.from_numpy(a) for a in kquant.decode_int4(raw, "Q4_K", rows, cols))
    lin, form = kquant.int4_linear(q, s, mn, torch.bfloat16, "o")
    z, _ = kquant.zero_of(s, mn)
    if "float16" in form and "bfloat16" not in form:
        expect = q.float() * s.half().float().repeat_interleave(32, 1) + (-mn).half().float().repeat_interleave(32, 1)
    else:
        sb, zb = s.bfloat16().float(), z.bfloat16().float()
        expect = (q.float() - 8) * sb.repeat_interleave(32, 1) + zb.repeat_interleave(32, 1)
    got = lin.dequantize().float()
    torch.testing.assert_close(got, expect.bfloat16().float() if got.dtype != expect.dtype else expect,
                               atol=float(s.abs().max()) * 2 ** -8, rtol=2 ** -8)
    exact = kquant.dequantize(q, s, mn)
    assert (got - exact).abs().max() <= (s.abs().max() * 16 + mn.abs().max()) * 2 ** -7


def test_decode_refuses_other_types_and_sizes():
    with pytest.raises(ValueError, match="Q6_K"):
        kquant.decode_int4(np.zeros(210, np.uint8), "Q6_K", 1, 256)
    with pytest.raises(ValueError, match="bytes"):
        kquant.decode_int4(np.zeros(143, np.uint8), "Q4_K", 1, 256)


def test_held_line():
    h = kquant.Held()
    h.add("int4 exact", ["Q4_K", "Q4_K"])
    h.add("int4 exact", ["Q4_K"])
    h.add("float32", ["Q6_K", "Q4_K"])
    assert h.line() == "float32 (Q4_K+Q6_K) x 1; int4 exact (Q4_K) x 2"


# --------------------------------------------------------------------------- files of llama-quantize


def _tiny_llama():
    """A tiny llama (tests/family_models.py's scaling) whose dims are multiples of the 256-weight super-block."""
    import transformers

    from tests.family_models import VARIANTS, Variant, _hf_config, _scale

    cfg = _hf_config(Variant("llama", {**VARIANTS["llama-plain"].config, "hidden_size": 256,
                                       "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}))
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _scale(model, 3)
    return model


@pytest.fixture(scope="module")
def kfiles(tmp_path_factory):
    """{"F32": path, "Q4_K_M": path, ...} and the transformers model, quantized by llama-quantize."""
    from tests.family_models import write_gguf

    folder = tmp_path_factory.mktemp("kquant")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _tiny_llama()
    f32 = write_gguf(model, str(folder / "f32.gguf"))
    files = {"F32": f32}
    for kind in ("Q4_K_M", "Q5_K_M", "Q6_K", "Q2_K"):
        out = str(folder / f"{kind}.gguf")
        llama_quantize(f32, out, kind)
        files[kind] = out
    return files, model


def _file_weights(path: str) -> dict[str, torch.Tensor]:
    """{HF name: float32 tensor} gguf dequantizes the file to, llama's Q/K rows back in HF order (the inverse
    of convert_hf_to_gguf's permutation, written here)."""
    from tests.family_models import _GGUF_LAYER

    reader = gguf.GGUFReader(path)
    back = {v: k for k, v in _GGUF_LAYER.items() if "qkv_proj" not in k and "gate_up_proj" not in k}  # phi3's fused names
    heads = {"attn_q.weight": 4, "attn_k.weight": 2}
    out = {}
    for t in reader.tensors:
        arr = gguf_dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        name = t.name
        if name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            if rest in heads:
                n = heads[rest]
                arr = arr.reshape(n, arr.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(arr.shape)
            out[f"model.layers.{i}.{back[rest]}"] = torch.from_numpy(np.ascontiguousarray(arr))
        else:
            out[{"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}[name]] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def _types(path: str) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def _engine(path: str, dtype: str = "float32", quantization=None, pinned: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(model_path=path, dtype=dtype, kv_cache_bytes=4 * 2**20, max_num_seqs=4,
                                  max_loras=0, quantization=quantization, quantization_pinned=pinned))


def _held_projection(eng, layer: int, proj: str) -> torch.Tensor:
    lin = getattr(eng.model.layers[layer], proj)
    lin = getattr(lin, "linear", lin)
    return lin.dequantize().float() if hasattr(lin, "dequantize") else lin.weight.float()


_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
_G = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(3, 260, (n,), generator=_G).tolist() for n in (40, 9)]


def _reference_logits(model, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in ref.named_parameters():
            p.copy_(weights[k] if k in weights else weights["model.embed_tokens.weight"])
        return torch.cat([ref(torch.tensor([p])).logits[0].float() for p in PROMPTS])


@needs_quantize
@pytest.mark.parametrize("kind,quant", [("Q4_K_M", "int4"), ("Q5_K_M", "int8"), ("Q6_K", "int8"), ("Q2_K", "int4")])
def test_llama_quantize_files_are_held_at_their_precision(kfiles, kind, quant):
    """Each projection of a llama-quantize file: Q4_K parts (whole projections) held as int4 whose weights equal
    gguf's dequantization bit for bit (float32); all others held dense, equal to it as well (never re-quantized
    under the quantization "auto" resolves to, here passed unpinned); logits against transformers holding the
    dequantized file within the int4 / int8 tolerance (measured: float32 round-off only)."""
    files, model = kfiles
    path = files[kind]
    types = _types(path)
    weights = _file_weights(path)
    eng = _engine(path, quantization=quant)
    print(kind, eng.held)
    for i in range(model.config.num_hidden_layers):
        for proj, parts in _PARTS.items():
            ref = torch.cat([weights[f"model.layers.{i}.{p}.weight"] for p in parts])
            held = _held_projection(eng, i, proj)
            assert torch.equal(held, ref), (kind, i, proj)
            part_types = {types[f"blk.{i}.{kquant.FUSED[proj][k]}.weight"] for k in range(len(parts))}
            lin = getattr(eng.model.layers[i], proj)
            is_int4 = hasattr(getattr(lin, "linear", lin), "dequantize")
            assert is_int4 == (quant == "int4" and part_types <= set(kquant.EXACT_INT4)), (proj, part_types)
    if kind == "Q4_K_M":
        assert "int4 exact (Q4_K) x 6" in eng.held and "float32 (Q4_K+Q6_K) x 1" in eng.held  # layer 1's qkv (Q6_K v)
    ref = _reference_logits(model, weights)
    ours = torch.cat([prefill_logits(eng, p) for p in PROMPTS])
    rel = ((ours - ref).norm() / ref.norm()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{kind}: rel {rel:.2e} top1 {top1:.3f}")
    max_rel, min_top1 = QUANT_TOLERANCES[quant]
    assert rel <= max_rel and top1 >= min_top1


@needs_quantize
def test_pinned_int4_re_quantizes_and_says_so(kfiles):
    """Negative control: ``--quantization int4`` pinned re-quantizes the Q6_K parts (as asked, said in the held
    line); the Q4_K parts stay exact.  The unpinned load holds different (exact) weights, so the comparison
    above can fail."""
    files, _ = kfiles
    path = files["Q4_K_M"]
    weights = _file_weights(path)
    eng = _engine(path, quantization="int4", pinned=True)
    assert "re-quantized" in eng.held and "int4 exact (Q4_K)" in eng.held
    moved = 0.0
    for i in range(2):
        ref = weights[f"model.layers.{i}.mlp.down_proj.weight"]
        moved = max(moved, (_held_projection(eng, i, "down") - ref).abs().max().item())
    assert moved > 1e-4  # a Q6_K ffn_down re-rounded to int4
    # and the engine's own re-quantization of a Q4_K projection (what "auto" did before) is not the file's grid
    from actors.worker.engine.quant import Int4Linear

    q4k = weights["model.layers.0.self_attn.o_proj.weight"]
    assert not torch.equal(Int4Linear(q4k).dequantize(), q4k)


@needs_quantize
def test_bfloat16_q4_k_m_within_tolerance(kfiles):
    """bfloat16 Q4_K_M: int4 integers of the file with scale / zero rounded once; logits within the bf16
    bound (rel 0.08, top1 0.8) of transformers holding the dequantized file in float32."""
    files, model = kfiles
    path = files["Q4_K_M"]
    eng = _engine(path, dtype="bfloat16", quantization="int4")
    assert "int4, scale" in eng.held, eng.held
    ref = _reference_logits(model, _file_weights(path))
    ours = torch.cat([prefill_logits(eng, p) for p in PROMPTS])
    rel = ((ours - ref).norm() / ref.norm()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"bf16 Q4_K_M ({eng.held}): rel {rel:.4f} top1 {top1:.3f}")
    assert rel <= 0.08 and top1 >= 0.8


@needs_quantize
def test_registry_estimate_of_a_q4_k_m_file_is_the_loaded_forms_bytes(kfiles):
    """loaded_bytes (``models register``'s default memory_bytes) against the float32 engine's measured weights
    (no dense copies): within 10 %; the file's own size is far below (its embedding and Q6_K parts are held
    dense)."""
    from actors.worker.engine.loaded_bytes import loaded_bytes

    files, _ = kfiles
    path = files["Q4_K_M"]
    eng = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=4 * 2**20, max_loras=0,
                                 quantization="int4", quantization_pinned=False, quant_dense_copy=False))
    est = loaded_bytes(path, dtype_bytes=4)
    print(eng.held, est, eng.weights_bytes, os.path.getsize(path))
    assert abs(est - eng.weights_bytes) <= 0.1 * eng.weights_bytes
    assert os.path.getsize(path) < 0.5 * eng.weights_bytes
