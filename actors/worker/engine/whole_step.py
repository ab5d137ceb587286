"""The whole-step decode path (issue [24] item 3; csrc/decode_step.cpp; decision 0053 "Stop 49").

A decode step of up to :data:`MAX_ROWS` rows on the native CPU path makes about nine native calls a layer
(model.py ``LlamaModel._layers_native``: residual add + RMSNorm, QKV, RoPE + K/V write, paged attention, output
projection, residual add + RMSNorm, gate/up, SwiGLU, down), each wrapped in Python: argument checks, tensor
allocations and ctypes conversions, ~270 calls and ~1-2 ms of host time a token at one row. Here the whole
layer loop is **one** native call (``actorserve_decode_layers``) on scratch buffers allocated once, with the
layers' pointers (norm weights, block packs, KV cache) in a ctypes array built once per row count and KV cache.
It runs the same kernels in the same order -- the four products by the block-product build the row table picked
for the step's row count (row_kernels.py), passed as function pointers -- so its logits are bit-identical to
``_layers_native`` (tests/unit/test_whole_step.py, and against transformers within the dtype's tolerance).

Where it runs: the plain Llama layer (``LlamaModel`` itself with the dense MLP: Llama, SmolLM2, Mistral, Qwen3
without QK-norm...), float32 or bfloat16, every projection a block product at that row count, one rank. Per step:
every row a decode (no prefill chunk), no LoRA row. Anything else takes ``_layers_native`` (the per-call path),
and the torch path stays the reference of both. ``attach`` says why not in :attr:`WholeStepDecode.reason` and
the worker's record (``actorserve status``: "whole-step decode: 1-8 rows" or "off: why").

On CUDA the same seam -- one capture of a fixed-shape decode step over preallocated buffers -- is where CUDA graphs
go (issue [26]; docs/engine.md "Whole-step decode").
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

MAX_ROWS = 8  # decode steps of up to this many rows take the whole-step call (issue [24] item 3: "~8")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Proj(ctypes.Structure):
    """csrc/decode_step.cpp ``DecodeProj``."""

    _fields_ = [("fn", _P), ("w", _P), ("bits", _I32), ("n", _I32)]


class _LayerPtrs(ctypes.Structure):
    """csrc/decode_step.cpp ``DecodeLayer``."""

    _fields_ = [("attn_norm", _P), ("ffn_norm", _P), ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj),
                ("down", _Proj), ("k_cache", _P), ("v_cache", _P)]


class _Step(ctypes.Structure):
    """csrc/decode_step.cpp ``DecodeStep``."""

    _fields_ = [(n, _I32) for n in ("T", "d", "H", "Hkv", "hd", "f", "bs", "window")] + \
               [("eps", _F32), ("scale", _F32)] + \
               [(n, _P) for n in ("pos", "slots", "cos", "sin", "rows", "tables")] + [("table_stride", _I64)] + \
               [(n, _P) for n in ("lens", "qkv", "attn", "x", "gu", "act", "delta")]


PROJS = ("qkv", "o", "gate_up", "down")


def block_product(lin, rows: int):
    """The block-product ``QuantLinear`` that ``lin`` runs for a step of ``rows`` rows (through a
    ``RowKernelLinear``'s table, or ``lin`` itself), or None when that is another kernel."""
    from .quant_blocks import QuantLinear
    from .row_kernels import RowKernelLinear

    if isinstance(lin, RowKernelLinear):
        lin = next((fn for level, fn in zip(lin._levels, lin._by_rows) if rows <= level), lin.built)
    if not isinstance(lin, QuantLinear) or not isinstance(getattr(lin.kernels, "_qgemm", None), ctypes._CFuncPtr):
        return None  # torch / AMX / dense, or a native entry a test wrapped in Python
    return lin


class WholeStepDecode:
    """One model's whole-step decode (module docstring). Build with :func:`attach`; :meth:`run` per step."""

    def __init__(self, model, kernels) -> None:
        cfg = model.config
        self.model, self.kernels = model, kernels
        self.dtype = model.embed.dtype
        self.H, self.Hkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.d, self.f = cfg.hidden_size, cfg.ffn_size
        self.nqkv = (self.H + 2 * self.Hkv) * self.hd
        widths = {"qkv": self.nqkv, "attn": self.H * self.hd, "x": self.d, "gu": 2 * self.f, "act": self.f,
                  "delta": self.d}
        self.buffers = {k: torch.empty(MAX_ROWS, w, dtype=self.dtype) for k, w in widths.items()}
        self._layers: dict[int, Any] = {}  # rows -> ctypes array of _LayerPtrs (None: not covered)
        self._gaps: dict[int, str] = {}  # rows -> why a step of that many rows is not covered
        self._cache_of = None  # the KV cache tensor the arrays point into
        b = self.buffers  # the step's fields that do not change between steps, set once
        self._step = _Step(d=self.d, H=self.H, Hkv=self.Hkv, hd=self.hd, f=self.f, eps=cfg.rms_eps,
                           scale=self.hd ** -0.5, qkv=b["qkv"].data_ptr(), attn=b["attn"].data_ptr(),
                           x=b["x"].data_ptr(), gu=b["gu"].data_ptr(), act=b["act"].data_ptr(),
                           delta=b["delta"].data_ptr())
        self._fn = kernels._decode_layers
        self.steps = 0  # steps run here

    # ---- coverage --------------------------------------------------------------------------------------
    def covered_rows(self) -> list[int]:
        """Row counts 1..MAX_ROWS whose every projection is a block product."""
        return [n for n in range(1, MAX_ROWS + 1) if self._gap(n) is None]

    def _gap(self, rows: int) -> str | None:
        if rows not in self._gaps:
            self._gaps[rows] = next((f"at {rows} row(s) layer {i}'s {p} projection is not a block-quantized product "
                                     f"({type(getattr(lw, p)).__name__}: a dense or torch-quantized path)"
                                     for i, lw in enumerate(self.model.layers) for p in PROJS
                                     if block_product(getattr(lw, p), rows) is None), None)
        return self._gaps[rows]

    def line(self) -> str:
        """``"1-8 rows"`` (what status shows), or why no row count is covered."""
        rows = self.covered_rows()
        if not rows:
            return f"off: {self._gap(1)}"
        spans, start = [], rows[0]
        for a, b in zip(rows, rows[1:] + [None]):
            if b != a + 1:
                spans.append(f"{start}-{a}" if a > start else f"{a}")
                start = b
        return f"{', '.join(spans)} row{'s' if rows != [1] else ''}"

    # ---- the step ----------------------------------------------------------------------------------------
    def _array(self, rows: int, kv_cache: torch.Tensor):
        """The layers' pointers for a step of ``rows`` rows into ``kv_cache`` (built once per row count and
        cache tensor; the tensors it points at are the model's and the cache's, alive as long as they are)."""
        if self._cache_of is not kv_cache:
            self._layers, self._cache_of = {}, kv_cache
        arr = self._layers.get(rows)
        if arr is None:
            arr = (_LayerPtrs * len(self.model.layers))()
            for i, lw in enumerate(self.model.layers):
                projs = {p: block_product(getattr(lw, p), rows) for p in PROJS}
                arr[i] = _LayerPtrs(lw.attn_norm.data_ptr(), lw.ffn_norm.data_ptr(),
                                    *(_Proj(ctypes.cast(q.kernels._qgemm, _P).value, q.packed.data_ptr(), q.bits,
                                            q.out_features) for q in projs.values()),
                                    kv_cache[i][0].data_ptr(), kv_cache[i][1].data_ptr())
            self._layers[rows] = arr
        return arr

    def run(self, h: torch.Tensor, meta, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Every layer on ``h`` [T, d] (updated in place and returned) when the step qualifies (module
        docstring), else None (the caller runs the per-call path). RuntimeError when the native call refuses
        its shapes (a bug: the checks here let only the shapes it runs through)."""
        T = h.shape[0]
        plan = meta.plan
        if (T > MAX_ROWS or meta.lora is not None or plan is None or not plan.all_decode or plan.native is None
                or h.dtype != self.dtype or self._gap(T) is not None):
            return None
        n, s, rope = plan.native, self._step, self.model.rope
        s.T, s.bs, s.window = T, kv_cache.shape[3], n.window
        s.pos, s.slots = meta.positions.data_ptr(), meta.slot_mapping.data_ptr()
        s.cos, s.sin = rope.cos.data_ptr(), rope.sin.data_ptr()  # a dynamic RoPE may replace its tables
        s.rows, s.tables, s.table_stride, s.lens = (n.rows.data_ptr(), n.tables.data_ptr(), n.tables.stride(0),
                                                    n.lens.data_ptr())
        layers = self._array(T, kv_cache)
        rc = self._fn(_DTYPES[self.dtype], h.data_ptr(), len(layers), layers, ctypes.byref(s))
        if rc:
            raise RuntimeError(f"whole-step decode: the native call refused its shapes (code {rc})")
        self.steps += 1
        return h


def attach(model, one_rank: bool, enabled: bool = True) -> tuple[WholeStepDecode | None, str]:
    """(the model's whole-step decode or None, the status line). Sets ``model.whole_step``. ``one_rank``: not
    tensor parallel; ``enabled``: EngineConfig.whole_step (``ACTORSERVE_WHOLE_STEP=0`` turns it off too)."""
    from .model import DenseMlp, LlamaModel

    model.whole_step = None
    kernels = getattr(model, "kernels", None)
    why = ("turned off (ACTORSERVE_WHOLE_STEP=0)" if os.environ.get("ACTORSERVE_WHOLE_STEP", "1") == "0"
           else "turned off (EngineConfig.whole_step)" if not enabled
           else "no native kernels" if kernels is None or not hasattr(kernels, "_decode_layers")
           else "tensor parallel" if not one_rank
           else f"{type(model).__name__} layers (only the plain Llama layer)" if type(model) is not LlamaModel
           else "a mixture-of-experts or other MLP" if not isinstance(getattr(model, "mlp", None), DenseMlp)
           else f"dtype {model.embed.dtype}" if model.embed.dtype not in _DTYPES
           else "per-layer windows, a scaled or capped attention" if (
               model.config.layer_windows or model.config.query_pre_attn_scalar or model.config.attn_softcap)
           else None)
    if why is not None:
        return None, f"off: {why}"
    ws = WholeStepDecode(model, kernels)
    line = ws.line()
    if ws.covered_rows():
        model.whole_step = ws
    return model.whole_step, line
