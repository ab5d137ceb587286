"""Weight-only quantization: the small-step / large-step split and the "auto" choice (quant.py)."""

import pytest
import torch

from actors.worker.engine import cpu_kernels
from actors.worker.engine.model import Linear, packed_linear_factory
from actors.worker.engine.quant import (Int4Linear, Int8Linear, SplitLinear, make_linear_factory,
                                        quantization_for_types)
from actors.worker.engine.quant_blocks import QuantLinear


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_split_uses_the_quantized_kernel_for_few_rows_and_the_dense_copy_above(cls):
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.05
    make = make_linear_factory({"Int8Linear": "int8", "Int4Linear": "int4"}[cls.__name__],
                               lambda weight, name: Linear(weight), dense_above_rows=4)
    lin = make(w, "qkv")
    assert isinstance(lin, SplitLinear) and isinstance(lin.small, cls)
    # the dense copy holds the quantized values, not the original weight
    torch.testing.assert_close(lin.dense.weight, lin.small.dequantize().to(w.dtype))
    calls = []
    lin.small = _Spy(lin.small, "small", calls)
    lin.dense = _Spy(lin.dense, "dense", calls)
    x = torch.randn(8, 64)
    few, many = lin(x[:4]), lin(x)
    assert calls == ["small", "dense"]
    # the same weights either way: rows agree up to the kernels' rounding
    torch.testing.assert_close(few, many[:4], atol=1e-4, rtol=1e-3)


class _Spy:
    def __init__(self, inner, name, calls):
        self.inner, self.name, self.calls = inner, name, calls

    def __call__(self, x):
        self.calls.append(self.name)
        return self.inner(x)


def test_without_a_dense_factory_the_quantized_linear_is_used_alone():
    lin = make_linear_factory("int8")(torch.randn(16, 32), "o")
    assert isinstance(lin, Int8Linear)
    assert make_linear_factory(None) is None


@pytest.mark.skipif(packed_linear_factory(torch.bfloat16, "cpu") is None,
                    reason="oneDNN bf16 pre-packed linear unavailable on this CPU/torch build")
def test_bf16_split_matches_dense_within_bf16_rounding():
    torch.manual_seed(1)
    w = (torch.randn(96, 64) * 0.05).to(torch.bfloat16)
    lin = make_linear_factory("int4", packed_linear_factory(torch.bfloat16, "cpu"))(w, "gate_up")
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    ref = x.float() @ lin.dequantize().float().t()
    for rows in (1, 8, 32):  # int4 kernel up to DENSE_ABOVE_ROWS (8), dense AMX copy above
        got = lin(x[:rows]).float()
        assert ((got - ref[:rows]).norm() / ref[:rows].norm()).item() < 1e-2


@pytest.mark.parametrize("types,expected", [
    (["Q4_1", "Q4_1", "Q6_K"], "int4"),   # any 4-bit projection
    (["Q4_K", "F32"], "int4"),
    (["Q8_0", "Q8_0"], "int8"),
    (["Q5_K", "Q6_K"], "int8"),
    (["F16", "BF16"], None),
    (["F32"], None),
])
def test_auto_quantization_by_gguf_tensor_types(types, expected):
    assert quantization_for_types(types) == expected


_NATIVE = cpu_kernels.load() is not None
_BLOCK = _NATIVE and __import__("actors.worker.engine.quant", fromlist=["x"]).block_quant_enabled()


@pytest.mark.parametrize("flag,dtype,expected", [("none", "bfloat16", None), ("auto", "bfloat16", "int8"),
                                                 ("int4", "bfloat16", "int4"),
                                                 ("auto", "float32", "int8" if _BLOCK else None),
                                                 ("int8", "float32", "int8")])
def test_worker_quantization_flag(tmp_path, flag, dtype, expected):
    """The worker's --quantization reaches the engine; "auto" on the tiny model (F32 projections plus
    one Q8_0 ffn_down) resolves to int8 in bf16, and in float32 too where the native block-quantized
    products load (quant_blocks.QuantLinear; without them torch's int8 kernel loses to dense float32)."""
    import argparse

    from actors.worker.actor import add_arguments, build_engine
    from tests.engine_fixtures import write_tiny_llama_gguf

    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny@1", "--quantization", flag, "--dtype", dtype,
                              "--kv-cache-bytes", str(2**20), "--no-progress"])
    engine = build_engine({"artifact": path, "format": "gguf"}, args)
    assert engine.quantization == expected


# --------------------------------------------------------------------------- AMX int4 (csrc/int4_gemm.cpp)
def _amx_kernels():
    from actors.worker.engine import cpu_kernels

    k = cpu_kernels.load()
    return k if k is not None and k.has_amx else None


needs_amx = pytest.mark.skipif(_amx_kernels() is None, reason="no AMX-BF16 on this CPU, or no C++ compiler")


def test_amx_pack_round_trips():
    from actors.worker.engine.quant import pack_int4_amx, quantize_int4, unpack_int4_amx

    torch.manual_seed(2)
    q, sz = quantize_int4(torch.randn(48, 96).bfloat16())
    qw, szp = pack_int4_amx(q, sz)
    assert qw.shape == (3, 3, 16, 16) and szp.shape == (3, 3, 2, 16)
    q2, sz2 = unpack_int4_amx(qw, szp)
    assert torch.equal(q2, q) and torch.equal(sz2, sz)
    # element e of tile row r is W[n0 + e // 2, k0 + 2r + e % 2] (the VNNI pairing of csrc/int4_gemm.cpp)
    assert qw[1, 2, 5, 3].item() & 15 == q[16 + 1, 64 + 2 * 5 + 1].item()
    assert qw[1, 2, 5, 3].item() >> 4 == q[16 + 8 + 1, 64 + 2 * 5 + 1].item()


