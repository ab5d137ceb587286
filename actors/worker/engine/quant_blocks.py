"""Block-quantized projections for CPUs without AMX: GGUF-like Q8_0 / Q4_1 weights, int8 activations.

``QuantLinear`` stores a projection in blocks of 32 inputs, as GGUF's Q8_0 and Q4_1 types do
(ggml's block formats: one half-precision scale, and for Q4_1 a half minimum, per 32 weights):

* bits 8 (``quantize_q8_0``): ``W = d * q``, q int8 in [-127, 127], ``d = max|w| / 127`` per block:
  1.0625 bytes per weight.
* bits 4 (``quantize_q4_1``): ``W = d * u + m``, u in 0..15, ``m = min w``, ``d = (max - min) / 15``:
  0.625 bytes per weight.  This is Int4Linear's asymmetric grid (``m = z - 8 s``), in half precision.

For a GGUF file whose projections are Q8_0 (Q4_1) and that was dequantized exactly into the model
dtype, re-quantizing finds the file's own block values again (up to the half rounding of d and m).
The product (csrc/qgemm.cpp, ``CpuKernels.qgemm``) quantizes each activation row per 32-block to
int8 (``dx = max|x| / 127``) and sums integer dot products (AVX-512 VNNI ``VPDPBUSD``; AVX2
``VPMADDUBSW``); ``reference_product`` is the same arithmetic in PyTorch (tests).
"""

from __future__ import annotations

import torch

