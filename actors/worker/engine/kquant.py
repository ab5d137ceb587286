"""GGUF projections held at the file's own precision (issue [23] item 1): 4-bit blocks mapped onto the engine's
int4 groups without re-rounding their integers, other types kept as the float they dequantize to.

Before this module every quantized GGUF was dequantized to float and then re-quantized by ``quant.py`` from the
float's minimum and maximum per 32 inputs: exact for no K-quant, and a Q4_K_M file was rounded twice.  Now,
per projection (the engine's fused ``qkv``, ``o``, ``gate_up``, ``down``) and by the GGUF types of its parts:

* every part Q4_0, Q4_1 or Q4_K, engine quantization int4: the file's own 4-bit integers ``q`` (0..15) with
  one scale ``s`` and one minimum ``mn`` per 32 inputs, ``w = q * s - mn`` (``decode_int4``), become the
  engine's int4 group ``w = (q - 8) * s + z`` with ``z = 8 s - mn``.  On float32 ``s``, ``mn`` and ``z`` are
  exact (Q4_K: ``s = d * sc`` and ``mn = dmin * m`` are products of a half (11 significant bits) and a 6-bit
  integer: 17 bits, exact in float32; ``z`` is checked exact per tensor) and ``Int4Linear``'s weights equal
  ``gguf.quants.dequantize`` bit for bit.  On bfloat16 the engine's kernels hold ``s`` and ``z`` in bfloat16
  (``AmxInt4Linear``, ``Int4Linear``) or half (``QuantLinear``'s Q4_1 blocks): one rounding of scale and zero,
  the integers unchanged.
* otherwise, unless the operator pinned the quantization (``--quantization`` or the manifest's): the
  projection stays dense in the engine dtype: the float the file dequantizes to (float32: exact; bfloat16:
  one rounding per weight).  Q5_K, Q6_K, Q5_0/1 have more bits than int4 and no exact int8 form (the engine's
  int8 is symmetric: Q8_0 blocks or one scale per row), Q2_K/Q3_K and the IQ types are non-uniform per 32.
  A Q8_0 part under int8 keeps the engine's int8 (the Q8_0 blocks of quant_blocks.py hold it exactly; the
  per-row int8 of ``Int8Linear`` does not, and the held line says which).
* pinned: the engine quantizes what is not mapped exactly, as asked, and the held line says "re-quantized".

``Held`` records what each projection became; the runner logs it at start-up and the worker's record
shows it (``holds``, ``actorserve status``).

Block layouts (ggml's ``ggml-common.h``, gguf-py ``gguf/quants.py``, llama.cpp sources unpacked per
docs/bench.md; our own decoding): Q4_0 18 bytes per 32 (half d, 16 bytes: input i < 16 the low nibble of
byte i, i >= 16 the high nibble of byte i - 16; ``w = d (q - 8)``); Q4_1 20 bytes (half d, half m, the same
nibbles; ``w = d q + m``); Q4_K 144 bytes per 256 (half d, half dmin, 12 bytes of eight 6-bit scales and
mins, 128 bytes: sub-block 2c the low and 2c + 1 the high nibbles of bytes 32c..32c+31; ``w = d sc q - dmin m``).
"""

from __future__ import annotations

import logging
import mmap
import struct
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

log = logging.getLogger("actorserve.engine")

GROUP = 32
EXACT_INT4 = ("Q4_0", "Q4_1", "Q4_K", "GPTQ", "AWQ")  # GPTQ / AWQ: hf_quant.HFInt4
# bytes per block and weights per block of the types decode_int4 reads (ggml-common.h)
_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}
_TYPE_IDS = {2: "Q4_0", 3: "Q4_1", 12: "Q4_K"}  # ggml_type ids (ggml.h)
FUSED = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}  # the engine's fused projections (model.py) -> their GGUF tensors, in row order
# types whose re-encoding by the engine's int8 is the file's own (Q8_0 blocks), kept under "auto"
_KEPT_INT8 = ("Q8_0",)


