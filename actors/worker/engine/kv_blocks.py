"""The engine's KV block space (one part of ``LLMEngine``, engine.py): the block manager (paged KV blocks and the
prefix cache) and the iteration scheduler over it, sized from the runner's block count. Pure module (no torch);
rebuilt when the runner's KV cache is resized."""

from __future__ import annotations

from typing import Callable, Protocol

from .block_manager import BlockManager
from .iteration_scheduler import IterationScheduler


class SchedulingConfig(Protocol):
    """The config fields the block space reads (``EngineConfig`` and ``ZeroComputeConfig`` have them)."""

    block_size: int  # tokens per KV block
    max_num_seqs: int  # sequences in one step
    max_num_batched_tokens: int  # tokens in one step
    enable_prefix_caching: bool  # share cached full blocks of equal token prefixes


class KVBlocks:
    """Block manager + iteration scheduler over ``num_blocks`` blocks, and the sequence length cap."""

    def __init__(self, config: SchedulingConfig, num_blocks: int, position_limit: int,
                 admit_gate: Callable[[str, set[str]], bool] | None = None, window: int | None = None) -> None:
        """``position_limit``: positions the model covers (tokens); ``admit_gate(adapter, in use) -> bool``:
        the scheduler's adapter admission check (iteration_scheduler.py); ``window``: the model's sliding window
        (tokens; blocks before every later query's window are released, block_manager.py)."""
        self.num_blocks = num_blocks  # KV blocks in all
        # one sequence always fits alone (tokens)
        self.max_model_len = min(position_limit, num_blocks * config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = IterationScheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.admit_gate = admit_gate
        self.scheduler.window = window
