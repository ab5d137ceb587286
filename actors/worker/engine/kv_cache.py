"""Paged KV cache storage: one torch tensor sized from a byte budget.

Layout: ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` in the model
dtype.  A token's flat slot is ``block * block_size + offset``; viewing ``cache[layer, 0]`` as
``[num_blocks * block_size, num_kv_heads, head_dim]`` indexes it directly (PagedAttention,
Kwon et al. 2023).  Which blocks belong to which sequence is the pure ``BlockManager``'s job.
"""

from __future__ import annotations

import torch

from .gguf_loader import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V (bytes)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * elem


class KVCache:
    """Owns the KV tensor; ``num_blocks = kv_cache_bytes // bytes_per_block`` (ValueError if 0)."""

    def __init__(
        self, config: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype, device: str
    ) -> None:
        self.block_size = block_size
        self.block_bytes = bytes_per_block(config, block_size, dtype)
        self.num_blocks = kv_cache_bytes // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is below one block ({self.block_bytes} bytes)")
        shape = (config.num_layers, 2, self.num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        """Allocated size (bytes)."""
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def capacity_tokens(self) -> int:
        """Token slots in all (tokens)."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """One line for the start-up log: blocks, tokens, MiB."""
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.capacity_tokens} tokens, "
            f"{self.num_bytes / 2**20:.1f} MiB ({self.block_bytes} bytes/block, {self.tensor.dtype})"
        )