@needs_amx
@pytest.mark.parametrize("out_f,in_f", [(96, 64), (48, 1536), (960, 576)])
def test_amx_int4_matches_dense_product_of_its_weights(out_f, in_f):
    from actors.worker.engine.quant import AmxInt4Linear

    torch.manual_seed(3)
    w = (torch.randn(out_f, in_f) * 0.05).bfloat16()
    lin = AmxInt4Linear(w, _amx_kernels())
    # the same quantized values as the packed torch kernel's Int4Linear (bit for bit after bf16 rounding)
    assert torch.equal(lin.dequantize().bfloat16(), Int4Linear(w).dequantize().bfloat16())
    dense = lin.dequantize().bfloat16()
    x = torch.randn(100, in_f).bfloat16()
    for rows in (1, 2, 3, 16, 17, 32, 33, 100):  # 1-2: the AMX-free path; tails padded inside the kernel; 16/32-row blocks read in place
        got = lin(x[:rows]).float()
        ref = torch.nn.functional.linear(x[:rows], dense).float()
        # float32 sums in another order, then one bf16 rounding: within 2 bf16 steps of the output
        assert (got - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()
    strided = x[:, :in_f] if in_f == 64 else torch.randn(8, in_f + 32).bfloat16()[:, :in_f]  # row stride != K
    torch.testing.assert_close(lin(strided).float(), torch.nn.functional.linear(strided, dense).float(),
                               atol=2 ** -7 * 8, rtol=2 ** -7)


@needs_amx
def test_factory_uses_amx_int4_where_it_applies():
    from actors.worker.engine.quant import AmxInt4Linear

    make = make_linear_factory("int4", lambda weight, name: Linear(weight), kernels=_amx_kernels())
    assert isinstance(make(torch.randn(64, 64).bfloat16(), "o"), AmxInt4Linear)
    # float32 model: the AMX path is bf16 only (block products unless ACTORSERVE_BLOCK_QUANT=0)
    assert isinstance(make(torch.randn(64, 64), "o"), QuantLinear if _BLOCK else SplitLinear)
    assert isinstance(make_linear_factory("int4", None)(torch.randn(64, 64).bfloat16(), "o"), Int4Linear)
    assert not AmxInt4Linear.supports(torch.randn(40, 64).bfloat16(), _amx_kernels())  # 40 outputs: not whole tiles
    assert not AmxInt4Linear.supports(torch.randn(64, 48).bfloat16(), _amx_kernels())  # 48 inputs: not whole groups


@needs_amx
def test_amx_int4_refuses_bad_layouts():
    from actors.worker.engine.quant import AmxInt4Linear

    k = _amx_kernels()
    lin = AmxInt4Linear(torch.randn(32, 64).bfloat16(), k)
    with pytest.raises(ValueError, match="int4_linear"):
        k.int4_linear(torch.randn(2, 64), lin.qweight, lin.scale_zeros, torch.empty(2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="packed weight shape"):
        k.int4_linear(torch.randn(2, 96).bfloat16(), lin.qweight, lin.scale_zeros,
                      torch.empty(2, 32, dtype=torch.bfloat16))


@needs_amx
def test_amx_swiglu_epilogue_equals_the_unfused_expression():
    """gate_up packed for the fused SwiGLU: the plain product keeps the [gate; up] column order, and
    ``swiglu`` equals silu_mul of it bit for bit (the same bf16 roundings)."""
    from actors.worker.engine.quant import AmxInt4Linear

    k = _amx_kernels()
    torch.manual_seed(4)
    w = (torch.randn(192, 64) * 0.05).bfloat16()
    fused, plain = AmxInt4Linear(w, k, swiglu=True), AmxInt4Linear(w, k)
    assert fused.fused_swiglu and torch.equal(fused.dequantize(), plain.dequantize())
    for rows in (1, 17, 40):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(fused(x), plain(x))
        assert torch.equal(fused.swiglu(x), k.silu_mul(plain(x)))
    assert isinstance(make_linear_factory("int4", None, kernels=k)(w, "gate_up"), AmxInt4Linear)
    assert make_linear_factory("int4", None, kernels=k)(w, "gate_up").fused_swiglu
    assert not make_linear_factory("int4", None, kernels=k)(w, "qkv").fused_swiglu


@needs_amx
def test_amx_int4_refuses_unsupported_weights_and_takes_empty_batches():
    from actors.worker.engine.quant import AmxInt4Linear

    k = _amx_kernels()
    with pytest.raises(ValueError, match="out % 16"):
        AmxInt4Linear(torch.randn(40, 128).bfloat16(), k)
    with pytest.raises(ValueError, match="out % 32"):
        AmxInt4Linear(torch.randn(48, 128).bfloat16(), k, swiglu=True)
    lin = AmxInt4Linear(torch.randn(32, 64).bfloat16(), k, swiglu=True)
    assert lin(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert lin.swiglu(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 16)
    with pytest.raises(ValueError, match="2-D"):
        k.int4_linear(torch.randn(2, 64).bfloat16(), lin.qweight, lin.scale_zeros, torch.empty(64, dtype=torch.bfloat16))
