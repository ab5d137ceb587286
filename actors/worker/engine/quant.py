"""Weight-only quantization of the transformer's projection matrices (``EngineConfig.quantization``).

* ``"int8"``: symmetric per output channel, ``w ~= q * s`` (q int8 in [-127, 127], one scale per
  row); product by ``torch.ops.aten._weight_int8pack_mm`` (x in the model dtype, int8 weight read
  from memory, dequantized in the kernel).  Halves weight bytes against bf16.
* ``"int4"``: asymmetric per group of ``INT4_GROUP`` input columns, ``w ~= (q - 8) * s + z`` (q in
  0..15, scale and zero per group and row); packed by
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` and multiplied by
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (its dequantization convention verified
  numerically in tests/unit/test_engine_quant.py).

Only the per-layer projections (fused QKV, O, fused gate/up, down) are quantized; the embedding /
tied LM head, norms and the KV cache stay in the model dtype (a GGUF's Q8_0 LM head may also be held as its
own blocks for small steps, where measured faster: row_kernels.compose_head).  On devices other than CPU the same
quantized values are dequantized per call (correct, not fast).

Small and large steps (``SplitLinear``): the packed int8/int4 CPU kernels win while a step is bound
by weight bytes (few rows) and lose once it is bound by arithmetic, because they dequantize on the
vector units while dense bf16 runs on AMX.  Measured on this model's four projection shapes x 30
layers, cold weights, 2 threads (ms per pass, bf16 pre-packed / int4 / int8): 1 row 19.6 / 8.1 /
13.9; 8 rows 20.7 / 16.9 / 30.7; 12 rows 21.3 / 21.9 / 34.0; 32 rows 22.9 / 53.3 / 71.0.  So where
the dense kernel runs on matrix units, a dense copy *of the quantized values* (``dequantize()``, so
both paths multiply by the same weights) serves steps of more than ``DENSE_ABOVE_ROWS`` rows.  It
costs the dense bytes in memory on top of the packed ones.

int4 on CPUs with AMX-BF16 (``AmxInt4Linear``, csrc/int4_gemm.cpp) replaces both: one kernel that
dequantizes tile by tile into the AMX tile unit (and, for 1-2 rows, sums x * (q - 8) on the vector
units with the scale factored out), faster than the dense bf16 copy at every row count measured
and without it (0.625 bytes per weight with scales).  ``SplitLinear`` remains for int8 and for
CPUs without AMX.

Without AMX (or for int8 on any CPU), with the native kernels: ``QuantLinear`` (quant_blocks.py,
csrc/qgemm.cpp): GGUF-like Q8_0 (int8) / Q4_1 (int4) blocks of 32 inputs, activations quantized per
row and block to int8, integer dot products on AVX-512 VNNI or AVX2, for float32 and bf16
activations alike (docs/decisions/0027-quantized-products-without-amx.md).  Its crossover against
a dense copy is ``BLOCK_DENSE_ABOVE_ROWS`` (per dtype, measured).

``"auto"`` (``resolve_quantization``; CPU only, where ``quantized_kernels_pay``) follows the GGUF file: projections stored in 4-bit types
(Q4_0, Q4_1, Q4_K, IQ4_*) get ``int4``, 5- to 8-bit types ``int8``, float types none.  For a Q4_1
file the int4 re-encoding is the file's own precision: Q4_1 stores ``w = d * q + m`` per 32
inputs with q in 0..15, exactly this module's group-32 asymmetric form (up to bf16 rounding of the
scale and zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .hardware import cpu_flags
from .quant_blocks import QuantLinear

INT4_GROUP = 32  # input columns per int4 scale/zero group


class Int8Linear:
    """Weight-only int8 ``y = x @ W^T``; ``weight`` [out, in] float."""

    DENSE_ABOVE_ROWS = 4  # crossover against pre-packed bf16 (module docstring)

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        self.qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(weight.dtype)
        self.out_features = weight.shape[0]

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales.to(x.dtype))
        return F.linear(x, self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None])


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of ``weight`` [out, in] per group of ``group`` inputs: ``w ~= (q - 8) * s + z``.

    Returns q int32 [out, in] in 0..15 and scale_zeros [in / group, out, 2] (s, z) in the weight's
    dtype.  Raises ValueError if ``in`` is not a multiple of ``group``."""
    out_f, in_f = weight.shape
    if in_f % group:
        raise ValueError(f"int4 needs in_features ({in_f}) divisible by the group size {group}")
    w = weight.float().reshape(out_f, in_f // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    zero = lo + 8.0 * scale
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(out_f, in_f), torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(weight.dtype)


class Int4Linear:
    """Weight-only int4 (groups of ``INT4_GROUP`` inputs) ``y = x @ W^T``; ``weight`` [out, in] float."""

    DENSE_ABOVE_ROWS = 8  # crossover against pre-packed bf16 (module docstring)

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP) -> None:
        q, self.scale_zeros = quantize_int4(weight, group)
        self.group = group
        self.out_features = weight.shape[0]
        self._q = q
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self._q, 1) if weight.device.type == "cpu" \
            else None
        if self.packed is not None:
            del self._q

    def dequantize(self) -> torch.Tensor:
        """Float weight the kernel multiplies by (for tests and the non-CPU path)."""
        q = self._q if self.packed is None else None
        if q is None:
            eye = torch.eye(self.scale_zeros.shape[0] * self.group, dtype=self.scale_zeros.dtype)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zeros).t().float()
        sz = self.scale_zeros.float()
        scale = sz[..., 0].t().repeat_interleave(self.group, 1)
        zero = sz[..., 1].t().repeat_interleave(self.group, 1)
        return (q.float() - 8.0) * scale + zero

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zeros.to(x.dtype))
        return F.linear(x, self.dequantize().to(x.dtype))


