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
tied LM head, norms and the KV cache stay in the model dtype.  On devices other than CPU the same
quantized values are dequantized per call (correct, not fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUP = 32  # input columns per int4 scale/zero group


class Int8Linear:
    """Weight-only int8 ``y = x @ W^T``; ``weight`` [out, in] float."""

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


class Int4Linear:
    """Weight-only int4 (groups of ``INT4_GROUP`` inputs) ``y = x @ W^T``; ``weight`` [out, in] float."""

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP) -> None:
        out_f, in_f = weight.shape
        if in_f % group:
            raise ValueError(f"int4 needs in_features ({in_f}) divisible by the group size {group}")
        w = weight.float().reshape(out_f, in_f // group, group)
        lo, hi = w.amin(-1), w.amax(-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-8)
        zero = lo + 8.0 * scale  # w ~= (q - 8) * scale + zero
        q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.group = group
        self.out_features = out_f
        self._q = q.reshape(out_f, in_f)
        self.scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(weight.dtype)  # [G, out, 2]
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


QUANTIZERS = {"int8": Int8Linear, "int4": Int4Linear}


def make_linear_factory(quantization: str | None):
    """``make_linear(weight, name)`` for ``LlamaModel``: dense when ``quantization`` is None."""
    if quantization is None:
        return None
    cls = QUANTIZERS[quantization]
    return lambda weight, name: cls(weight)
