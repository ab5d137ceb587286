"""Weight-only quantization: the small-step / large-step split and the "auto" choice (quant.py)."""

import pytest
import torch

from actors.worker.engine.model import Linear, packed_linear_factory
from actors.worker.engine.quant import (Int4Linear, Int8Linear, SplitLinear, make_linear_factory,
                                        quantization_for_types)


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


@pytest.mark.parametrize("flag,dtype,expected", [("none", "bfloat16", None), ("auto", "bfloat16", "int8"),
                                                 ("int4", "bfloat16", "int4"), ("auto", "float32", None),
                                                 ("int8", "float32", "int8")])
def test_worker_quantization_flag(tmp_path, flag, dtype, expected):
    """The worker's --quantization reaches the engine; "auto" on the tiny model (F32 projections plus
    one Q8_0 ffn_down) resolves to int8 in bf16 and to none in float32 (quantized products lose there)."""
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