class SplitLinear:
    """``y = x @ W^T`` by ``small`` (a quantized linear) for x of at most ``max_small_rows`` rows, else
    by ``dense`` (a dense linear over ``small.dequantize()`` in the model dtype).  x [rows, in]."""

    def __init__(self, small, dense, max_small_rows: int) -> None:
        self.small, self.dense, self.max_small_rows = small, dense, max_small_rows
        self.out_features = small.out_features

    def dequantize(self) -> torch.Tensor:
        return self.small.dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= self.max_small_rows else self.dense(x)


def pack_int4_amx(q: torch.Tensor, scale_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int [N, K] (0..15) and scale_zeros [K / 32, N, 2] -> the AMX tile layout of csrc/int4_gemm.cpp.

    Returns qweight uint8 [N/16, K/32, 16, 16] (tile row r, byte j: element j | element j + 16 << 4,
    element e = W[n0 + e // 2, k0 + 2 r + e % 2], the VNNI pairing TDPBF16PS reads) and scale_zeros
    bfloat16 [N/16, K/32, 2, 16] (the tile's 16 column scales, then zeros).  Needs N % 16 == 0 and
    groups of 32."""
    N, K = q.shape
    t = q.reshape(N // 16, 16, K // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(N // 16, K // 32, 16, 32)
    qweight = (t[..., :16] | (t[..., 16:] << 4)).to(torch.uint8).contiguous()
    sz = scale_zeros.permute(1, 0, 2).reshape(N // 16, 16, K // 32, 2).permute(0, 2, 3, 1)
    return qweight, sz.to(torch.bfloat16).contiguous()


def unpack_int4_amx(qweight: torch.Tensor, scale_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_int4_amx``: q int32 [N, K] and scale_zeros bfloat16 [K / 32, N, 2]."""
    nb, kb = qweight.shape[:2]
    t = torch.cat([qweight & 15, qweight >> 4], dim=-1).to(torch.int32)  # [nb, kb, 16, 32]
    q = t.reshape(nb, kb, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(nb * 16, kb * 32)
    sz = scale_zeros.permute(0, 3, 1, 2).reshape(nb * 16, kb, 2).permute(1, 0, 2)
    return q, sz.contiguous()


class AmxInt4Linear:
    """Weight-only int4 (Int4Linear's quantization) on AMX: ``y = x @ W^T`` for x bf16 [rows, in].

    One kernel for every row count (csrc/int4_gemm.cpp): the packed weight (0.625 bytes per
    weight with its scales, against 2 for bf16) is dequantized tile by tile into the exact bf16
    values of ``dequantize()`` and multiplied on the tile unit, so no dense copy is kept; 1-2 rows
    skip AMX (group scale factored out of the sum, see the kernel).  Measured on this model's four
    projection shapes x 30 layers, cold weights, 2 threads, one process (ms per pass, this /
    pre-packed bf16 of the same values): 1 row 7.6 / 21.7; 8 rows 11.3 / 23.6; 32 rows 14.0 /
    27.0; 64 rows 19.9 / 30.7; 512 rows 90.1 / 106.3; 2048 rows ~340 / ~260
    (docs/decisions/0006-engine-speed.md).  ``swiglu=True`` (the fused [gate; up] weight) orders
    the rows so that ``swiglu(x)`` applies SwiGLU in the product's epilogue.  Needs
    ``kernels.has_amx``, out and in multiples of 16 and 32 (``supports``)."""

    def __init__(self, weight: torch.Tensor, kernels, swiglu: bool = False) -> None:
        if not self.supports(weight, kernels) or (swiglu and weight.shape[0] % 32):
            raise ValueError(f"AmxInt4Linear: weight {tuple(weight.shape)} needs out % {32 if swiglu else 16} == 0, "
                             "in % 32 == 0, in <= 16384 and CPU kernels with AMX")
        q, sz = quantize_int4(weight, INT4_GROUP)  # the kernel's K tile is one group of 32
        self.out_features = weight.shape[0]
        self.fused_swiglu = swiglu  # weight = [gate; up]: ``swiglu(x)`` gives silu(x W_g^T) * (x W_u^T)
        if swiglu:  # rows in strips of 16 gate then the 16 matching up rows (csrc/int4_gemm.cpp)
            order = _swiglu_order(self.out_features)
            q, sz = q[order], sz[:, order]
        self.qweight, self.scale_zeros = pack_int4_amx(q, sz)
        self.kernels = kernels

    @staticmethod
    def supports(weight: torch.Tensor, kernels) -> bool:
        """True for a CPU weight [out, in] with out % 16 == 0, in % 32 == 0 and kernels with AMX."""
        out_f, in_f = weight.shape
        return (kernels is not None and kernels.has_amx and weight.device.type == "cpu" and out_f % 16 == 0
                and in_f % 32 == 0 and in_f <= 16384)

    def _unswizzle(self, t: torch.Tensor) -> torch.Tensor:
        """Rows (dim 0) of the swiglu strip order back to [gate; up]."""
        if not self.fused_swiglu:
            return t
        return t.view(t.shape[0] // 32, 2, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def dequantize(self) -> torch.Tensor:
        """Float32 weight [out, in] the kernel multiplies by (before its bf16 rounding)."""
        q, sz = unpack_int4_amx(self.qweight, self.scale_zeros)
        sz = sz.float()
        w = (q.float() - 8.0) * sz[..., 0].t().repeat_interleave(32, 1) + sz[..., 1].t().repeat_interleave(32, 1)
        return self._unswizzle(w)

    def _product(self, x: torch.Tensor, swiglu: bool) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features // (2 if swiglu else 1), dtype=torch.bfloat16)
        if x.shape[0]:
            self.kernels.int4_linear(x if x.stride(-1) == 1 else x.contiguous(), self.qweight, self.scale_zeros, out,
                                     swiglu=swiglu)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self._product(x, swiglu=False)
        return self._unswizzle(out.t()).t() if self.fused_swiglu else out

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the fused [gate; up] product in the kernel's epilogue: x bf16 [rows, in] ->
        bf16 [rows, out / 2], equal to ``silu_mul(self(x))`` (the same bf16 roundings; subnormal
        results are flushed to zero by VCVTNEPS2BF16)."""
        return self._product(x, swiglu=True)


def _swiglu_order(out_features: int) -> torch.Tensor:
    """Row order of a [gate; up] weight in strips of 16 gate rows and the 16 matching up rows."""
    return torch.arange(out_features).view(2, out_features // 32, 16).transpose(0, 1).reshape(-1)


QUANTIZERS = {"int8": Int8Linear, "int4": Int4Linear}

# GGUF tensor types of the projections -> the quantizer that keeps their precision ("auto").
_AUTO_4BIT = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "GPTQ", "AWQ"}  # GPTQ / AWQ: hf_loader.tensor_types
_AUTO_8BIT = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}


def quantization_for_types(type_names) -> str | None:
    """``"auto"``: int4 if any projection is 4-bit, else int8 if any is 5- to 8-bit, else None."""
    names = set(type_names)
    if names & _AUTO_4BIT:
        return "int4"
    if names & _AUTO_8BIT:
        return "int8"
    return None


# Steps of more rows than this use a dense copy of the quantized values (where the engine offers a
# dense kernel: bf16 on CPU) instead of QuantLinear; None = QuantLinear at every row count.  Measured
# per dtype in docs/decisions/0027-quantized-products-without-amx.md (AMD EPYC, AVX512-BF16, no AMX:
# one core, ms per pass of the 4 projection shapes x 30 layers, dense bf16 / Q8_0 / Q4_1 block
# products: 64 rows 39.5 / 41.8 / 40.9, 128 rows 67.5 / 78.2 / 80.2, 512 rows 258 / 276 / 277).
# The bf16 entry holds where bf16 products run natively (AVX512-BF16); without it dense bf16 is
# emulated and the block products win at every row count (None).
BLOCK_DENSE_ABOVE_ROWS = {torch.bfloat16: 64, torch.float32: None}
AMX_BLOCK_DENSE_ABOVE_ROWS = 4  # bf16 on AMX: dense tiles win early (Int8Linear's measured crossover)


def block_dense_above_rows(dtype: torch.dtype, kernels) -> int | None:
    """The crossover for ``QuantLinear`` of a ``dtype`` model on this CPU (see the table above)."""
    if dtype == torch.bfloat16:
        if kernels is not None and kernels.has_amx:
            return AMX_BLOCK_DENSE_ABOVE_ROWS
        return BLOCK_DENSE_ABOVE_ROWS[dtype] if "avx512_bf16" in cpu_flags() else None
    return BLOCK_DENSE_ABOVE_ROWS.get(dtype)
BLOCK_BITS = {"int8": 8, "int4": 4}


def block_quant_enabled(dtype: torch.dtype | str = torch.float32, prefer: bool | None = None) -> bool:
    """Whether ``QuantLinear`` (the block-quantized integer products) serves a ``dtype`` model's
    quantized projections.  ``ACTORSERVE_BLOCK_QUANT=1`` / ``0`` forces it on / off; unset, ``prefer`` decides
    where given (the engine's measured kernel per row count, engine/row_kernels.py), else it is on for
    float32 models (where torch's packed kernels with float32 activations lose to dense float32: the
    "int8 trap") and off for bfloat16 (torch's packed int4/int8 with bf16 activations stay).

    Dynamic int8 activations make outputs sensitive to rounding: a 1e-6 relative change of the input
    (a prompt prefilled whole vs from a prefix-cache hit) moves the logits by the quantization noise
    itself (1-3 % relative, up to 1.0 absolute on SmolLM2-135M), as in llama.cpp, so greedy continuations
    can differ between the two at near-ties.  Each stays within the per-quantization tolerance against
    transformers (tests/unit/test_engine_q8_logits.py); docs/decisions/0027-quantized-products-without-amx.md."""
    import os

    forced = os.environ.get("ACTORSERVE_BLOCK_QUANT", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if prefer is not None:
        return prefer
    return str(dtype).removeprefix("torch.") == "float32"


def _native_quant_kernels():
    from . import cpu_kernels  # noqa: PLC0415 (builds at first use)

    return cpu_kernels.load()


def quantized_kernels_pay(dtype: str, device: str) -> bool:
    """True where the quantized products beat dense ones on small steps: on CPU, for bfloat16
    always, and for float32 where the native block-quantized kernels load (``QuantLinear``)."""
    if not device.startswith("cpu"):
        return False
    return dtype == "bfloat16" or (dtype == "float32" and block_quant_enabled(dtype) and _native_quant_kernels() is not None)


def resolve_quantization(name: str | None, model_path: str, dtype: str = "bfloat16", device: str = "cpu",
                         reader=None, types: list[str] | None = None) -> str | None:
    """``name`` unchanged unless ``"auto"``: then by the GGUF projection tensor types (module docstring),
    where ``quantized_kernels_pay``.  Elsewhere the quantized products are slower than dense ones
    (torch's packed kernels with float32 activations: one 3072x576 product at 2 rows took 5.97 ms
    int4 / 2.19 ms int8 against 0.34 ms dense; non-CPU devices dequantize per call), so "auto" means
    none there. ``reader``: an open
    ``gguf.GGUFReader`` of ``model_path`` (parsing one costs seconds: the engine opens the file once);
    ``types``: the GGUF type names of the projection tensors, when known (no file read then)."""
    if name != "auto":
        return name
    if not quantized_kernels_pay(dtype, device):
        return None
    if types is not None:  # the projection tensor types, read already (weights_cache.Artifact)
        return quantization_for_types(types)
    import gguf

    reader = reader if reader is not None else gguf.GGUFReader(model_path)
    types = [t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith(
        ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
         "ffn_up.weight", "ffn_down.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"))]
    return quantization_for_types(types)


def make_linear_factory(quantization: str | None, dense_factory=None, dense_above_rows: int | None = None,
                        kernels=None, block_quant: bool | None = None):
    """``make_linear(weight, name)`` for ``LlamaModel``; None (dense) when ``quantization`` is None.

    int4 with ``kernels`` (cpu_kernels.CpuKernels) that have AMX, on bf16 CPU weights of supported
    shapes: ``AmxInt4Linear`` for every row count.  Else, with ``kernels`` and a supported CPU
    weight (``QuantLinear.supports``): ``QuantLinear`` (Q8_0 / Q4_1 blocks, integer products), wrapped
    in a ``SplitLinear`` over a dense copy of its values above ``dense_above_rows`` rows (default
    ``block_dense_above_rows`` of the weight's dtype on this CPU) when ``dense_factory`` is
    given.  Otherwise (no kernels) torch's packed int8/int4: with ``dense_factory``
    (``make_linear(weight, name)`` of the dense kernel), each quantized projection is a
    ``SplitLinear`` with a dense copy of its quantized values, used above ``dense_above_rows`` rows
    (default: the quantizer's measured ``DENSE_ABOVE_ROWS``).  ``block_quant``: ``block_quant_enabled``'s
    ``prefer`` (None: its default for the dtype)."""
    if quantization is None:
        return None
    cls = QUANTIZERS[quantization]
    rows = cls.DENSE_ABOVE_ROWS if dense_above_rows is None else dense_above_rows

    def split(q, weight: torch.Tensor, name: str, above):
        if dense_factory is None or above is None:
            return q
        return SplitLinear(q, dense_factory(q.dequantize().to(weight.dtype), name), above)

    def make(weight: torch.Tensor, name: str):
        if quantization == "int4" and weight.dtype == torch.bfloat16 and AmxInt4Linear.supports(weight, kernels):
            return AmxInt4Linear(weight, kernels, swiglu=name == "gate_up" and weight.shape[0] % 32 == 0)
        if (block_quant_enabled(weight.dtype, block_quant) and QuantLinear.supports(weight, kernels)
                and weight.dtype in BLOCK_DENSE_ABOVE_ROWS):
            above = block_dense_above_rows(weight.dtype, kernels) if dense_above_rows is None else dense_above_rows
            return split(QuantLinear(weight, BLOCK_BITS[quantization], kernels), weight, name, above)
        return split(cls(weight), weight, name, rows)
    return make
