"""``TorchRunner``: the model runner of ``LLMEngine`` (runner.py) on torch, CPU or CUDA (the same code).

It holds what computes: the model (built from the artifact's ``ModelConfig`` by model_families.py; weight-only
quantization and the native CPU kernels are choices inside it), the paged KV cache, the LoRA adapters, the
tensor-parallel group and the grammar masks. ``execute`` runs one packed forward over every scheduled token,
masks the constrained rows and samples (sampler.py). The engine never sees a tensor.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from . import cpu_kernels
from .adapters import AdapterManager
from .hardware import DTYPES, resolve_dtype
from .kv_cache import KVCache, bytes_per_block
from .lora import slot_bytes
from .memory import kv_bytes_for_budget, tensor_bytes
from .model import BatchMetadata, packed_linear_factory
from .model_families import build_model
from .quant import make_linear_factory, quantized_kernels_pay, resolve_quantization
from .row_kernels import RowTable, wrap_factory
from .runner import RunnerInput, RunnerOutput, RunnerRow
from .sampler import generator_state, make_generator, sample_batch, set_generator_state, top_logprobs
from .structured import Structured
from .tensor_parallel import shard_config, shard_plan, shard_weights, wrap_row_parallel
from .tp_group import LeaderModel, TPGroup
from .kquant import pack_variant
from .weights_cache import PackCache, read_artifact

log = logging.getLogger(__name__)


class _PhaseClock:
    """Seconds between consecutive ``mark`` calls, by phase name (monotonic clock), after ``phases``
    timed already."""

    def __init__(self, phases: dict[str, float] | None = None) -> None:
        self.phases: dict[str, float] = dict(phases or {})
        self._last = time.monotonic()

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now


class TorchRunner:
    """The torch ``ModelRunner`` (module docstring). Not thread-safe: ``execute`` from one thread."""

    def __init__(self, config, share_weights_of: "TorchRunner | None" = None) -> None:
        """Load ``config.model_path`` (an ``EngineConfig``, engine.py); with ``share_weights_of`` (a runner of
        the same artifact, dtype and device, one rank) use its model's weights: this runner gets its own KV
        cache and adapters (a multi-version host's versions of one artifact, actors/worker/host.py).
        ValueError when ``share_weights_of`` does not match or the artifact is unsupported."""
        self.config = config
        self.dtype_name = resolve_dtype(config.dtype, config.device)  # "auto" resolved
        self.dtype = DTYPES[self.dtype_name]
        if share_weights_of is not None:
            self._init_shared(share_weights_of)
        else:
            self._load()
        self.num_blocks = self.kv.num_blocks
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self._eos_ids()
        self.structured = Structured(config.model_path, self.token_bytes, self.eos_token_ids,
                                     special_names=self.special_names)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._threads = torch.get_num_threads()
        log.info("engine: dtype %s, quantization %s, %d torch threads", self.dtype_name, self.quantization,
                 self._threads)

    # ----------------------------------------------------------------- loading

    def _load(self) -> None:
        """Read the artifact, build the (quantized, possibly sharded) model and size the KV cache."""
        config, dtype = self.config, self.dtype
        art = read_artifact(config.model_path, dtype, config.device, config.progress, config.weights_cache)
        self.model_config, self.weights_cached = art.config, art.cached
        clock = _PhaseClock(art.phases)  # seconds per load phase (actors/worker/load_phases.py names them)
        kv_room = config.memory_budget_bytes or config.kv_cache_bytes  # the KV cache gets at most this (bytes)
        self.position_limit = min(  # positions the model's tables cover: no more than fit (tokens)
            config.max_model_len or self.model_config.context_length,
            max(1, kv_room // bytes_per_block(self.model_config, config.block_size, dtype)) * config.block_size)
        factory, packs = self._linear_factory(art)
        clock.mark("kernels")
        self.tp, shard_cfg = self._open_group(art)
        if self.tp is not None:
            packs = None  # the pack cache holds whole projections, not a rank's shard
        make = self._file_precision(packs.wrap(factory) if packs else factory, art)  # the file's precision (kquant.py)
        make = wrap_factory(make, self.row_table, dtype)  # the measured kernel per row count (row_kernels.py)
        self.model = build_model(shard_cfg, art.weights, self.position_limit, make, config.native_kernels)
        self._head_kernels()
        self.held = make.held.line() if hasattr(make, "held") else (
            f"{self.quantization} re-quantized from the loaded floats (tensor parallel: the file's blocks are not "
            "sharded)" if self.quantization and self.tp is not None else f"{self.quantization or self.dtype_name} (all)")
        log.info("engine holds: %s", self.held)
        if self.tp is not None:
            wrap_row_parallel(self.model, None)  # the default process group: the TP group
        if packs:
            packs.save()
        clock.mark("quantize")
        # why the native kernels do not run this spec (arch_spec.native_unsupported); None where they may
        self.native_off_reason = getattr(self.model, "native_off_reason", None)
        from .whole_step import attach  # decode steps of up to 8 rows in one native call (issue [24] item 3)

        _, self.whole_step_line = attach(self.model, self.tp is None, config.whole_step)
        log.info("whole-step decode: %s", self.whole_step_line)
        self.weights_bytes = tensor_bytes(self.model)  # converted + quantized, shared storages once
        self.weights_shared = False  # True: the weights belong to another runner (share_weights_of)
        # no adapter slots under tensor parallelism or for a model without LoRA (gemma.py: lora_off_reason)
        self._init_adapters(config.max_loras if self.tp is None and not self._lora_off() else 0)
        self._init_kv(shard_cfg)
        self.load_phases = clock.phases  # {phase: s}: artifact_read, convert, kernels, quantize
        self.token_bytes, self.special_names = art.token_bytes, art.special_names

    def _linear_factory(self, art):
        """(projection factory or None, PackCache or None) for the resolved quantization and kernels."""
        config = self.config
        self.quantization = resolve_quantization(config.quantization, config.model_path, self.dtype_name,
                                                 config.device, types=art.tensor_types)  # "auto" resolved
        if self.quantization and not quantized_kernels_pay(self.dtype_name, config.device):
            log.warning("weight-only %s with %s on %s runs slower than dense weights (quant.py)",
                        self.quantization, self.dtype_name, config.device)
        dense = packed_linear_factory(self.dtype, config.device) if config.quant_dense_copy else None
        kernels = cpu_kernels.load() if config.native_kernels and config.device == "cpu" else None
        self.row_table = self._row_table(kernels)
        self._block_quant = self.row_table.prefers_blocks() if self.row_table else None
        factory = make_linear_factory(self.quantization, dense, kernels=kernels, block_quant=self._block_quant)
        variant = pack_variant(self._pinned()) + f"-b{self._block_quant}"  # which projections reach the factory
        packs = PackCache(config.model_path, self.dtype, self.quantization, kernels, variant) \
            if config.weights_cache and factory is not None else None
        return factory, packs

    def _head_kernels(self) -> None:
        """The LM head per row count (``row_kernels.compose_head``) where the row table has a head table and the
        GGUF stores the head as Q8_0 blocks (read exactly, ``kquant.file_q8_0``); one rank, pre-packed bf16 head."""
        table = self.row_table.head if self.row_table else None
        model = self.model
        if table is None or not getattr(model, "head_packed", False) or os.path.isdir(self.config.model_path):
            return
        from . import kquant
        from .row_kernels import compose_head

        path = self.config.model_path
        tensors = kquant.tensor_table(path)  # one header read for both
        name = kquant.head_name(path, tensors)
        head = kquant.file_q8_0(path, name, cpu_kernels.load(), tensors) if name else None
        if head is not None and head.out_features != self.model_config.vocab_size:
            head = None  # a head whose rows are not the vocabulary (never in a llama-style GGUF): left dense
        model.lm_head_1 = compose_head(model.lm_head_1, head, table)

    def _row_table(self, kernels):
        """The measured kernel per row count (``EngineConfig.row_kernels``) where it applies: CPU with the native
        kernels, a quantized path, one rank; else None (projections as ``make_linear_factory`` builds them)."""
        config = self.config
        if (config.row_kernels is None or kernels is None or self.quantization is None
                or config.tensor_parallel != 1):
            return None
        return RowTable.from_json(config.row_kernels)

    def _file_precision(self, make, art):
        """``make`` (or None: dense) wrapped by ``kquant.file_precision_factory`` for a one-rank GGUF (4-bit
        blocks mapped exactly, other types kept dense unless pinned, what is held recorded); ``make`` otherwise."""
        config = self.config
        if self.tp is not None:
            return make
        from . import kquant

        if os.path.isdir(config.model_path):  # a GPTQ / AWQ / FP8 directory (hf_quant.py); plain ones unwrapped
            from . import hf_loader, hf_quant

            spec = hf_quant.spec_of_dir(config.model_path)
            if spec is None:
                return make
            file = hf_quant.HFInt4(config.model_path, self.model_config, spec, hf_loader)
        else:
            file = kquant.FileInt4(config.model_path, self.model_config.architecture, self.model_config.num_heads,
                                   self.model_config.num_kv_heads)
        dense = packed_linear_factory(self.dtype, config.device) if config.quant_dense_copy else None
        kernels = cpu_kernels.load() if config.native_kernels and config.device == "cpu" else None
        return kquant.file_precision_factory(make, file, self.quantization, self.dtype, self._pinned(), kernels, dense,
                                             block_quant=self._block_quant)

    def _pinned(self) -> bool:
        """Whether the quantization was asked for (``EngineConfig.quantization_pinned``; None: unless "auto")."""
        config = self.config
        return config.quantization_pinned if config.quantization_pinned is not None else config.quantization != "auto"

    def _init_kv(self, shard_cfg) -> None:
        """The KV cache: ``kv_cache_bytes``, or what the memory budget leaves; tensor parallel: the blocks every
        rank holds."""
        config = self.config
        kv_bytes = (kv_bytes_for_budget(config.memory_budget_bytes, self.weights_bytes + self.lora_reserve_bytes)
                    if config.memory_budget_bytes else config.kv_cache_bytes)
        if self.tp is not None:
            kv_bytes = self._group_kv_bytes(kv_bytes, shard_cfg)
        self.kv = KVCache(shard_cfg, kv_bytes, config.block_size, self.dtype, config.device)
        log.info(self.kv.describe())
        if self.tp is not None:
            self.tp.describe(self.weights_bytes, self.kv.num_bytes)
            if config.tp_rank == 0:
                self.model = LeaderModel(self.model, self.tp)

    def _init_shared(self, other: "TorchRunner") -> None:
        """Adopt ``other``'s weights (see ``__init__``); the KV cache gets ``kv_cache_bytes`` (no budget math:
        the host that shares weights keeps the budget)."""
        config = self.config
        if (other.config.model_path, other.dtype_name, other.config.device) != (config.model_path, self.dtype_name,
                                                                                config.device) or other.tp is not None:
            raise ValueError("share_weights_of must be a one-rank engine of the same model_path, dtype and device")
        t0 = time.monotonic()
        self.model_config, self.weights_cached, self.quantization = other.model_config, True, other.quantization
        self.tp, self.model, self.position_limit = None, other.model, other.position_limit
        self.native_off_reason = other.native_off_reason
        self.held = getattr(other, "held", None)
        self.row_table = getattr(other, "row_table", None)
        self.whole_step_line = getattr(other, "whole_step_line", None)  # the model's, shared
        self.weights_bytes, self.weights_shared = other.weights_bytes, True
        self._init_adapters(config.max_loras)
        self.kv = KVCache(self.model_config, config.kv_cache_bytes, config.block_size, self.dtype, config.device)
        self.token_bytes, self.special_names = other.token_bytes, other.special_names
        self.load_phases = {"artifact_read": 0.0, "convert": 0.0, "kernels": 0.0,
                            "quantize": time.monotonic() - t0}  # the KV cache's allocation

    def _lora_off(self) -> str | None:
        """Why this model takes no LoRA adapters (its ``lora_off_reason``), or None."""
        return getattr(self.model, "lora_off_reason", None)

    def _init_adapters(self, slots: int) -> None:
        """The LoRA AdapterManager with ``slots`` accelerator slots (None for 0) and the bytes they reserve. A
        mixture-of-experts model gets none (``lora_refused`` says why; decision 0047)."""
        config = self.config
        self.lora_refused = None
        if self.model_config.num_experts:
            self.lora_refused = (f"LoRA adapters are not supported for mixture-of-experts models "
                                 f"({self.model_config.architecture}, {self.model_config.num_experts} experts)")
            slots = 0
        self.adapters = (AdapterManager(self.model_config, self.dtype, config.device, slots, config.max_cpu_loras,
                                        config.max_lora_rank) if slots else None)
        self.lora_reserve_bytes = slots * slot_bytes(self.model_config, config.max_lora_rank, self.dtype)

    def _open_group(self, art):
        """(TPGroup or None, the ModelConfig this rank builds): with ``tensor_parallel`` > 1 the group is joined
        (rank 0 starts the followers) and ``art.weights`` cut to this rank's shard (tensor_parallel.py)."""
        config = self.config
        if config.tensor_parallel == 1:
            return None, self.model_config
        if self.model_config.num_experts:  # the experts are not split across ranks (decision 0047)
            raise ValueError(f"tensor_parallel {config.tensor_parallel}: mixture-of-experts models "
                             f"({self.model_config.architecture}) are not supported with tensor parallelism")
        plan = shard_plan(self.model_config.num_heads, self.model_config.num_kv_heads, self.model_config.ffn_size,
                          config.tensor_parallel)  # ValueError before any process starts
        if config.num_threads is None and config.device == "cpu":  # the ranks share this machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel))
        group = TPGroup.open(config, self.dtype_name, self.quantization)
        shard = plan[config.tp_rank]
        shard_weights(art.weights, self.model_config, shard)
        log.info("tensor parallel rank %d of %d: query heads %s, KV heads %s, MLP columns %s", shard.rank,
                 shard.world, shard.q_heads, shard.kv_heads, shard.ffn)
        return group, shard_config(self.model_config, shard)

    def _group_kv_bytes(self, kv_bytes: int, shard_cfg) -> int:
        """This rank's KV bytes for the blocks every rank can hold: ``kv_cache_bytes`` sizes the whole model's
        KV (all heads); a memory budget is per rank (its own weights and heads)."""
        bs = self.config.block_size
        full = bytes_per_block(self.model_config, bs, self.dtype)
        blocks = kv_bytes // (bytes_per_block(shard_cfg, bs, self.dtype) if self.config.memory_budget_bytes else full)
        return self.tp.agree_min(blocks) * bytes_per_block(shard_cfg, bs, self.dtype)

    def _eos_ids(self) -> tuple[int, ...]:
        """EOS (and end-of-turn, if distinct) token ids from GGUF metadata or config / generation_config.json."""
        ids = [self.model_config.eos_token_id, self.model_config.eot_token_id,
               *getattr(self.model_config, "generation_eos_ids", ())]  # generation_config.json's other stops
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # ----------------------------------------------------------------- the ModelRunner interface

    def describe(self) -> str:
        """The KV cache's line (kv_cache.py)."""
        return self.kv.describe()

    def close(self) -> None:
        """Stop the tensor-parallel followers and leave the group (nothing to do on one rank)."""
        if self.tp is not None:
            self.tp.close()

    def new_rng(self, seed: int | None, state: bytes | None) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded by ``seed`` (None: random), continued from ``state`` when given."""
        generator = make_generator(seed)
        if state is not None:
            set_generator_state(generator, state)
        return generator

    def rng_state(self, rng: torch.Generator) -> bytes:
        """``rng.get_state()`` as bytes."""
        return generator_state(rng)

    def resize_kv(self, kv_bytes: int) -> int:
        """Replace the KV cache by one of ``kv_bytes`` bytes; its block count. RuntimeError with tensor
        parallelism; ValueError below one block (kv_cache.py)."""
        if self.tp is not None:
            raise RuntimeError("resize_kv needs an idle one-rank engine")
        release = getattr(self.model, "release_kv", None)  # the model's views of the old cache
        if release is not None:
            release()
        self.kv = None  # the old cache is freed before the new one is allocated (no peak of both)
        self.kv = KVCache(self.model_config, int(kv_bytes), self.config.block_size, self.dtype, self.config.device)
        self.num_blocks = self.kv.num_blocks
        log.info("KV cache resized: %s", self.kv.describe())
        return self.num_blocks

    def extra_stats(self) -> dict:
        """num_constrained_steps, grammar_*, mask_ms_total (structured outputs) and lora_* (adapters)."""
        return {**self.structured.stats(), **(self.adapters.stats() if self.adapters is not None else {})}

    # ----------------------------------------------------------------- adapters

    def check_adapter(self, name: str | None, path: str, in_use: set[str]) -> None:
        """Read a request's adapter into the CPU tier now (its first use); ValueError (lora.AdapterError)
        when adapters are disabled, the name is not registered (and ``path`` does not name its directory),
        or its files are corrupt or do not fit."""
        if not name:
            return
        if self.lora_refused:
            raise ValueError(f"adapter {name!r}: {self.lora_refused}")
        if self.adapters is None:
            raise ValueError(f"adapter {name!r}: {self._lora_off() or 'LoRA adapters are disabled on this worker'} "
                             "(max_loras=0)")
        if path and name not in self.adapters.paths:  # the request saw the registry record before this worker
            self.adapters.register(name, path)
        self.adapters.ensure_host(name, in_use)

    def admit_gate(self, name: str, in_use: set[str]) -> bool:
        """True when adapter ``name`` has (or gets) an accelerator slot beside ``in_use``."""
        return self.adapters is None or self.adapters.place(name, in_use) is not None

    def register_adapter(self, name: str, path: str) -> None:
        """Make LoRA adapter ``name`` (a PEFT directory at ``path``) servable; it is read on first use.
        ValueError when adapters are disabled or the name is malformed (AdapterManager.register)."""
        if self.lora_refused:
            raise ValueError(f"adapter {name!r}: {self.lora_refused}")
        if self.adapters is None:
            raise ValueError("LoRA adapters are disabled on this worker (max_loras=0)")
        self.adapters.register(name, path)

    def unregister_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (no live request may name it; the engine checks)."""
        if self.adapters is not None:
            self.adapters.unregister(name)

    # ----------------------------------------------------------------- one step

    def execute(self, batch: RunnerInput) -> RunnerOutput:
        """Forward ``batch`` (K/V written to the rows' blocks), mask the constrained rows, sample one token
        per sampling row and give the asked-for logprobs."""
        rows = [r.sampling for r in batch.sampling_rows]
        lowered = self._set_threads(batch)
        masks = self.structured.start_masks(  # overlaps the forward (depends only on tokens already sampled)
            [i for i, s in enumerate(rows) if s.grammar is not None], [s.grammar for s in rows if s.grammar])
        logits = self.forward(batch)
        if lowered:  # threads are process-wide: give them back
            torch.set_num_threads(self._threads)
        self.structured.finish_masks(masks, logits)  # in place: disallowed tokens of constrained rows -> -inf
        tokens = sample_batch(logits, [s.params for s in rows], [s.rng for s in rows],
                              [s.output_ids for s in rows], [s.token_ids for s in rows])
        lps = [None if s.params.logprobs is None else top_logprobs(logits[i], t, s.params.logprobs)
               for i, (s, t) in enumerate(zip(rows, tokens))]
        return RunnerOutput(tokens, lps)

    def _set_threads(self, batch: RunnerInput) -> bool:
        """One thread for tiny steps (memory-bound GEMVs: a second thread gains little and, on a
        shared CPU, makes every op wait for a descheduled sibling), all threads otherwise."""
        small = batch.num_batched_tokens <= self.config.small_step_tokens
        if self.config.device != "cpu" or self._threads <= 1 or not small:
            return False
        torch.set_num_threads(1)
        return True

    def forward(self, batch: RunnerInput) -> torch.Tensor:
        """Build the packed batch and run the model: float32 logits [S sampling rows, vocab_size]."""
        ids, positions, slots, logits_idx = [], [], [], []
        for row in batch.seqs:
            end = row.start + row.num_new_tokens
            ids += row.token_ids
            positions += range(row.start, end)
            slots += self.slots(row.block_table, row.start, end)
            if row.samples:
                logits_idx.append(len(ids) - 1)
        meta = self._metadata(batch.seqs, positions, slots, logits_idx)
        if self.adapters is not None:
            meta.lora = self.adapters.batch([r.adapter for r in batch.seqs], meta.query_lens)
        return self.model.forward(self.tensor(ids), meta, self.kv.tensor)

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat KV slots of positions ``start .. end-1`` given a block table."""
        bs = self.config.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def tensor(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 tensor [len(values)] on the runner's device."""
        return torch.tensor(values, dtype=torch.int64, device=self.config.device)

    def _metadata(self, rows: list[RunnerRow], positions, slots, logits_idx) -> BatchMetadata:
        return BatchMetadata(
            positions=self.tensor(positions),
            slot_mapping=self.tensor(slots),
            context_slots=None,
            query_lens=[r.num_new_tokens for r in rows],
            context_lens=[r.start + r.num_new_tokens for r in rows],
            logits_indices=self.tensor(logits_idx),
            block_tables=[r.block_table for r in rows],
        )
