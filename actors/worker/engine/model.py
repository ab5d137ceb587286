"""Llama forward pass over a flat packed batch of tokens with a paged KV cache.

The batch is the concatenation of token chunks from many sequences (prefill chunks of any length
and 1-token decodes mixed in one forward; no padding).  Per sequence ``s`` the chunk holds
``query_lens[s]`` tokens at positions ``context_lens[s] - query_lens[s] .. context_lens[s] - 1``.

Algorithms (sources): RMSNorm (Zhang & Sennrich 2019), RoPE with the Hugging Face ``rotate_half``
layout (Su et al. 2021; ``transformers.models.llama.modeling_llama``), grouped-query attention
(Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020), paged KV cache (Kwon et al. 2023, PagedAttention).
Attention here is the simple form: gather keys/values from the cache by flat slot and call
``torch.nn.functional.scaled_dot_product_attention``: one padded call for all 1-token decodes
(key-padding mask), one call per prefill chunk (causal mask offset by the cached prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .gguf_loader import ModelConfig


@dataclass
class BatchMetadata:
    """Per-step batch description; all tensors on the model device, int64.

    ``slot_mapping`` [T]: flat KV slot (block * block_size + offset) where token t's K/V is written.
    ``context_slots`` [sum(context_lens)]: flat slots of every sequence's whole context, concatenated.
    ``query_lens`` / ``context_lens``: python ints per sequence (tokens in this step / in cache after it).
    ``logits_indices`` [S']: token rows (in the packed batch) whose logits are wanted.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_slots: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    logits_indices: torch.Tensor
    decode: "DecodeBatch | None" = None  # derived in __post_init__
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)  # (q_start, q_len, k_start, ctx_len)

    def __post_init__(self) -> None:
        rows, ctx, q_start, k_start = [], [], 0, 0
        for q_len, ctx_len in zip(self.query_lens, self.context_lens):
            if q_len == 1:
                rows.append(q_start)
                ctx.append((k_start, ctx_len))
            else:
                self.prefills.append((q_start, q_len, k_start, ctx_len))
            q_start, k_start = q_start + q_len, k_start + ctx_len
        self.decode = DecodeBatch.build(rows, ctx, self.positions.device) if rows else None


@dataclass
class DecodeBatch:
    """Padded gather plan for 1-token queries: ``rows`` [B] (token rows), ``ctx_index`` [B, L] (rows of
    the concatenated context K/V, padding points at row 0), ``mask`` [B, 1, 1, L] bool (True = real key)."""

    rows: torch.Tensor
    ctx_index: torch.Tensor
    mask: torch.Tensor

    @staticmethod
    def build(rows: list[int], ctx: list[tuple[int, int]], device) -> "DecodeBatch":
        max_len = max(n for _, n in ctx)
        ar = torch.arange(max_len, device=device)
        starts = torch.tensor([s for s, _ in ctx], device=device).unsqueeze(1)
        lens = torch.tensor([n for _, n in ctx], device=device).unsqueeze(1)
        mask = ar.unsqueeze(0) < lens
        index = torch.where(mask, starts + ar, torch.zeros_like(ar))
        return DecodeBatch(torch.tensor(rows, device=device), index, mask[:, None, None, :])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 then cast back: ``x / sqrt(mean(x^2) + eps) * weight`` (as HF Llama)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    """Precomputed RoPE cos/sin tables [max_positions, head_dim] (float32), HF half-split layout."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, device: str) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, head_dim] by ``positions`` [T]; computed in float32."""
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rotated * sin).to(x.dtype)


