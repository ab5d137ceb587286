"""``LLMEngine``: continuous-batching Llama inference over a paged KV cache (CPU or CUDA).

One ``step()`` = plan (``IterationScheduler``), one packed forward over every scheduled token
(``LlamaModel``), sampling (``sampler``), stop checks and incremental detokenization.

Output conventions:
* At most one ``StepOutput`` per request per step.  Prefill chunks that do not reach the end of the
  prompt produce no output (nothing to say yet).
* EOS / ``stop_token_ids`` finish with reason "stop"; the token is in ``new_token_ids`` but its text
  is not emitted.  A stop string finishes with "stop" and the text is cut before it.
  ``max_tokens`` or reaching ``max_model_len`` finishes with "length".
* ``params.grammar`` (llguidance grammar, structured.py): tokens the grammar forbids are masked before
  sampling (masks computed during the forward); EOS is allowed only where the grammar accepts; the request
  finishes with "stop" once the grammar admits no continuation.
* ``abort_request`` frees the request's blocks at once; the next ``step()`` returns one
  ``StepOutput(finished=True, finish_reason="abort", new_token_ids=())`` for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from . import cpu_kernels
from .request_book import RequestBook
from .resident_kv import ResidentKV
from .detokenizer import IncrementalDetokenizer, StopStringMatcher, replay
from .hardware import DTYPES, resolve_dtype
from .quant import QUANTIZERS, make_linear_factory, quantized_kernels_pay, resolve_quantization
from .iteration_scheduler import ScheduledSeq, StepPlan
from .kv_cache import KVCache, bytes_per_block
from .memory import kv_bytes_for_budget, tensor_bytes
from .tensor_parallel import shard_config, shard_plan, shard_weights, wrap_row_parallel
from .tp_group import LeaderModel, TPGroup
from .model import BatchMetadata, LlamaModel, packed_linear_factory
from .sampler import generator_state, make_generator, sample_batch, set_generator_state, top_logprobs
from .step_rates import StepRates
from .structured import GrammarState, Structured
from .types import EngineRequest, EngineStats, StepOutput
from .weights_cache import PackCache, read_artifact

log = logging.getLogger(__name__)

_DTYPES = DTYPES


@dataclass
class EngineConfig:
    """Engine settings; ``__post_init__`` raises ValueError on bad values."""

    model_path: str
    dtype: str = "auto"  # "auto" (bf16 where the device has bf16 matmul, else fp32) | "float32" | "bfloat16"
    device: str = "cpu"  # torch device string, e.g. "cpu", "cuda", "cuda:1"
    kv_cache_bytes: int = 256 * 2**20  # KV cache budget (bytes)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 32  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one forward pass
    max_model_len: int | None = None  # prompt + output cap (tokens); None = GGUF context_length
    progress: bool = False  # tqdm bar while loading
    enable_prefix_caching: bool = True  # share cached full KV blocks of equal token prefixes
    quantization: str | None = None  # None | "int8" | "int4" | "auto" (weight-only, projections; see quant.py)
    quant_dense_copy: bool = True  # quantized: steps of many rows use a bf16 AMX copy of the quantized values
    native_kernels: bool = True  # CPU: decode attention by the C++ kernel (cpu_kernels.py) when it builds
    num_threads: int | None = None  # torch threads for large steps; None = torch's default (all cores)
    small_step_tokens: int = 0  # steps with <= this many tokens run on one thread (0 = never; see 0006)
    weights_cache: bool = False  # read / write the converted-weights cache (weights_cache.py; the worker's default)
    memory_budget_bytes: int = 0  # > 0: weights + KV cache within this (the KV cache gets the rest; memory.py)
    max_loras: int = 4  # LoRA adapters in accelerator slots at once (0 = adapters refused; lora_tiers.py)
    max_cpu_loras: int = 16  # LoRA adapters kept in the CPU tier (>= max_loras)
    max_lora_rank: int = 16  # largest adapter r accepted; with a memory budget, max_loras slots of this rank are kept
    tensor_parallel: int = 1  # ranks sharing the model (tensor_parallel.py; > 1: LoRA adapters are not served)
    tp_rank: int = 0  # this process's rank (0: the engine that schedules; followers are started by it)
    tp_init: str = ""  # followers: the group's rendezvous (tcp://127.0.0.1:PORT), set by rank 0

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required")
        if self.dtype not in (*_DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {sorted([*_DTYPES, 'auto'])}")
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if int(self.memory_budget_bytes) < 0:
            raise ValueError("memory_budget_bytes must be >= 0")
        if self.max_loras < 0 or self.max_lora_rank < 1 or (self.max_loras and self.max_cpu_loras < self.max_loras):
            raise ValueError("max_loras must be >= 0, max_lora_rank >= 1 and max_cpu_loras >= max_loras")
        if self.tensor_parallel < 1 or not 0 <= self.tp_rank < self.tensor_parallel:
            raise ValueError("tensor_parallel must be >= 1 and tp_rank in 0 .. tensor_parallel - 1")
        if self.quantization not in (None, "auto", *QUANTIZERS):
            raise ValueError(f"quantization must be None or one of {sorted([*QUANTIZERS, 'auto'])}")


@dataclass
class _Request:
    """Engine-side state of one request."""

    req: EngineRequest
    token_ids: list[int]  # prompt + generated
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    output_ids: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # llguidance matcher when params.grammar is set
    prompt_served: int = 0  # prompt positions computed so far at least once (recomputation is not service)

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)


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


class LLMEngine(ResidentKV, RequestBook):
    """See module docstring.  Not thread-safe: call from one thread (the worker's engine loop)."""

    def __init__(self, config: EngineConfig, share_weights_of: "LLMEngine | None" = None) -> None:
        """Load ``config.model_path``; with ``share_weights_of`` (an engine of the same artifact, dtype and
        quantization, one rank) use its model's weights instead of loading a copy: this engine gets its own
        KV cache, block manager, scheduler and adapters (a multi-version host's versions of one artifact,
        actors/worker/host.py). ValueError when ``share_weights_of`` does not match."""
        self.config = config
        self.dtype_name = resolve_dtype(config.dtype, config.device)  # "auto" resolved
        dtype = _DTYPES[self.dtype_name]
        if share_weights_of is not None:
            self._init_shared(share_weights_of, dtype)
            return
        art = read_artifact(config.model_path, dtype, config.device, config.progress, config.weights_cache)
        self.model_config, self.weights_cached = art.config, art.cached
        clock = _PhaseClock(art.phases)  # seconds per load phase (actors/worker/load_phases.py names them)
        kv_room = config.memory_budget_bytes or config.kv_cache_bytes  # the KV cache gets at most this (bytes)
        limit = min(config.max_model_len or self.model_config.context_length,  # positions: no more than fit
                    max(1, kv_room // bytes_per_block(self.model_config, config.block_size, dtype)) * config.block_size)
        self.quantization = resolve_quantization(config.quantization, config.model_path, self.dtype_name,
                                                 config.device, types=art.tensor_types)  # "auto" resolved
        if self.quantization and not quantized_kernels_pay(self.dtype_name, config.device):
            log.warning("weight-only %s with %s on %s runs slower than dense weights (quant.py)",
                        self.quantization, self.dtype_name, config.device)
        dense = packed_linear_factory(dtype, config.device) if config.quant_dense_copy else None
        kernels = cpu_kernels.load() if config.native_kernels and config.device == "cpu" else None
        factory = make_linear_factory(self.quantization, dense, kernels=kernels)
        packs = PackCache(config.model_path, dtype, self.quantization, kernels) \
            if config.weights_cache and factory is not None else None
        clock.mark("kernels")
        self.tp, shard_cfg = self._open_group(art, config)
        if self.tp is not None:
            packs = None  # the pack cache holds whole projections, not a rank's shard
        self.position_limit = limit  # positions the model's tables cover (tokens)
        self.model = LlamaModel(shard_cfg, art.weights, limit,
                                packs.wrap(factory) if packs else factory, config.native_kernels)
        if self.tp is not None:
            wrap_row_parallel(self.model, None)  # the default process group: the TP group
        if packs:
            packs.save()
        clock.mark("quantize")
        self.weights_bytes = tensor_bytes(self.model)  # converted + quantized, shared storages once
        self.weights_shared = False  # True: the weights belong to another engine (share_weights_of)
        self._init_adapters(dtype, config.max_loras if self.tp is None else 0)
        kv_bytes = (kv_bytes_for_budget(config.memory_budget_bytes, self.weights_bytes + self.lora_reserve_bytes)
                    if config.memory_budget_bytes else config.kv_cache_bytes)
        if self.tp is not None:
            kv_bytes = self._group_kv_bytes(kv_bytes, shard_cfg, dtype)
        self.kv = KVCache(shard_cfg, kv_bytes, config.block_size, dtype, config.device)
        log.info(self.kv.describe())
        if self.tp is not None:
            self.tp.describe(self.weights_bytes, self.kv.num_bytes)
            if config.tp_rank == 0:
                self.model = LeaderModel(self.model, self.tp)
        self.load_phases = clock.phases  # {phase: s}: artifact_read, convert, kernels, quantize
        self._build_blocks()
        self.token_bytes, self.special_names = art.token_bytes, art.special_names
        del art  # the model holds what it needs of the weights
        self._init_requests()

    def _init_requests(self) -> None:
        """Request book-keeping, statistics and threads (the end of every kind of load)."""
        config = self.config
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = self._eos_ids()
        self.structured = Structured(config.model_path, self.token_bytes, self.eos_token_ids,
                                     special_names=self.special_names)
        self._requests: dict[str, _Request] = {}
        self._aborted: list[StepOutput] = []
        self._stats = EngineStats(num_total_blocks=self.kv.num_blocks)
        self.rates = StepRates()  # measured step time per batch size and prefill speed (step_rates.py)
        self._served_lock = threading.Lock()  # stats.served is written by step() (a thread), read by stats()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self._threads = torch.get_num_threads()
        log.info("engine: dtype %s, quantization %s, %d torch threads", self.dtype_name, self.quantization,
                 self._threads)

    def _open_group(self, art, config: EngineConfig):
        """(TPGroup or None, the ModelConfig this rank builds): with ``tensor_parallel`` > 1 the group is joined
        (rank 0 starts the followers) and ``art.weights`` cut to this rank's shard (tensor_parallel.py)."""
        if config.tensor_parallel == 1:
            return None, self.model_config
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

    def _group_kv_bytes(self, kv_bytes: int, shard_cfg, dtype: torch.dtype) -> int:
        """This rank's KV bytes for the blocks every rank can hold: ``kv_cache_bytes`` sizes the whole model's
        KV (all heads); a memory budget is per rank (its own weights and heads)."""
        bs = self.config.block_size
        full = bytes_per_block(self.model_config, bs, dtype)
        blocks = kv_bytes // (bytes_per_block(shard_cfg, bs, dtype) if self.config.memory_budget_bytes else full)
        return self.tp.agree_min(blocks) * bytes_per_block(shard_cfg, bs, dtype)

    def close(self) -> None:
        """Stop the tensor-parallel followers and leave the group (nothing to do on one rank)."""
        if self.tp is not None:
            self.tp.close()

    def _eos_ids(self) -> tuple[int, ...]:
        """EOS (and end-of-turn, if distinct) token ids from GGUF metadata."""
        ids = [self.model_config.eos_token_id, self.model_config.eot_token_id]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    # ----------------------------------------------------------------- requests

    def add_request(self, req: EngineRequest, front: bool = False) -> list[str]:
        """Queue ``req`` (``front``: ahead of every waiting request, e.g. after ``preempt_request`` made
        room for it); ValueError if its prompt is empty, too long, has bad ids (prompt or logit_bias), or the
        id is taken.

        A migrated sequence (``req.resumed_output_ids``, ``req.rng_state``) starts with those tokens generated:
        its KV is recomputed from prompt + them in its first step (as after a recompute preemption), its
        generator continues from ``rng_state``, and its detokenizer, stop matcher and grammar matcher are
        replayed through them. Returns the text each resumed token released (already sent; [] otherwise)."""
        n, done = len(req.prompt_token_ids), list(req.resumed_output_ids)
        if n == 0:
            raise ValueError("prompt_token_ids is empty")
        if n + len(done) >= self.max_model_len:
            raise ValueError(f"prompt of {n + len(done)} tokens does not fit max_model_len={self.max_model_len}")
        ids = (*req.prompt_token_ids, *done)
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError("prompt token id out of vocabulary range")
        if req.params.logit_bias and req.params.logit_bias[-1][0] >= self.vocab_size:  # sorted by id
            raise ValueError(f"logit_bias token id {req.params.logit_bias[-1][0]} is out of vocabulary range "
                             f"(vocabulary of {self.vocab_size})")
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        self._check_adapter(req.adapter, req.adapter_path)
        grammar = self.structured.new_state(req.params.grammar) if req.params.grammar is not None else None
        generator = make_generator(req.params.seed)
        if req.rng_state is not None:
            set_generator_state(generator, req.rng_state)
        r = _Request(req, list(ids), generator, IncrementalDetokenizer(self.token_bytes),
                     StopStringMatcher(req.params.stop), output_ids=done, grammar=grammar,
                     prompt_served=n if done else 0)  # a resumed prompt was served (and counted) elsewhere
        texts = replay(r.detok, r.stop, done)
        for t in done if grammar is not None else ():
            grammar.consume(t)
        self._requests[req.request_id] = r
        self.scheduler.add(req.request_id, len(ids), r.token_ids, front=front, urgent=req.urgent,
                           priority=req.priority, tenant=req.tenant, weight=req.tenant_weight,
                           salt=adapter_salt(req.cache_salt, req.adapter), adapter=req.adapter or "")
        return texts

    def _check_adapter(self, name: str | None, path: str = "") -> None:
        """Read a request's adapter into the CPU tier now (its first use); ValueError (lora.AdapterError)
        when adapters are disabled, the name is not registered (and ``path`` does not name its directory),
        or its files are corrupt or do not fit."""
        if not name:
            return
        if self.adapters is None:
            raise ValueError(f"adapter {name!r}: LoRA adapters are disabled on this worker (max_loras=0)")
        if path and name not in self.adapters.paths:  # the request saw the registry record before this worker
            self.adapters.register(name, path)
        self.adapters.ensure_host(name, {r.req.adapter for r in self._requests.values() if r.req.adapter})

    def register_adapter(self, name: str, path: str) -> None:
        """Make LoRA adapter ``name`` (a PEFT directory at ``path``) servable; it is read on first use.
        ValueError when adapters are disabled or the name is malformed (AdapterManager.register)."""
        if self.adapters is None:
            raise ValueError("LoRA adapters are disabled on this worker (max_loras=0)")
        self.adapters.register(name, path)

    def unregister_adapter(self, name: str) -> bool:
        """Forget adapter ``name`` (retired); False, and nothing changes, while a live request names it."""
        if self.adapters is None or any(r.req.adapter == name for r in self._requests.values()):
            return False
        self.adapters.unregister(name)
        return True

    def detach_request(self, request_id: str) -> tuple[tuple[int, ...], bytes] | None:
        """Take a request out to migrate it (between steps): its blocks are freed (full ones stay in the
        prefix cache) and no output is reported for it. Returns (tokens generated so far, generator state
        bytes), None when unknown."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        self.scheduler.remove(request_id)
        return tuple(r.output_ids), generator_state(r.generator)

    # ----------------------------------------------------------------- step

    def step(self) -> list[StepOutput]:
        """Run one iteration; returns outputs (at most one per request)."""
        t0 = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return outputs
        lowered = self._set_threads(plan)
        masks = self._start_masks(plan)  # overlaps the forward (depends only on tokens already sampled)
        logits = self._forward(plan)
        if lowered:  # threads are process-wide: give them back
            torch.set_num_threads(self._threads)
        self.scheduler.commit(plan)
        sampling = [s for s in plan.seqs if s.samples]
        reqs = [self._requests[s.seq_id] for s in sampling]
        self.structured.finish_masks(masks, logits)  # in place: disallowed tokens of constrained rows -> -inf
        tokens = sample_batch(logits, [r.req.params for r in reqs], [r.generator for r in reqs],
                              [r.output_ids for r in reqs], [r.token_ids for r in reqs])
        self._update_stats(plan, len(tokens))
        lps = [None if r.req.params.logprobs is None else top_logprobs(logits[i], t, r.req.params.logprobs)
               for i, (r, t) in enumerate(zip(reqs, tokens))]
        outputs += [self._on_token(r, t, lp) for r, t, lp in zip(reqs, tokens, lps)]
        decodes = sum(1 for i in plan.seqs if i.num_new_tokens == 1)
        self.rates.observe(decodes, plan.num_batched_tokens - decodes, time.perf_counter() - t0)
        return outputs

    def _start_masks(self, plan: StepPlan):
        """Start the grammar masks of the constrained rows that sample in ``plan`` (row = index among the
        sampling seqs, as in the logits [S, V]); None when no row is constrained."""
        sampling = [self._requests[s.seq_id] for s in plan.seqs if s.samples]
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None]
        return self.structured.start_masks(rows, [sampling[i].grammar for i in rows])

    def _set_threads(self, plan: StepPlan) -> bool:
        """One thread for tiny steps (memory-bound GEMVs: a second thread gains little and, on a
        shared CPU, makes every op wait for a descheduled sibling), all threads otherwise."""
        if self.config.device != "cpu" or self._threads <= 1 or plan.num_batched_tokens > self.config.small_step_tokens:
            return False
        torch.set_num_threads(1)
        return True

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Build the packed batch for ``plan`` and run the model; logits [num sampling seqs, V]."""
        ids, positions, slots, tables, logits_idx = [], [], [], [], []
        for item in plan.seqs:
            r, table = self._requests[item.seq_id], self.block_manager.block_table(item.seq_id)
            end = item.start + item.num_new_tokens
            ids += r.token_ids[item.start : end]
            positions += range(item.start, end)
            slots += self._slots(table, item.start, end)
            tables.append(table)
            if item.samples:
                logits_idx.append(len(ids) - 1)
        meta = self._metadata(plan.seqs, positions, slots, tables, logits_idx)
        if self.adapters is not None:
            adapters = [self._requests[i.seq_id].req.adapter for i in plan.seqs]
            meta.lora = self.adapters.batch(adapters, meta.query_lens)
        return self.model.forward(self._tensor(ids), meta, self.kv.tensor)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        """Flat KV slots of positions ``start .. end-1`` given a block table."""
        bs = self.config.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.config.device)

    def _metadata(self, items: list[ScheduledSeq], positions, slots, tables, logits_idx) -> BatchMetadata:
        return BatchMetadata(
            positions=self._tensor(positions),
            slot_mapping=self._tensor(slots),
            context_slots=None,
            query_lens=[s.num_new_tokens for s in items],
            context_lens=[s.start + s.num_new_tokens for s in items],
            logits_indices=self._tensor(logits_idx),
            block_tables=tables,
        )

    # ----------------------------------------------------------------- stopping

    def _on_token(self, r: _Request, token: int, logprob: tuple | None = None) -> StepOutput:
        """Record ``token`` for ``r``, apply stop rules, return its StepOutput (finishing it if done)."""
        r.output_ids.append(token)
        r.token_ids.append(token)
        self.scheduler.append_token(r.req.request_id)
        reason = self._stop_token_reason(r, token)
        text = "" if reason else r.stop.feed(r.detok.add_tokens([token]))
        reason = reason or ("stop" if r.stop.stopped else self._grammar_reason(r, token) or self._length_reason(r))
        if reason and not r.stop.stopped:
            text += r.stop.feed(r.detok.flush())
            text += r.stop.flush()
            reason = "stop" if r.stop.stopped else reason
        cached = self.scheduler.cached_prompt_tokens(r.req.request_id) if reason else 0
        if reason:
            self._finish(r)
        return StepOutput(
            r.req.request_id, (token,), text, reason is not None, reason, r.num_prompt, len(r.output_ids),
            None if logprob is None else (logprob,), cached,
        )

    def _stop_token_reason(self, r: _Request, token: int) -> str | None:
        """"stop" for EOS (unless ignore_eos) or a stop_token_id, else None."""
        p = r.req.params
        if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos):
            return "stop"
        return None

    def _grammar_reason(self, r: _Request, token: int) -> str | None:
        """Feed ``token`` to the request's matcher; "stop" once the grammar admits no continuation (the
        token's text is still emitted).  EOS is masked out until the grammar accepts, so an EOS that
        reaches the stop rules always ends a complete output."""
        if r.grammar is None:
            return None
        r.grammar.consume(token)
        return "stop" if r.grammar.is_stopped() else None

    def _length_reason(self, r: _Request) -> str | None:
        """"length" when max_tokens or max_model_len is reached, else None."""
        if len(r.output_ids) >= r.req.params.max_tokens or len(r.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, r: _Request) -> None:
        self.scheduler.remove(r.req.request_id)
        del self._requests[r.req.request_id]

    # ----------------------------------------------------------------- reporting

    def _update_stats(self, plan: StepPlan, num_sampled: int) -> None:
        s = self._stats
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.num_prompt_tokens += sum(
            max(0, min(i.start + i.num_new_tokens, self._prompt_len(i.seq_id)) - i.start) for i in plan.seqs
        )
        s.max_batch_size_seen = max(s.max_batch_size_seen, len(plan.seqs))
        self._count_served(plan)
        s.extra["num_preemptions"] = self.scheduler.num_preemptions
        s.extra["prefix_cache_hit_tokens"] = self.block_manager.prefix_hit_tokens
        s.extra["prefix_cache_query_tokens"] = self.block_manager.prefix_query_tokens
        s.extra["prefix_hits_by_tenant"] = dict(self.scheduler.prefix_hits_by_tenant)
        s.extra["num_kv_reclaims"] = self.scheduler.num_kv_reclaims

    def _count_served(self, plan: StepPlan) -> None:
        """Add the step's service to ``stats.served[tenant]``: prompt positions computed for the first time
        (a preempted request's recomputation is not counted again) and one generated token per sampled row."""
        with self._served_lock:
            for item in plan.seqs:
                r = self._requests[item.seq_id]
                end = min(item.start + item.num_new_tokens, r.num_prompt)
                counts = self._stats.served.setdefault(r.req.tenant, [0, 0])
                counts[0] += max(0, end - max(item.start, r.prompt_served))
                counts[1] += int(item.samples)
                r.prompt_served = max(r.prompt_served, end)

    def _prompt_len(self, seq_id: str) -> int:
        r = self._requests.get(seq_id)
        return r.num_prompt if r else 0

    def _extra_stats(self) -> dict:
        """num_constrained_steps, grammar_*, mask_ms_total (structured outputs) and lora_* (adapters) for
        ``stats().extra``."""
        return {**self.structured.stats(), **(self.adapters.stats() if self.adapters is not None else {})}


def adapter_salt(salt: bytes, adapter: str | None) -> bytes:
    """The prefix-cache salt of a request: its tenant salt, extended by its adapter's name, so blocks computed
    with one adapter (or none) are never shared with another (different weights, different K/V)."""
    return salt + b"\x00lora:" + adapter.encode() if adapter else salt