BLOCK = 32  # inputs per block (GGUF's QK8_0 / QK4_1)
TILE = 16  # outputs per packed tile (one VPDPBUSD result)
BLOCK_BYTES = {8: 544, 4: 320}  # per tile and block: weights, then 16 half d (and 16 half m for bits 4)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if k % BLOCK or n % TILE:
        raise ValueError(f"block quantization needs out % {TILE} == 0 and in % {BLOCK} == 0, got {n}x{k}")
    return weight.float().reshape(n, k // BLOCK, BLOCK)


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> q int8 [N, K] and d float16 [N, K / 32] with ``W ~= d * q``.

    The scale is rounded to half first and q computed against the rounded scale.  Raises
    ValueError unless N % 16 == 0 and K % 32 == 0."""
    w = _blocks(weight)
    d = (w.abs().amax(-1) / 127.0).half()
    df = d.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(weight.shape), d


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> u uint8 [N, K] in 0..15, d and m float16 [N, K / 32], ``W ~= d * u + m``.

    d and m are rounded to half first and u computed against them.  Raises ValueError unless
    N % 16 == 0 and K % 32 == 0."""
    w = _blocks(weight)
    lo, hi = w.amin(-1), w.amax(-1)
    d, m = ((hi - lo) / 15.0).half(), lo.half()
    df, mf = d.float(), m.float()
    inv = torch.where(df > 0, 1.0 / df, torch.zeros_like(df))
    u = torch.round((w - mf[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return u.reshape(weight.shape), d, m


def _half_bytes(h: torch.Tensor) -> torch.Tensor:
    """float16 [N, KB] -> uint8 [N / 16, KB, 32] (16 halves of one tile and block)."""
    n, kb = h.shape
    return h.reshape(n // TILE, TILE, kb).permute(0, 2, 1).contiguous().view(torch.uint8)


def pack_blocks(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Weight bytes (u uint8 [N, K]: q + 128 for bits 8, the nibble for bits 4) and half scales ->
    the tile layout of csrc/qgemm.cpp: uint8 [N / 16, K / 32, BLOCK_BYTES[bits]]."""
    n, k = u.shape
    g = u.reshape(n // TILE, TILE, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [nt, kb, group, row, 4]
    if bits == 8:
        body = g.reshape(n // TILE, k // BLOCK, 512)
        parts = [body, _half_bytes(d)]
    else:
        body = (g[:, :, :4] | (g[:, :, 4:] << 4)).reshape(n // TILE, k // BLOCK, 256)
        parts = [body, _half_bytes(d), _half_bytes(m)]
    return torch.cat([p.to(torch.uint8) for p in parts], dim=-1).contiguous()


def unpack_blocks(packed: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inverse of ``pack_blocks``: u uint8 [N, K], d float16 [N, K / 32], m float16 or None."""
    nt, kb, _ = packed.shape
    qb = 512 if bits == 8 else 256
    body = packed[..., :qb]
    if bits == 4:
        c = body.reshape(nt, kb, 4, TILE, 4)
        body = torch.cat([c & 15, c >> 4], dim=2)  # groups 0-3, then 4-7
    u = body.reshape(nt, kb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(nt * TILE, kb * BLOCK)

    def halves(off: int) -> torch.Tensor:
        raw = packed[..., off:off + 2 * TILE].contiguous().view(torch.float16)  # [nt, kb, 16]
        return raw.permute(0, 2, 1).reshape(nt * TILE, kb)
    return u.contiguous(), halves(qb), halves(qb + 32) if bits == 4 else None


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization: x [M, K] -> xq int32 [M, K / 32, 32] (int8 values)
    and dx float32 [M, K / 32], ``dx = max|x| / 127``, ``xq = round_half_even(x * (1 / dx))``."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    dx = xb.abs().amax(-1) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(xb * inv[..., None]).to(torch.int32), dx


def reference_product(x: torch.Tensor, packed: torch.Tensor, bits: int) -> torch.Tensor:
    """csrc/qgemm.cpp's result computed in float64 from the same integers: x [M, K] -> [M, N] float64
    (the kernel sums the per-block terms in float32, so it differs by float32 rounding only)."""
    u, d, m = unpack_blocks(packed, bits)
    xq, dx = quantize_activations(x)
    n, k = u.shape
    ub = u.to(torch.int64).reshape(n, k // BLOCK, BLOCK)
    wq = ub - 128 if bits == 8 else ub
    dots = torch.einsum("mbk,nbk->mnb", xq.to(torch.int64), wq).double()  # exact integer dots
    y = (dots * dx.double()[:, None, :] * d.double()[None]).sum(-1)
    if bits == 4:
        sx = dx.double() * xq.sum(-1).double()  # [M, KB]
        y = y + sx @ m.double().t()
    return y


class QuantLinear:
    """``y = x @ W^T`` with W block-quantized (``bits`` 8: Q8_0 form, 4: Q4_1 form) and the native
    integer product (``kernels.qgemm``).  ``weight`` [out, in] float, out % 16 == 0, in % 32 == 0;
    x [rows, in] float32 or bfloat16 -> [rows, out] in x's dtype."""

    def __init__(self, weight: torch.Tensor, bits: int, kernels) -> None:
        if bits == 8:
            q, d = quantize_q8_0(weight)
            self.packed = pack_blocks((q.to(torch.int16) + 128).to(torch.uint8), d, None, 8)
        elif bits == 4:
            self.packed = pack_blocks(*quantize_q4_1(weight), 4)
        else:
            raise ValueError(f"QuantLinear: bits must be 4 or 8, got {bits}")
        self.bits, self.kernels, self.out_features = bits, kernels, weight.shape[0]

    @classmethod
    def from_packed(cls, packed: torch.Tensor, bits: int, out_features: int, kernels) -> "QuantLinear":
        """A QuantLinear over an existing pack (uint8 [out / 16, in / 32, BLOCK_BYTES[bits]], as
        ``pack_blocks`` lays it out), e.g. from the quantized-pack cache.  ValueError on a shape that
        does not match ``bits`` and ``out_features``."""
        if bits not in BLOCK_BYTES or packed.dtype != torch.uint8 or packed.dim() != 3 \
                or packed.shape[0] * TILE != out_features or packed.shape[2] != BLOCK_BYTES[bits]:
            raise ValueError(f"QuantLinear.from_packed: pack {tuple(packed.shape)} {packed.dtype} does not hold "
                             f"{out_features} outputs of bits {bits}")
        self = cls.__new__(cls)
        self.packed, self.bits, self.kernels, self.out_features = packed.contiguous(), bits, kernels, out_features
        return self

    @staticmethod
    def supports(weight: torch.Tensor, kernels) -> bool:
        """True for a CPU weight [out, in] with out % 16 == 0 and in % 32 == 0, given kernels."""
        return (kernels is not None and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % TILE == 0 and weight.shape[1] % BLOCK == 0)

    def dequantize(self) -> torch.Tensor:
        """Float32 weight [out, in] of the quantized values."""
        u, d, m = unpack_blocks(self.packed, self.bits)
        n, k = u.shape
        ub = u.float().reshape(n, k // BLOCK, BLOCK)
        if self.bits == 8:
            return ((ub - 128.0) * d.float()[..., None]).reshape(n, k)
        return (ub * d.float()[..., None] + m.float()[..., None]).reshape(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fn = self.__dict__.get("_product")
        if fn is None or fn.packed is not self.packed:  # built on first use (from_packed skips __init__)
            fn = self._product = self.kernels.qgemm_bound(self.packed, self.bits, self.out_features)
        return fn(x if x.stride(-1) == 1 else x.contiguous())