class LlamaModel:
    """Stateless-weights Llama: ``forward(ids, meta, kv_cache) -> logits`` [S', vocab] float32."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int) -> None:
        self.config = config
        self.w = weights
        device = str(weights["embed"].device)
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions, device)
        self.num_groups = config.num_heads // config.num_kv_heads

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run all layers on ``input_ids`` [T]; write K/V into ``kv_cache`` (see kv_cache.py layout).

        Returns float32 logits [len(meta.logits_indices), vocab].
        """
        h = F.embedding(input_ids, self.w["embed"])
        for layer in range(self.config.num_layers):
            h = h + self._attention(layer, h, meta, kv_cache[layer])
            h = h + self._mlp(layer, h)
        h = rms_norm(h[meta.logits_indices], self.w["norm"], self.config.rms_eps)
        return F.linear(h, self.w["lm_head"]).float()

    def _mlp(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``down(silu(gate(x)) * up(x))`` on the RMS-normed input [T, d]."""
        w = lambda n: self.w[f"layers.{layer}.{n}"]  # noqa: E731
        x = rms_norm(h, w("ffn_norm"), self.config.rms_eps)
        return F.linear(F.silu(F.linear(x, w("w_gate"))) * F.linear(x, w("w_up")), w("w_down"))

    def _attention(self, layer: int, h: torch.Tensor, meta: BatchMetadata, cache: torch.Tensor) -> torch.Tensor:
        """Self-attention block; ``cache`` [2, num_blocks, block_size, Hkv, hd] for this layer."""
        cfg, w = self.config, lambda n: self.w[f"layers.{layer}.{n}"]  # noqa: E731
        x = rms_norm(h, w("attn_norm"), cfg.rms_eps)
        q = F.linear(x, w("wq")).view(-1, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, w("wk")).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, w("wv")).view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rope.apply(q, meta.positions), self.rope.apply(k, meta.positions)
        k_flat = cache[0].view(-1, cfg.num_kv_heads, cfg.head_dim)
        v_flat = cache[1].view(-1, cfg.num_kv_heads, cfg.head_dim)
        k_flat[meta.slot_mapping] = k.to(k_flat.dtype)
        v_flat[meta.slot_mapping] = v.to(v_flat.dtype)
        out = self._paged_attention(q, k_flat[meta.context_slots], v_flat[meta.context_slots], meta)
        return F.linear(out.reshape(-1, cfg.num_heads * cfg.head_dim), w("wo"))

    def _paged_attention(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, meta: BatchMetadata):
        """Causal attention. q [T, H, hd]; k_ctx/v_ctx [sum(ctx), Hkv, hd] -> [T, H, hd].

        Decodes (1-token queries) run as one padded batch; prefill chunks run one by one.
        """
        out = torch.empty_like(q)
        dec = meta.decode
        if dec is not None:
            out[dec.rows] = self._decode_attention(q[dec.rows], k_ctx, v_ctx, dec)
        for q_start, q_len, k_start, ctx_len in meta.prefills:
            qs = q[q_start : q_start + q_len].transpose(0, 1)  # [H, q_len, hd]
            ks = self._expand_kv(k_ctx[k_start : k_start + ctx_len].transpose(0, 1), qs.dtype)
            vs = self._expand_kv(v_ctx[k_start : k_start + ctx_len].transpose(0, 1), qs.dtype)
            mask = causal_mask(q_len, ctx_len, q.device)
            out[q_start : q_start + q_len] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)
        return out

    def _decode_attention(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, dec: "DecodeBatch"):
        """q [B, H, hd] attends to padded contexts k/v [B, Hkv, L, hd] (mask [B, 1, 1, L]) -> [B, H, hd]."""
        ks = self._expand_kv(k_ctx[dec.ctx_index].transpose(1, 2), q.dtype)
        vs = self._expand_kv(v_ctx[dec.ctx_index].transpose(1, 2), q.dtype)
        return F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=dec.mask).squeeze(2)

    def _expand_kv(self, kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """GQA: repeat each KV head for its query group along the head dim (-3)."""
        return kv.to(dtype).repeat_interleave(self.num_groups, dim=-3)


def causal_mask(q_len: int, ctx_len: int, device) -> torch.Tensor | None:
    """Bool mask [q_len, ctx_len]: query i (at position ctx_len - q_len + i) sees keys <= its position.

    None for a single-token query (it sees the whole context).
    """
    if q_len == 1:
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    return torch.arange(ctx_len, device=device).unsqueeze(0) <= q_pos
