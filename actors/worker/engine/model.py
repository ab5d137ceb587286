"""Llama forward pass over a flat packed batch of tokens with a paged KV cache.

The batch is the concatenation of token chunks from many sequences (prefill chunks of any length
and 1-token decodes mixed in one forward; no padding).  Per sequence ``s`` the chunk holds
``query_lens[s]`` tokens at positions ``context_lens[s] - query_lens[s] .. context_lens[s] - 1``.

Algorithms (sources): RMSNorm (Zhang & Sennrich 2019), RoPE with the Hugging Face ``rotate_half``
layout (Su et al. 2021; ``transformers.models.llama.modeling_llama``), grouped-query attention
(Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), paged KV cache (Kwon et al. 2023, PagedAttention).

Speed choices (docs/decisions/0006-engine-speed.md):
* Q, K and V projections are one fused matrix, gate and up one fused matrix: 2 matmuls fewer per
  layer and larger products for the matrix units.  Projections go through ``Linear`` objects so a
  weight-only quantized matrix (``quant.py``) is a drop-in replacement.
* RoPE tables are gathered once per step; Q and K are rotated in one call.
* Attention reads only the KV blocks a sequence owns, gathered block-wise from the paged cache by
  the sequence's block table.  Decodes (1-token queries) are grouped by context length (a group
  is padded only to its own longest member, at most ``DECODE_PAD_SLACK`` extra) and each group is
  one ``scaled_dot_product_attention`` call.  GQA: the query heads of one KV head are folded into
  the query-length axis (``[B, Hkv, G, hd]``), so K/V are never repeated.  A prefill chunk with no
  cached prefix attends to its own fresh K/V with ``is_causal`` (no cache read at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import arch_spec, cpu_kernels
from .arch_spec import ModelConfig
from .lora_slots import LoraBatch
from .rope import longrope_inv_freq, scale_tables

# A decode group may pad its members' contexts by at most this many blocks beyond the shortest.
DECODE_PAD_SLACK = 4


@dataclass
class BatchMetadata:
    """Per-step batch description; tensors on the model device, int64.

    ``positions`` [T]: position of each packed token.
    ``slot_mapping`` [T]: flat KV slot (block * block_size + offset) where token t's K/V is written.
    ``context_slots``: legacy [sum(context_lens)] flat slots of every context; used only to derive
    block tables when ``block_tables`` is None.
    ``query_lens`` / ``context_lens``: python ints per sequence (tokens in this step / in cache after it).
    ``logits_indices`` [S']: token rows (in the packed batch) whose logits are wanted.
    ``block_tables``: per sequence, its physical block ids (at least ``ceil(context_len / bs)``).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_slots: torch.Tensor | None
    query_lens: list[int]
    context_lens: list[int]
    logits_indices: torch.Tensor
    block_tables: list[list[int]] | None = None
    plan: "_AttnPlan | None" = field(default=None, repr=False)
    lora: "LoraBatch | None" = None  # LoRA adapters of the step's rows (lora.py); None = base model only


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [B] packed-token rows
    blocks: torch.Tensor  # [B, nblk] block ids (padding repeats a valid id)
    mask: torch.Tensor | None  # [B, 1, 1, nblk*bs] bool (True = real key), None if no padding
    in_order: bool = False  # rows == 0..B-1 (outputs need no scatter)


@dataclass
class _Prefill:
    q_start: int
    q_len: int
    ctx_len: int
    blocks: torch.Tensor | None  # [nblk] when the chunk follows a cached prefix, else None
    mask: torch.Tensor | None  # [q_len, nblk*bs] bool when blocks is not None


@dataclass
class _NativeDecodes:
    """Every decode of the step for the native kernel (cpu_kernels.paged_decode_attention)."""

    rows: torch.Tensor  # int32 [S] packed-token rows of the decodes
    tables: torch.Tensor  # int32 [S, max_blocks] block tables (padding after a table's end is never read)
    lens: torch.Tensor  # int32 [S] context lengths (tokens in cache, the new one included)
    window: int = 0  # sliding window (tokens; 0 = none): keys at positions >= lens - window


@dataclass
class _AttnPlan:
    decodes: list[_DecodeGroup]
    prefills: list[_Prefill]
    all_decode: bool  # every token is a decode (output rows = token rows, no scatter)
    native: _NativeDecodes | None = None  # set instead of ``decodes`` when the native kernel runs them


def _block_tables_from_slots(meta: BatchMetadata, bs: int) -> list[list[int]]:
    slots, tables, k = meta.context_slots.tolist(), [], 0
    for n in meta.context_lens:
        tables.append([s // bs for s in slots[k : k + n : bs]])
        k += n
    return tables


def _native_decodes(dec: list, device) -> _NativeDecodes:
    width = max(m[0] for m in dec)
    tables = torch.tensor([m[3] + [0] * (width - m[0]) for m in dec], dtype=torch.int32, device=device)
    return _NativeDecodes(torch.tensor([m[2] for m in dec], dtype=torch.int32, device=device), tables,
                          torch.tensor([m[1] for m in dec], dtype=torch.int32, device=device))


def build_plan(meta: BatchMetadata, block_size: int, device, native: bool = False,
               window: int | None = None) -> _AttnPlan:
    """Group decodes by context length (or, ``native``, hand them all to the native kernel) and
    describe each prefill chunk (once per step). ``window`` (tokens): sliding-window attention, a query at
    position p sees keys at positions p - window + 1 .. p (transformers' ``sliding_window_overlay``)."""
    tables = meta.block_tables if meta.block_tables is not None else _block_tables_from_slots(meta, block_size)
    dec, prefills, q_start = [], [], 0
    for i, (q_len, ctx_len) in enumerate(zip(meta.query_lens, meta.context_lens)):
        nblk = -(-ctx_len // block_size)
        if q_len == 1:
            dec.append((nblk, ctx_len, q_start, tables[i][:nblk]))
        elif q_len == ctx_len:
            prefills.append(_Prefill(q_start, q_len, ctx_len, None, _window_mask(q_len, q_len, window, device)))
        else:
            blocks = torch.tensor(tables[i][:nblk], device=device)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
            mask = torch.arange(nblk * block_size, device=device).unsqueeze(0) <= q_pos
            if window:
                mask &= torch.arange(nblk * block_size, device=device).unsqueeze(0) > q_pos - window
            prefills.append(_Prefill(q_start, q_len, ctx_len, blocks, mask))
        q_start += q_len
    if native and dec:
        native_dec = _native_decodes(dec, device)
        native_dec.window = window or 0
        return _AttnPlan([], prefills, all_decode=not prefills, native=native_dec)
    groups = []
    dec.sort(key=lambda d: d[0])
    start = 0
    while start < len(dec):
        end = start
        while end < len(dec) and dec[end][0] - dec[start][0] <= DECODE_PAD_SLACK:
            end += 1
        members = dec[start:end]
        nblk = members[-1][0]
        rows = torch.tensor([m[2] for m in members], device=device)
        blocks = torch.tensor([m[3] + [m[3][0]] * (nblk - m[0]) for m in members], device=device)
        lens = [m[1] for m in members]
        mask = None
        if any(n != nblk * block_size for n in lens) or (window and max(lens) > window):
            ar = torch.arange(nblk * block_size, device=device)
            mask = (ar.unsqueeze(0) < torch.tensor(lens, device=device).unsqueeze(1))[:, None, None, :]
            if window:  # keys at positions >= len - window
                mask &= (ar.unsqueeze(0) >= torch.tensor(lens, device=device).unsqueeze(1) - window)[:, None, None, :]
        in_order = [m[2] for m in members] == list(range(len(members)))
        groups.append(_DecodeGroup(rows, blocks, mask, in_order))
        start = end
    return _AttnPlan(groups, prefills, all_decode=not prefills)


def _window_mask(q_len: int, ctx_len: int, window: int | None, device) -> torch.Tensor | None:
    """Bool [q_len, ctx_len] causal sliding-window mask of a fresh chunk (True = attend); None when the window
    does not bind (no window, or the chunk is no longer than it: plain causal attention)."""
    if not window or ctx_len <= window:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    keys = torch.arange(ctx_len, device=device).unsqueeze(0)
    return (keys <= q_pos) & (keys > q_pos - window)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 then cast back: ``x / sqrt(mean(x^2) + eps) * weight`` (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    """Precomputed RoPE cos/sin tables [max_positions, head_dim] (float32), HF half-split layout.
    ``inv_freq`` [head_dim / 2]: the scaled frequencies of a spec (arch_spec.rope_inv_freq); default plain RoPE."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: str,
                 inv_freq: torch.Tensor | None = None) -> None:
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for ``positions`` [T]."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def tables_for(self, meta: "BatchMetadata") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] of a step's tokens (static tables: by position alone)."""
        return self.tables(meta.positions)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim]; computed in float32, returned in x's dtype."""
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim] by ``positions`` [T]; computed in float32."""
        return self.rotate(x, *self.tables(positions))


class DynamicRotary(RotaryEmbedding):
    """Dynamic NTK RoPE (arch_spec.dynamic_inv_freq): a token of a sequence that holds ``n`` tokens after this
    step is rotated with the frequencies for length ``n``, as transformers' ``dynamic_rope_update`` does for a
    prefill of ``n`` tokens and for each decode (its cache keeps keys rotated at their own step). Batch
    invariant: a token's frequencies depend on its own sequence only. Within the original length the static
    table is used; the model runs on the torch path (arch_spec.native_unsupported)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: str) -> None:
        super().__init__(config.head_dim, config.rope_theta, max_positions, device, arch_spec.base_inv_freq(config))
        self.config, self.device = config, device

    def tables_for(self, meta: "BatchMetadata") -> tuple[torch.Tensor, torch.Tensor]:
        if max(meta.context_lens) <= self.config.rope_original_max_positions:
            return self.tables(meta.positions)
        lens = torch.tensor(meta.context_lens, dtype=torch.int64)
        inv = arch_spec.dynamic_inv_freq(self.config, lens)  # [S, hd/2]
        per_token = inv.repeat_interleave(torch.tensor(meta.query_lens), dim=0).to(self.device)  # [T, hd/2]
        freqs = meta.positions.float().unsqueeze(1) * per_token
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()


class BiasedLinear:
    """``linear(x) + bias``: a projection with a bias (Qwen2's Q/K/V), around any dense or quantized projection."""

    def __init__(self, linear, bias: torch.Tensor) -> None:
        self.linear, self.bias, self.out_features = linear, bias, linear.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).add_(self.bias)


class Linear:
    """``y = x @ W^T`` with a dense weight [out, in] (quantized variants live in quant.py)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class PackedLinear(Linear):
    """Dense ``y = x @ W^T`` with the weight pre-packed once into oneDNN's blocked layout (CPU bf16).

    Measured against ``F.linear`` on this model's shapes (bf16): 2-3x faster at 1 row, 1.4-1.7x at
    32 rows, equal at 512 (oneDNN otherwise re-packs the plain weight on every call).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.weight = None  # the plain copy is not kept

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")


def packed_linear_factory(dtype: torch.dtype, device: str):
    """``make_linear(weight, name)`` building ``PackedLinear`` for bf16 on CPU with oneDNN (checked by
    a trial product), or None where that kernel is unavailable."""
    if device == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        try:
            w = torch.randn(8, 32, dtype=dtype)
            x = torch.randn(2, 32, dtype=dtype)
            if torch.allclose(PackedLinear(w)(x).float(), F.linear(x, w).float(), atol=1e-2):
                return lambda weight, name: PackedLinear(weight)
        except (RuntimeError, AttributeError):  # op missing in this build
            pass
    return None


def dense_linear_factory(dtype: torch.dtype, device: str):
    """``PackedLinear`` for bf16 on CPU with oneDNN (``packed_linear_factory``), else ``Linear``."""
    return packed_linear_factory(dtype, device) or (lambda weight, name: Linear(weight))


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: Linear  # [(H + 2 Hkv) * hd, d]
    o: Linear  # [d, H * hd]
    gate_up: Linear  # [2 ffn, d]
    down: Linear  # [d, ffn]
    q_norm: torch.Tensor | None = None  # [hd] per-head query RMSNorm (qk_norm specs)
    k_norm: torch.Tensor | None = None  # [hd]


class DenseMlp:
    """The dense MLP part of a model (``LlamaModel.MLP``): SwiGLU over a fused gate/up and a down projection, with
    the step's LoRA deltas (torch path; the native path runs the same expressions in C++). Mixture-of-experts
    models use moe.py's ``MoeMlp`` in its place, through the same two calls."""

    def __init__(self, config) -> None:
        self.config = config

    def fields(self, w, make_linear, layer: int) -> dict:
        """The ``_Layer`` fields of layer ``layer``'s MLP from its weights (``w(name)`` pops one): ``gate_up``
        ([2f, d]) and ``down`` ([d, f]) built by ``make_linear(weight, name)``."""
        return {"gate_up": make_linear(torch.cat([w("w_gate"), w("w_up")]), "gate_up"),
                "down": make_linear(w("w_down"), "down")}

    def __call__(self, lw: _Layer, x: torch.Tensor, meta: BatchMetadata, layer: int) -> torch.Tensor:
        """The MLP's output [T, d] for the normed hidden states ``x`` [T, d]."""
        gu = _adapted(lw.gate_up, x, meta.lora, layer, "gate_up")
        f = gu.shape[-1] // 2
        return _adapted(lw.down, F.silu(gu[:, :f]) * gu[:, f:], meta.lora, layer, "down")


class LlamaModel:
    """Stateless-weights Llama: ``forward(ids, meta, kv_cache) -> logits`` [S', vocab] float32.

    ``make_linear(weight, name)`` builds each projection (default: dense ``Linear``); the engine
    passes a quantizing factory for weight-only int8/int4.

    The architecture spec (arch_spec.ModelConfig) is resolved here, once: Q/K/V biases wrap the fused QKV
    projection (``BiasedLinear``), scaled RoPE is the cos/sin tables (``rope_inv_freq``; dynamic NTK:
    ``DynamicRotary``), a tied head is the embedding. Per-head q/k norms need ``QkNormModel``. A spec the
    native kernels do not cover runs the torch path; ``native_off_reason`` says why (``actorserve status``).
    """

    MLP = DenseMlp  # the MLP part's class (model families with another MLP name theirs)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 make_linear=None, native_kernels: bool = True) -> None:
        self.config = config
        self.embed = weights["embed"]
        self.norm = weights["norm"]
        self.dtype = self.embed.dtype
        device = str(self.embed.device)
        dense = dense_linear_factory(self.dtype, device)
        make_linear = make_linear or dense
        self.lm_head = Linear(weights["lm_head"])  # plain: [V, d] @ h^T for many rows unless packed (forward)
        self.lm_head_1 = dense(weights["lm_head"], "lm_head")  # packed where possible
        # the head's product runs through lm_head_1 at every row count (kept when row_kernels wraps lm_head_1)
        self.head_packed = isinstance(self.lm_head_1, PackedLinear)
        if config.qk_norm and not isinstance(self, QkNormModel):
            raise ValueError("a qk_norm spec needs QkNormModel (model_families.build_model picks it)")
        self.mlp = self.MLP(config)  # the MLP part (DenseMlp; moe.py's MoeMlp for mixtures of experts)
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            w = lambda n: weights.pop(f"layers.{i}.{n}")  # noqa: E731
            qkv = make_linear(torch.cat([w("wq"), w("wk"), w("wv")]), "qkv")
            if config.qkv_bias:
                qkv = BiasedLinear(qkv, torch.cat([w("bq"), w("bk"), w("bv")]).contiguous())
            self.layers.append(_Layer(
                attn_norm=w("attn_norm"), ffn_norm=w("ffn_norm"),
                qkv=qkv,
                o=make_linear(w("wo"), "o"),
                **self.mlp.fields(w, make_linear, i),
                q_norm=w("q_norm") if config.qk_norm else None,
                k_norm=w("k_norm") if config.qk_norm else None,
            ))
        if config.rope_scaling == "dynamic":
            self.rope = DynamicRotary(config, max_positions, device)
        elif config.rope_scaling == "longrope":  # one static table, long factors when serving past the original
            self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, device,  # (rope.py)
                                        longrope_inv_freq(config, max_positions))
            scale_tables(self.rope, config.rope_attention_factor)
        else:
            self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, device,
                                        arch_spec.rope_inv_freq(config))
        self.num_groups = config.num_heads // config.num_kv_heads
        # C++ kernels (cpu_kernels.py, built at first use) for decode attention on the paged cache
        # and the fused small ops, where they apply; None = the PyTorch path.
        self.kernels = None
        self.whole_step = None  # whole_step.attach sets it where small decode steps run in one native call
        self.native_off_reason = arch_spec.native_unsupported(config) if native_kernels else None
        if native_kernels and self.native_off_reason is None and cpu_kernels.CpuKernels.supports(self.dtype, device):
            self.kernels = cpu_kernels.load()
        # Fresh-prefill attention on AMX (csrc/prefill_attention.cpp): bf16, head_dim 64.
        self.amx_prefill = (self.kernels is not None and self.kernels.has_amx and self.dtype == torch.bfloat16
                            and config.head_dim == 64 and config.sliding_window is None)  # plain causal only
        if (self.kernels is not None and self.kernels.has_amx and self.dtype == torch.bfloat16
                and config.head_dim == 64 and config.sliding_window is not None):  # said in `actorserve status`
            self.native_off_reason = "fresh prefill on SDPA: the AMX prefill kernel has no sliding-window mask"

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run all layers on ``input_ids`` [T]; write K/V into ``kv_cache`` (see kv_cache.py layout).

        Returns float32 logits [len(meta.logits_indices), vocab].
        """
        cfg = self.config
        if meta.plan is None:
            meta.plan = build_plan(meta, kv_cache.shape[3], input_ids.device, self.kernels is not None,
                                   cfg.sliding_window)
        h = F.embedding(input_ids, self.embed)
        if self.kernels is not None:  # a small all-decode step: every layer in one native call (whole_step.py)
            whole = self.whole_step.run(h, meta, kv_cache) if self.whole_step is not None else None
            h = whole if whole is not None else self._layers_native(h, meta, kv_cache)
        else:
            cos, sin = self.rope.tables_for(meta)
            for layer, lw in enumerate(self.layers):
                h = h + self._attention(lw, h, meta, kv_cache[layer], cos, sin, layer)
                x = rms_norm(h, lw.ffn_norm, cfg.rms_eps)
                h = h + self.mlp(lw, x, meta, layer)
        h = rms_norm(h[meta.logits_indices], self.norm, cfg.rms_eps)
        if h.shape[0] > 1 and not self.head_packed:
            # [V, d] @ [d, S]: measured 1.7x faster than x @ W^T for the 49152x576 head at S=32..64
            return (self.lm_head.weight @ h.t()).t().float()
        # Pre-packed (bf16): faster at every row count, and its [S, V] output is contiguous, which the
        # greedy max needs (over the transposed mm output it took 3.4 ms at 32 rows, not 0.55).
        # Head + float + max measured 3.7 / 5.3 ms against 6.6 / 16.6 ms for the mm path at 32 / 64 rows.
        return self.lm_head_1(h).float()

    def _layers_native(self, h: torch.Tensor, meta: BatchMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layer loop of ``forward`` on the C++ kernels: the same expressions (residual adds, RMSNorm,
        RoPE, K/V write, SwiGLU), one call each.  ``h`` [T, d] (a fresh tensor) is updated in place."""
        cfg, nk = self.config, self.kernels
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T, delta = h.shape[0], None
        # Host overhead (docs/decisions/0030): the per-layer cache views are built once per KV tensor, the
        # attention output is one buffer for every layer (lw.o reads it before the next layer writes it),
        # and K/V views are made only when a prefill needs them: ~10 fewer torch calls per layer.
        caches = self._layer_caches(kv_cache)
        out = h.new_empty(T, H * hd)
        out3 = out.view(T, H, hd)
        lora = meta.lora
        fuse_swiglu = lora is None or not lora.adapts("gate_up")
        for i, (lw, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            qkv = _adapted(lw.qkv, nk.add_rms_norm(h, delta, lw.attn_norm, cfg.rms_eps), lora, i, "qkv")  # h += MLP
            nk.rope_kv(qkv, H, Hkv, hd, meta.positions, self.rope.cos, self.rope.sin, meta.slot_mapping,
                       k_cache, v_cache)
            q = (qkv.as_strided((T, H, hd), (qkv.stride(0), hd, 1)) if qkv.stride(1) == 1
                 else qkv[:, : H * hd].view(T, H, hd))
            k = v = None
            if meta.plan.prefills or meta.plan.decodes:
                k = qkv[:, H * hd : (H + Hkv) * hd].view(T, Hkv, hd)
                v = qkv[:, (H + Hkv) * hd :].view(T, Hkv, hd)
            attn = _adapted(lw.o, self._paged_attention(q, k, v, meta.plan, (k_cache, v_cache), out3).view(T, H * hd),
                            lora, i, "o")
            x = nk.add_rms_norm(h, attn, lw.ffn_norm, cfg.rms_eps)  # h += attention output
            gate_up = lw.gate_up
            act = (gate_up.swiglu(x) if fuse_swiglu and getattr(gate_up, "fused_swiglu", False)
                   else nk.silu_mul(_adapted(gate_up, x, lora, i, "gate_up")))
            delta = _adapted(lw.down, act, lora, i, "down")
        return h if delta is None else h.add_(delta)

    def _attention(self, lw: _Layer, h: torch.Tensor, meta: BatchMetadata, cache: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Self-attention block; ``cache`` [2, num_blocks, block_size, Hkv, hd] for this layer."""
        cfg = self.config
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = h.shape[0]
        qkv = _adapted(lw.qkv, rms_norm(h, lw.attn_norm, cfg.rms_eps), meta.lora, layer, "qkv")
        qk = self.rope.rotate(qkv[:, : (H + Hkv) * hd].view(T, H + Hkv, hd), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * hd :].view(T, Hkv, hd)
        return self._store_and_attend(lw, q, k, v, meta, cache, layer)

    def release_kv(self) -> None:
        """Drop the per-layer views of the KV cache kept between steps, so that a cache being replaced (a resize,
        a sleep: actors/worker/sleep.py) is freed at once; the next forward makes them again."""
        self._caches, self._caches_of = [], None

    def _layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) views [num_blocks, bs, Hkv, hd] of every layer of ``kv_cache``, made once per cache tensor."""
        if getattr(self, "_caches_of", None) is not kv_cache:
            self._caches = [(c[0], c[1]) for c in kv_cache]
            self._caches_of = kv_cache
        return self._caches

    def _store_and_attend(self, lw: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata,
                          cache: torch.Tensor, layer: int) -> torch.Tensor:
        """Write this step's K / V rows ([T, Hkv, hd]) into the paged ``cache`` ([2, blocks, block, Hkv, hd]) at
        ``meta.slot_mapping``, attend with ``q`` ([T, H, hd]) and apply the output projection: [T, hidden]."""
        T, H, hd = q.shape
        k_flat = cache[0].view(-1, k.shape[1], hd)
        v_flat = cache[1].view(-1, v.shape[1], hd)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        out = self._paged_attention(q, k, v, meta.plan, cache)
        return _adapted(lw.o, out.reshape(T, H * hd), meta.lora, layer, "o")

    def _paged_attention(self, q, k, v, plan: _AttnPlan, cache, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention. q [T, H, hd]; fresh k/v [T, Hkv, hd] (None when ``plan`` has only native
        decodes) -> [T, H, hd], written into ``out`` when given. ``cache``: this layer's
        [2, num_blocks, bs, Hkv, hd] tensor or its (K, V) pair."""
        H, Hkv, hd, G = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim, self.num_groups
        k_blocks, v_blocks = cache[0], cache[1]  # [num_blocks, bs, Hkv, hd]
        if plan.all_decode and len(plan.decodes) == 1 and plan.decodes[0].in_order:
            g = plan.decodes[0]
            return self._decode_group(q, g, k_blocks, v_blocks, rows_all=True)
        out = torch.empty_like(q) if out is None else out
        if plan.native is not None:
            n = plan.native
            self.kernels.paged_decode_attention(q, out, k_blocks, v_blocks, n.rows, n.tables, n.lens, hd ** -0.5,
                                                n.window)
        for g in plan.decodes:
            out[g.rows] = self._decode_group(q, g, k_blocks, v_blocks, rows_all=False)
        for p in plan.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.blocks is None and p.mask is not None:  # a sliding window binds within the chunk
                out[rows] = self._windowed_prefill(q[rows], k[rows], v[rows], p.mask)
            elif p.blocks is None:
                out[rows] = self._fresh_prefill(q[rows], k[rows], v[rows])
            else:
                out[rows] = self._prefill_after_prefix(q[rows], p, k_blocks, v_blocks)
        return out

    def _fresh_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a chunk with no cached prefix: q [n, H, hd], k/v [n, Hkv, hd] -> [n, H, hd].

        4-D inputs with K/V repeated per query group and ``is_causal``: SDPA's CPU flash kernel (3-D
        inputs or enable_gqa fall back to the math path: 12x slower for a 2048-token prompt; folding
        the group into the query axis needs an explicit mask: 1.4x / 2.4x slower at 512 / 2048).
        Where ``amx_prefill`` holds, the AMX flash kernel instead (K/V read once per group, no
        repeat): 0.90 ms against 1.46 ms per layer at 512 tokens (docs/decisions/0006)."""
        if self.amx_prefill and q.dtype == k.dtype == v.dtype == torch.bfloat16 and k.stride(0) == v.stride(0) \
                and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v)):
            return self.kernels.prefill_attention(q, k, v, q.shape[2] ** -0.5)
        G = self.num_groups
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        ks = k.to(q.dtype).repeat_interleave(G, dim=1).transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        vs = v.to(q.dtype).repeat_interleave(G, dim=1).transpose(0, 1).unsqueeze(0)
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1)

    def _windowed_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A fresh chunk under a sliding window: q [n, H, hd], k/v [n, Hkv, hd], ``mask`` bool [n, n] -> [n, H, hd].
        GQA folded into the query axis as ``_prefill_after_prefix``."""
        Hkv, hd, G = self.config.num_kv_heads, self.config.head_dim, self.num_groups
        n = q.shape[0]
        ks = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, hd]
        vs = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
        qs = q.reshape(n, Hkv, G, hd).permute(1, 0, 2, 3).reshape(1, Hkv, n * G, hd)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.repeat_interleave(G, 0))
        return o[0].view(Hkv, n, G, hd).permute(1, 0, 2, 3).reshape(n, Hkv * G, hd)

    def _prefill_after_prefix(self, q: torch.Tensor, p: _Prefill, k_blocks, v_blocks) -> torch.Tensor:
        """A chunk following cached blocks (prefix-cache hit, later chunk of a chunked prefill).

        q [n, H, hd] -> [n, H, hd].  GQA by folding the query group into the query axis
        (``[1, Hkv, n*G, hd]`` against un-repeated K/V ``[1, Hkv, L, hd]``, mask rows repeated per
        group): same result as repeating K/V, measured 0.66 ms against 1.76 ms per layer for 64
        queries over 1,088 keys (bf16)."""
        Hkv, hd, G = self.config.num_kv_heads, self.config.head_dim, self.num_groups
        n, L = q.shape[0], p.blocks.shape[0] * k_blocks.shape[1]
        ks = k_blocks.index_select(0, p.blocks).view(L, Hkv, hd).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vs = v_blocks.index_select(0, p.blocks).view(L, Hkv, hd).to(q.dtype).transpose(0, 1).unsqueeze(0)
        qs = q.reshape(n, Hkv, G, hd).permute(1, 0, 2, 3).reshape(1, Hkv, n * G, hd)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask.repeat_interleave(G, 0))
        return o[0].view(Hkv, n, G, hd).permute(1, 0, 2, 3).reshape(n, Hkv * G, hd)

    def _decode_group(self, q, g: _DecodeGroup, k_blocks, v_blocks, rows_all: bool) -> torch.Tensor:
        """1-token queries of one group against their gathered blocks -> [B, H, hd]."""
        Hkv, hd, G = self.config.num_kv_heads, self.config.head_dim, self.num_groups
        B, nblk = g.blocks.shape
        L = nblk * k_blocks.shape[1]
        qg = (q if rows_all else q[g.rows]).reshape(B, Hkv, G, hd)
        flat = g.blocks.view(-1)  # index_select: ~2.5x faster than advanced indexing here
        ks = k_blocks.index_select(0, flat).view(B, L, Hkv, hd).transpose(1, 2).to(qg.dtype)  # [B, Hkv, L, hd]
        vs = v_blocks.index_select(0, flat).view(B, L, Hkv, hd).transpose(1, 2).to(qg.dtype)
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=g.mask)  # [B, Hkv, G, hd]
        return o.reshape(B, Hkv * G, hd)


class QkNormModel(LlamaModel):
    """Llama with per-head RMSNorm of queries and keys before RoPE (Qwen3: ``q_norm`` / ``k_norm`` [head_dim],
    the model's ``rms_eps``). Torch path only (arch_spec.native_unsupported)."""

    def _attention(self, lw: _Layer, h: torch.Tensor, meta: BatchMetadata, cache: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, layer: int = 0) -> torch.Tensor:
        cfg = self.config
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = h.shape[0]
        qkv = _adapted(lw.qkv, rms_norm(h, lw.attn_norm, cfg.rms_eps), meta.lora, layer, "qkv")
        q = rms_norm(qkv[:, : H * hd].reshape(T, H, hd), lw.q_norm, cfg.rms_eps)
        k = rms_norm(qkv[:, H * hd : (H + Hkv) * hd].reshape(T, Hkv, hd), lw.k_norm, cfg.rms_eps)
        qk = self.rope.rotate(torch.cat([q, k], dim=1), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * hd :].view(T, Hkv, hd)
        return self._store_and_attend(lw, q, k, v, meta, cache, layer)


def _adapted(linear, x: torch.Tensor, lora: LoraBatch | None, layer: int, proj: str) -> torch.Tensor:
    """``linear(x)`` plus the LoRA deltas of the step's adapters for ``proj`` of ``layer`` (x [T, in])."""
    y = linear(x)
    return y if lora is None else lora.add_delta(layer, proj, x, y)


def causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor | None:
    """Bool mask [q_len, ctx_len]: query i (at position ctx_len - q_len + i) sees keys <= its position.

    None for a single-token query (it sees the whole context).
    """
    if q_len == 1:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    return torch.arange(ctx_len, device=device).unsqueeze(0) <= q_pos
