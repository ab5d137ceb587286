"""The parts of an engine a multi-version host needs (actors/worker/host.py): an engine over another engine's
weights (versions of one artifact share one copy) and a KV cache resized when the host re-splits its budget.
A mixin of ``LLMEngine`` (engine.py); it uses the engine's attributes (config, kv, model, adapters, ...)."""

from __future__ import annotations

import logging
import time

import torch

from .adapters import AdapterManager
from .block_manager import BlockManager
from .hardware import DTYPES
from .iteration_scheduler import IterationScheduler
from .kv_cache import KVCache
from .lora import slot_bytes

log = logging.getLogger(__name__)


class ResidentKV:
    """Mixin (module docstring)."""

    def _build_blocks(self) -> None:
        """Block manager and iteration scheduler over ``self.kv`` (at load, and after ``resize_kv``)."""
        config = self.config
        self.max_model_len = min(self.position_limit, self.kv.capacity_tokens)  # one sequence always fits alone
        self.block_manager = BlockManager(self.kv.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = IterationScheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        if self.adapters is not None:
            self.scheduler.admit_gate = lambda name, in_use: self.adapters.place(name, in_use) is not None

    def _init_shared(self, other: "LLMEngine", dtype: torch.dtype) -> None:
        """Adopt ``other``'s weights (see ``__init__``); the KV cache gets ``kv_cache_bytes`` (no budget math:
        the host that shares weights keeps the budget)."""
        config = self.config
        if (other.config.model_path, other.dtype_name, other.config.device) != (config.model_path, self.dtype_name,
                                                                                config.device) or other.tp is not None:
            raise ValueError("share_weights_of must be a one-rank engine of the same model_path, dtype and device")
        t0 = time.monotonic()
        self.model_config, self.weights_cached, self.quantization = other.model_config, True, other.quantization
        self.tp, self.model, self.position_limit = None, other.model, other.position_limit
        self.weights_bytes, self.weights_shared = other.weights_bytes, True
        self._init_adapters(dtype, config.max_loras)
        self.kv = KVCache(self.model_config, config.kv_cache_bytes, config.block_size, dtype, config.device)
        self._build_blocks()
        self.token_bytes, self.special_names = other.token_bytes, other.special_names
        self.load_phases = {"artifact_read": 0.0, "convert": 0.0, "kernels": 0.0,
                            "quantize": time.monotonic() - t0}  # the KV cache's allocation
        self._init_requests()

    def _init_adapters(self, dtype: torch.dtype, slots: int) -> None:
        """The LoRA AdapterManager with ``slots`` accelerator slots (None for 0) and the bytes they reserve."""
        config = self.config
        self.adapters = (AdapterManager(self.model_config, dtype, config.device, slots, config.max_cpu_loras,
                                        config.max_lora_rank) if slots else None)
        self.lora_reserve_bytes = slots * slot_bytes(self.model_config, config.max_lora_rank, dtype)

    def resize_kv(self, kv_bytes: int) -> None:
        """Replace the KV cache by one of ``kv_bytes`` bytes (a host re-splitting its budget when residency
        changes). Only on an idle, one-rank engine: RuntimeError when a request is held or with tensor
        parallelism; ValueError below one block. Cached prefixes are dropped."""
        if self._requests or self._aborted or self.tp is not None:
            raise RuntimeError("resize_kv needs an idle one-rank engine")
        dtype = DTYPES[self.dtype_name]
        new = KVCache(self.model_config, int(kv_bytes), self.config.block_size, dtype, self.config.device)
        self.kv = new
        self._build_blocks()
        self._stats.num_total_blocks = self.kv.num_blocks
        log.info("KV cache resized: %s", self.kv.describe())
