"""Block-quantized integer products (csrc/qgemm.cpp, quant_blocks.py) against the same arithmetic in PyTorch.

Every ISA variant this machine can run is built (``cpu_kernels.load_isa``): AVX-512 VNNI, AVX2 (a
build without AVX-512) and portable C++.  Each must equal ``reference_product`` (the same int8
activations and integer dot products, summed in float64) within float32 summation rounding, and
the variants must agree bit for bit (the same float operations in the same order).
"""

import pytest
import torch

from actors.worker.engine import cpu_kernels
from actors.worker.engine.hardware import cpu_flags
from actors.worker.engine.model import Linear
from actors.worker.engine.quant import (BLOCK_DENSE_ABOVE_ROWS, SplitLinear, block_dense_above_rows,
                                        make_linear_factory)
from actors.worker.engine.quant_blocks import (QuantLinear, pack_blocks, quantize_activations, quantize_q4_1,
                                               quantize_q8_0, reference_product, unpack_blocks)

_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512_vnni"}, "avx2": {"avx2", "fma", "f16c"}, "generic": set()}


@pytest.fixture(autouse=True)
def _block_quant_on(monkeypatch):
    """QuantLinear for every dtype (quant.block_quant_enabled: on by default for float32 only): these tests exercise it."""
    monkeypatch.setenv("ACTORSERVE_BLOCK_QUANT", "1")


def _kernels(isa):
    if not _NEEDS[isa] <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(_NEEDS[isa] - cpu_flags())} for the {isa} path")
    k = cpu_kernels.load_isa(isa)
    if k is None:
        pytest.skip("no C++ compiler here: the engine runs its PyTorch path")
    assert k.qgemm_isa == isa  # the build runs the path it was asked for
    return k


ISAS = ["avx512", "avx2", "generic"]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6, 70])  # tails of the 4-row register block; > 64: two row chunks
def test_product_equals_the_reference_arithmetic(isa, bits, dtype, rows):
    k = _kernels(isa)
    torch.manual_seed(rows * 10 + bits)
    w = torch.randn(96, 160) * 0.05  # K / 32 = 5 blocks, 6 tiles of 16 outputs
    lin = QuantLinear(w, bits, k)
    x = torch.randn(rows, 160).to(dtype)
    y = lin(x)
    assert y.dtype == dtype and y.shape == (rows, 96)
    ref = reference_product(x, lin.packed, bits)
    if dtype == torch.float32:  # float32 sums of 5 block terms (+ 5 minimum terms for bits 4)
        torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    else:  # then one bf16 rounding of the output (2^-8 relative)
        torch.testing.assert_close(y.double(), ref.to(dtype).double(), atol=1e-5, rtol=2 ** -7)
    # and the quantized product is close to the float product of the quantized weights
    dense = x.float() @ lin.dequantize().t()
    assert ((y.float() - dense).norm() / dense.norm()).item() < 0.02


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_isa_variants_agree_bit_for_bit(bits, dtype):
    kernels = [cpu_kernels.load_isa(i) for i in ISAS if _NEEDS[i] <= cpu_flags()]
    if len(kernels) < 2 or None in kernels:
        pytest.skip("fewer than two ISA variants can be built and run here")
    torch.manual_seed(1)
    w = torch.randn(64, 576) * 0.05
    x = torch.randn(9, 576).to(dtype)
    outs = [QuantLinear(w, bits, k)(x) for k in kernels]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_pack_round_trips_and_dequantize_matches_the_blocks():
    torch.manual_seed(2)
    w = torch.randn(32, 96)
    q, d = quantize_q8_0(w)
    u, d8, m = unpack_blocks(pack_blocks((q.to(torch.int16) + 128).to(torch.uint8), d, None, 8), 8)
    assert torch.equal(u.to(torch.int16) - 128, q.to(torch.int16)) and torch.equal(d8, d) and m is None
    u4, d4, m4 = quantize_q4_1(w)
    assert int(u4.max()) <= 15
    back = unpack_blocks(pack_blocks(u4, d4, m4, 4), 4)
    assert torch.equal(back[0], u4) and torch.equal(back[1], d4) and torch.equal(back[2], m4)