def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block [..., 16] -> 32 integers: the low nibbles, then the high ones (Q4_0 / Q4_1)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def k_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K packed scales uint8 [nb, 12] -> (scales, mins) uint8 [nb, 8], each 6 bits: sub-block j < 4
    the low 6 bits of bytes j and j + 4; j >= 4 the low nibble (scale) / high nibble (min) of byte j + 4 with
    the top 2 bits of byte j - 4 (scale) / byte j (min) above them (ggml ``get_scale_min_k4``)."""
    a, b, c = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def decode_int4(raw: np.ndarray, type_name: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor's bytes (uint8, rows x blocks-per-row x block bytes in file order) ->
    ``q`` uint8 [rows, cols] (0..15), ``scale`` and ``mn`` float32 [rows, cols / 32] with
    ``w = q * scale - mn`` equal, in float32, to ``gguf.quants.dequantize`` bit for bit (each product exact,
    one rounding in the subtraction, as there).  ValueError for another type or a size that does not match."""
    if type_name not in _BLOCK:
        raise ValueError(f"decode_int4: {type_name} is not one of {sorted(_BLOCK)}")
    nbytes, per = _BLOCK[type_name]
    if cols % per or raw.size != rows * cols // per * nbytes:
        raise ValueError(f"decode_int4: {raw.size} bytes are not a {type_name} [{rows}, {cols}] tensor")
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, nbytes)
    if type_name == "Q4_K":
        d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
        sc, m = k_scales(b[:, 4:16])
        qs = b[:, 16:].reshape(-1, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(-1, 256)  # sub-block 2c low, 2c + 1 high
        scale = d[:, None] * sc.astype(np.float32)
        mn = dmin[:, None] * m.astype(np.float32)
    else:
        d = _half(b[:, 0:2])
        q = _nibbles32(b[:, -16:])
        scale = d[:, None]
        mn = (8.0 * d)[:, None] if type_name == "Q4_0" else -_half(b[:, 2:4])[:, None]
    return (q.reshape(rows, cols), scale.reshape(rows, cols // GROUP).astype(np.float32),
            mn.reshape(rows, cols // GROUP).astype(np.float32))


# ------------------------------------------------------------------------------------ GGUF tensor data


def tensor_table(path: str) -> dict[str, tuple[tuple[int, ...], str | int, int, int]]:
    """{name: (dims in torch order [out, in], GGUF type name or id, absolute byte offset, n bytes or -1)} from the
    header of the GGUF at ``path`` (v2/v3, docs/gguf.md of ggml: the data section starts at the header's end
    rounded up to ``general.alignment``, default 32).  Byte sizes are known for the types ``decode_int4``
    reads (-1 for others).  ValueError for a file that is not GGUF v2/v3."""
    import gguf

    from .kernel_choice import _skip_value, _string

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        off, align = 24, 32
        for _ in range(n_kv):
            key, off = _string(buf, off)
            vtype = struct.unpack_from("<I", buf, off)[0]
            if key == "general.alignment" and vtype == 4:
                align = struct.unpack_from("<I", buf, off + 4)[0]
            off = _skip_value(buf, off + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            nd = struct.unpack_from("<I", buf, off)[0]
            dims = struct.unpack_from(f"<{nd}Q", buf, off + 4)
            ttype, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * nd)
            infos.append((name, tuple(int(x) for x in reversed(dims)), ttype, rel))
            off += 4 + 8 * nd + 12
        start = (off + align - 1) // align * align
    out = {}
    for name, dims, ttype, rel in infos:
        try:
            tname: str | int = gguf.GGMLQuantizationType(ttype).name
        except ValueError:
            tname = ttype
        size = -1
        if tname in _BLOCK:
            nbytes, per = _BLOCK[tname]
            size = int(np.prod(dims)) // per * nbytes
        out[name] = (dims, tname, start + rel, size)
    return out


@dataclass
class Held:
    """What the engine holds for each projection: ``counts`` {(form, GGUF types): projections}; ``line()``."""

    counts: Counter = field(default_factory=Counter)

    def add(self, form: str, types) -> None:
        """Count one projection held as ``form`` whose parts have the GGUF / checkpoint ``types``."""
        self.counts[(form, "+".join(sorted(set(types))))] += 1

    def line(self) -> str:
        """``"int4 exact (Q4_K) x 10; bfloat16 (Q4_K+Q6_K) x 2"``; "" when nothing was recorded."""
        return "; ".join(f"{form} ({types}) x {n}" for (form, types), n in sorted(self.counts.items()))


class FileInt4:
    """The int4 parts of a GGUF's projections, read from the file (memory-mapped) when asked for."""

    def __init__(self, path: str, architecture: str, num_heads: int, num_kv_heads: int) -> None:
        self.path, self.arch, self.heads = path, architecture, {"attn_q": num_heads, "attn_k": num_kv_heads}
        self.table = tensor_table(path)

    def types(self, layer: int, proj: str) -> list[str]:
        """GGUF type names of the parts of fused projection ``proj`` of ``layer`` ([] when absent)."""
        names = [f"blk.{layer}.{p}.weight" for p in FUSED[proj]]
        return [str(self.table[n][1]) for n in names if n in self.table]

    def parts(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q uint8 [out, in], scale, mn float32 [out, in / 32]) of the fused projection, its parts' rows
        stacked in ``FUSED`` order, llama's Q/K rows un-permuted (gguf_loader.unpermute_qk)."""
        from .gguf_loader import unpermute_qk

        qs, ss, ms = [], [], []
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for p in FUSED[proj]:
                dims, tname, off, size = self.table[f"blk.{layer}.{p}.weight"]
                raw = np.frombuffer(buf, dtype=np.uint8, count=size, offset=off)
                q, s, m = decode_int4(raw, str(tname), dims[0], dims[1])
                if self.arch == "llama" and p in self.heads:
                    q, s, m = (unpermute_qk(a, self.heads[p]) for a in (q, s, m))
                qs.append(q)
                ss.append(s)
                ms.append(m)
                del raw
        return tuple(torch.from_numpy(np.ascontiguousarray(np.concatenate(a))) for a in (qs, ss, ms))


def head_name(path: str, table: dict | None = None) -> str | None:
    """The GGUF tensor the LM head is read from: ``output.weight``, else the tied ``token_embd.weight``; None
    when the file has neither (or is not a GGUF).  ``table``: the file's ``tensor_table``, when read already."""
    try:
        table = table if table is not None else tensor_table(path)
    except (OSError, ValueError):
        return None
    return next((n for n in ("output.weight", "token_embd.weight") if n in table), None)


def file_q8_0(path: str, name: str, kernels, table: dict | None = None):
    """The GGUF tensor ``name`` [out, in] as a ``QuantLinear`` over the file's own Q8_0 blocks (ggml's block_q8_0:
    one half scale d and 32 int8 q per 34 bytes, ``w = d * q``), exactly; None when the tensor is absent, not
    Q8_0, not 2-D, of a shape the block product cannot take (out % 16, in % 32), or without ``kernels``.
    ``table``: the file's ``tensor_table``, when read already."""
    from .quant_blocks import QuantLinear, pack_blocks

    table = table if table is not None else tensor_table(path)
    if kernels is None or name not in table:
        return None
    dims, tname, off, _ = table[name]
    if tname != "Q8_0" or len(dims) != 2 or dims[0] % 16 or dims[1] % 32:
        return None
    n, k = dims
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        raw = np.frombuffer(buf, dtype=np.uint8, count=n * k // 32 * 34, offset=off).reshape(n, k // 32, 34)
        d = torch.from_numpy(np.ascontiguousarray(raw[..., :2]).view(np.float16).reshape(n, k // 32))
        q = torch.from_numpy(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k))
        del raw
    return QuantLinear.from_packed(pack_blocks((q.to(torch.int16) + 128).to(torch.uint8), d, None, 8), 8, n, kernels)


def dequantize(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Float32 ``q * scale - mn`` per group of 32 inputs: q [out, in], scale / mn [out, in / 32]."""
    return q.float() * scale.repeat_interleave(GROUP, 1) - mn.repeat_interleave(GROUP, 1)


def zero_of(scale: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The engine's zero ``z = 8 s - mn`` (float32) and whether it is exact in float32 (checked in float64)."""
    z64 = 8.0 * scale.double() - mn.double()
    z = z64.float()
    return z, bool(torch.equal(z.double(), z64))


def int4_linear(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, dtype: torch.dtype, name: str,
                kernels=None, dense_factory=None, block_quant: bool | None = None):
    """(linear or None, form) holding the file's integers ``q`` (uint8 [out, in], 0..15) with per-32 ``scale``
    and ``mn`` (float32 [out, in / 32], ``w = q * scale - mn``), in the class ``quant.make_linear_factory``
    would pick for int4 where it holds them exactly:

    * the block product (``QuantLinear``: Q4_1 blocks, half d and m; where ``block_quant_enabled`` and the
      native kernels load): "int4 exact (Q4_1 blocks)" when scale and -mn are exact in half (a Q4_0 / Q4_1
      file), else on bfloat16 "int4 blocks, scale/min in float16" (one rounding);
    * float32 otherwise: ``Int4Linear`` with float32 scale and zero ``8 s - mn``: "int4 exact", or (None,
      "float32 ...") when the zero is not exact in float32 (the caller keeps the projection dense);
    * bfloat16: ``AmxInt4Linear`` where AMX runs, else ``Int4Linear``: scale and zero rounded once to bfloat16.

    The dense copy for many rows follows make_linear_factory's rule (``dense_factory``); ``block_quant`` is
    ``block_quant_enabled``'s ``prefer`` (the measured kernel per row count, row_kernels.py)."""
    from .quant import (AmxInt4Linear, Int4Linear, SplitLinear, _swiglu_order, block_dense_above_rows,
                        block_quant_enabled, pack_int4_amx)
    from .quant_blocks import QuantLinear, pack_blocks

    out_f = q.shape[0]
    probe = SimpleNamespace(shape=tuple(q.shape), dtype=dtype, device=torch.device("cpu"), dim=lambda: 2)  # supports()

    def split(lin, above):
        if dense_factory is None or above is None:
            return lin
        return SplitLinear(lin, dense_factory(lin.dequantize().to(dtype), name), above)

    if dtype == torch.bfloat16 and AmxInt4Linear.supports(probe, kernels):
        z = zero_of(scale, mn)[0]
        lin = AmxInt4Linear.__new__(AmxInt4Linear)
        lin.out_features, lin.kernels = out_f, kernels
        lin.fused_swiglu = name == "gate_up" and out_f % 32 == 0
        qi, sz = q.to(torch.int32), torch.stack([scale.t(), z.t()], dim=-1)
        if lin.fused_swiglu:
            order = _swiglu_order(out_f)
            qi, sz = qi[order], sz[:, order]
        lin.qweight, lin.scale_zeros = pack_int4_amx(qi, sz)
        return lin, "int4, scale/zero in bfloat16"
    d, m = scale.half(), (-mn).half()
    half_exact = bool(torch.equal(d.float(), scale) and torch.equal(m.float(), -mn))
    if (block_quant_enabled(dtype, block_quant) and QuantLinear.supports(probe, kernels) and dtype in (torch.float32, torch.bfloat16)
            and (half_exact or dtype == torch.bfloat16)):
        lin = QuantLinear.from_packed(pack_blocks(q, d, m, 4), 4, out_f, kernels)
        form = "int4 exact (Q4_1 blocks)" if half_exact else "int4 blocks, scale/min in float16"
        return split(lin, block_dense_above_rows(dtype, kernels)), form
    z, exact = zero_of(scale, mn)
    if dtype == torch.float32 and not exact:
        return None, "float32 (int4 zero not exact in float32)"
    lin = Int4Linear.__new__(Int4Linear)
    lin.group, lin.out_features = GROUP, out_f
    lin.scale_zeros = torch.stack([scale.t(), z.t()], dim=-1).contiguous().to(dtype)
    lin._q = q.to(torch.int32).contiguous()
    lin.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(lin._q, 1)
    del lin._q
    form = "int4 exact" if dtype == torch.float32 else f"int4, scale/zero in {str(dtype).removeprefix('torch.')}"
    return split(lin, Int4Linear.DENSE_ABOVE_ROWS), form


def file_precision_factory(make_linear, file: FileInt4, quantization: str | None, dtype: torch.dtype,
                           pinned: bool, kernels=None, dense_factory=None, held: Held | None = None,
                           block_quant: bool | None = None):
    """``make_linear(weight, name)`` for ``LlamaModel`` that holds each projection at the file's precision
    (module docstring).  ``make_linear``: the engine's quantizing factory (``quant.make_linear_factory``,
    or None for dense); the k-th call of a name is layer k's.  Each exact int4 projection is checked equal
    to the float weight it replaces (in the engine dtype); on a mismatch (a sharded or reordered weight)
    the projection stays dense, logged.  ``held`` records the forms; ``block_quant``: as ``int4_linear``'s."""
    from .model import dense_linear_factory

    held = held if held is not None else Held()
    seen: Counter = Counter()
    name_of = str(dtype).removeprefix("torch.")

    def make(weight: torch.Tensor, name: str):
        layer = seen[name]
        seen[name] += 1
        dense = dense_factory or dense_linear_factory(weight.dtype, weight.device.type)
        types = file.types(layer, name) if name in FUSED else []
        if make_linear is None or not types:
            held.add(name_of, types or ["float"])
            return (make_linear or dense)(weight, name)
        # the int4 kernels that take the file's blocks run on CPU (quant.py: other devices dequantize per call)
        if quantization == "int4" and all(t in EXACT_INT4 for t in types) and weight.device.type == "cpu":
            q, s, mn = file.parts(layer, name)
            if tuple(q.shape) == tuple(weight.shape) and torch.equal(dequantize(q, s, mn).to(weight.dtype), weight):
                lin, form = int4_linear(q, s, mn, weight.dtype, name, kernels, dense_factory, block_quant)
                if lin is not None:
                    held.add(form, types)
                    return lin
                held.add(form, types)
                return dense(weight, name)
            log.warning("layer %d %s: the file's int4 blocks do not match the loaded weight: held dense", layer, name)
            held.add(name_of, types)
            return dense(weight, name)
        if pinned:
            lin = make_linear(weight, name)
            held.add(f"{quantization} re-quantized ({type(_inner(lin)).__name__}, asked)", types)
            return lin
        if quantization == "int8" and all(t in _KEPT_INT8 for t in types):
            lin = make_linear(weight, name)
            from .quant_blocks import QuantLinear

            exact = isinstance(_inner(lin), QuantLinear)
            held.add("int8 Q8_0 blocks" if exact else "int8 per row (re-quantized)", types)
            return lin
        held.add(name_of, types)
        return dense(weight, name)

    make.held = held
    return make


def pack_variant(pinned: bool) -> str:
    """The quantized-pack cache's key suffix (weights_cache.PackCache): which projections reach the engine's
    quantizer depends on this module's rules and on ``pinned``."""
    import hashlib
    from pathlib import Path

    return f"-kq{int(pinned)}{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:8]}"


def _inner(lin):
    """The quantized linear inside a ``SplitLinear``."""
    return getattr(lin, "small", lin)
