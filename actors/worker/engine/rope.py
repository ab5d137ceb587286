"""LongRoPE (Phi-3 ``rope_scaling`` ``longrope`` / ``su``): the inverse frequencies and the attention factor of
the one static cos/sin table a model is served with (decision 0046).

LongRoPE (Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens") divides each base
inverse frequency ``theta^(-2i/d)`` by a per-frequency factor: ``short_factor`` for sequences within
``original_max_position_embeddings``, ``long_factor`` beyond it, and multiplies cos and sin by an attention
factor (default ``sqrt(1 + ln(s) / ln(original))``, s = max / original positions).

transformers picks the set per forward from that forward's length (``longrope_frequency_update``: long when
``max(position_ids) + 1 > original``), so its cached decoding past the threshold rotates new keys with the long
set beside cached keys rotated with the short one, unlike its own full forward. We decide once per served model,
as vLLM's ``Phi3LongRoPEScaledRotaryEmbedding`` does: the long set when the engine serves more positions than the
original length (``max_positions > original``), else the short set. Every token of every sequence uses the same
table: batch invariant, prefix-cache safe, and equal to transformers' full forward for any sequence longer than
the original length (long side) or, served with ``max_model_len <= original``, for any sequence (short side).
"""

from __future__ import annotations

import torch

from .arch_spec import ModelConfig


def uses_long_factors(config: ModelConfig, max_positions: int) -> bool:
    """True when a model served for ``max_positions`` positions (tokens) rotates with the long factors."""
    return max_positions > config.rope_original_max_positions


def longrope_inv_freq(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies: ``1 / (factor_i * theta^(2i/d))`` with the short or the long
    factors (``uses_long_factors``), as transformers' ``_compute_longrope_parameters``. ValueError for a spec
    without both factor lists."""
    factors = config.rope_long_factors if uses_long_factors(config, max_positions) else config.rope_short_factors
    if config.rope_scaling != "longrope" or factors is None:
        raise ValueError("longrope_inv_freq needs a longrope spec with short and long factors")
    exps = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    inv = 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta ** exps)
    return inv


def scale_tables(rope, factor: float) -> None:
    """Multiply a rotary object's cos / sin tables (float32 [max_positions, head_dim]) by the attention factor,
    in place of transformers' ``cos * attention_scaling`` (1.0: unchanged)."""
    if factor != 1.0:
        rope.cos, rope.sin = rope.cos * factor, rope.sin * factor