def test_requantizing_the_files_own_grid_is_exact():
    """Weights already on a Q8_0 (Q4_1) grid, as a dequantized GGUF gives them, keep their values."""
    torch.manual_seed(3)
    d = (torch.rand(16, 3) * 0.01 + 1e-3).half()
    q = torch.randint(-127, 128, (16, 3, 32))
    q[..., 0] = 127  # Q8_0 puts max|w| on +-127
    w8 = (q.float() * d.float()[..., None]).reshape(16, 96)
    assert torch.equal(QuantLinear(w8, 8, None).dequantize(), w8)
    m = (torch.randn(16, 3) * 0.01).half()
    u = torch.randint(0, 16, (16, 3, 32))
    u[..., 0], u[..., 1] = 0, 15  # Q4_1 puts the block's min on 0 and its max on 15
    w4 = (u.float() * d.float()[..., None] + m.float()[..., None]).reshape(16, 96)
    torch.testing.assert_close(QuantLinear(w4, 4, None).dequantize(), w4, atol=0, rtol=2e-7)


def test_activation_quantization_is_symmetric_per_block():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2, 2, 32)
    xq, dx = quantize_activations(x)
    assert xq.shape == (2, 2, 32) and int(xq.abs().max()) == 127
    torch.testing.assert_close(dx[0, 0], torch.tensor(2 / 127))
    assert float(dx[1].abs().sum()) == 0 and int(xq[1].abs().sum()) == 0  # all-zero blocks stay zero


def test_bad_layouts_raise_value_error():
    k = _kernels("generic" if not _NEEDS["avx512"] <= cpu_flags() else "avx512")
    lin = QuantLinear(torch.randn(32, 64), 8, k)
    with pytest.raises(ValueError):
        k.qgemm(torch.randn(2, 96), lin.packed, 8, 32)  # K does not match the packed weight
    with pytest.raises(ValueError):
        k.qgemm(torch.randn(2, 64), lin.packed, 4, 32)  # wrong bits for the layout
    with pytest.raises(ValueError):
        k.qgemm(torch.randn(2, 64).half(), lin.packed, 8, 32)
    with pytest.raises(ValueError):
        QuantLinear(torch.randn(24, 64), 8, k)  # out % 16
    with pytest.raises(ValueError):
        QuantLinear(torch.randn(32, 64), 5, k)
    assert lin(torch.randn(0, 64)).shape == (0, 32)
    x = torch.randn(3, 128)[:, :64]  # row-strided view
    torch.testing.assert_close(lin(x), lin(x.contiguous()))


def test_factory_uses_block_products_per_dtype():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip("no C++ compiler here: the engine runs its PyTorch path")
    w = torch.randn(64, 64) * 0.05
    f32 = make_linear_factory("int8", None, kernels=k)(w, "o")
    assert isinstance(f32, QuantLinear) and f32.bits == 8
    assert isinstance(make_linear_factory("int4", None, kernels=k)(w, "o"), QuantLinear) or k.has_amx
    if not k.has_amx:
        lin = make_linear_factory("int4", lambda weight, name: Linear(weight), kernels=k)(w.bfloat16(), "qkv")
        above = block_dense_above_rows(torch.bfloat16, k)
        assert isinstance(lin, QuantLinear) if above is None else (isinstance(lin, SplitLinear)
                                                                   and lin.max_small_rows == above)
        assert above == (BLOCK_DENSE_ABOVE_ROWS[torch.bfloat16] if "avx512_bf16" in cpu_flags() else None)
    # shapes the kernel cannot take keep the torch path
    assert not isinstance(make_linear_factory("int8", None, kernels=k)(torch.randn(24, 64), "o"), QuantLinear)


def test_select_isa_by_environment(monkeypatch):
    monkeypatch.setenv("ACTORSERVE_ISA", "AVX2")
    assert cpu_kernels.select_isa() == "avx2"
    monkeypatch.setenv("ACTORSERVE_ISA", "sse9")
    with pytest.raises(ValueError, match="ACTORSERVE_ISA"):
        cpu_kernels.select_isa()
    monkeypatch.delenv("ACTORSERVE_ISA")
    assert cpu_kernels.select_isa() in cpu_kernels.ISA_FLAGS
