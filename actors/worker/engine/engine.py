"""``LLMEngine``: continuous-batching inference over a paged KV cache, with the compute behind a runner.

One ``step()`` = plan (``IterationScheduler``), the runner's ``execute`` (runner.py: one packed forward over every
scheduled token and sampling; ``TorchRunner`` on CPU or CUDA, or the zero-compute runner), then the stop rules
and incremental detokenization. The engine keeps the request bookkeeping once, as parts with named interfaces
(docs/decisions/0036-runner-seam.md): ``KVBlocks`` (kv_blocks.py: block manager, prefix cache, scheduler),
``RequestBook`` (request_book.py), ``StopRules`` (stopping.py) and ``UsageMeter`` (usage.py).

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

import time
from dataclasses import dataclass

from .arch_spec import kv_release_window
from .detokenizer import IncrementalDetokenizer, StopStringMatcher, replay
from .hardware import DTYPES
from .iteration_scheduler import StepPlan
from .kv_blocks import KVBlocks
from .quant import QUANTIZERS
from .request_book import RequestBook, RequestState
from .runner import ModelRunner, RowSampling, RunnerInput, RunnerRow
from .stopping import StopRules
from .types import EngineRequest, EngineStats, StepOutput
from .usage import UsageMeter

_DTYPES = DTYPES

# Attributes of the runner read through the engine (``engine.kv``, ``engine.model``, ...) by the worker shell,
# benches and tests; a runner that lacks one (zero-compute: no model, no KV tensor) raises AttributeError.
RUNNER_ATTRS = frozenset({
    "model", "kv", "tp", "adapters", "model_config", "dtype_name", "quantization", "weights_bytes",
    "weights_shared", "weights_cached", "load_phases", "lora_reserve_bytes", "position_limit", "structured",
    "special_names", "name", "cycle", "num_blocks", "native_off_reason", "held", "row_table", "whole_step_line",
})


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
    # the quantization was asked for (None: unless "auto"): re-quantize what the file does not hold exactly (kquant.py)
    quantization_pinned: bool | None = None
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
    # CPU, quantized, one rank: the measured kernel per step row count (row_kernels.RowTable.to_json(), from
    # kernel_choice.Choice.row_table); None = each projection as make_linear_factory builds it
    row_kernels: dict | None = None
    # CPU native path: decode steps of up to 8 rows run every layer in one native call (whole_step.py, issue [24])
    whole_step: bool = True

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
        if not isinstance(self.whole_step, bool):
            raise ValueError(f"whole_step must be a bool, got {self.whole_step!r}")
        if self.row_kernels is not None:
            from .row_kernels import RowTable

            try:
                RowTable.from_json(self.row_kernels)
            except ValueError as exc:
                raise ValueError(f"row_kernels: {exc}") from None


class LLMEngine:
    """See module docstring.  Not thread-safe: call from one thread (the worker's engine loop); ``stats()`` may
    be called from another."""

    def __init__(self, config: EngineConfig, share_weights_of: "LLMEngine | None" = None,
                 runner: ModelRunner | None = None) -> None:
        """The engine over ``runner`` (``config``: any ``kv_blocks.SchedulingConfig``, e.g. the zero-compute
        one); None: a ``TorchRunner`` loading ``config.model_path`` (an ``EngineConfig``), with
        ``share_weights_of`` (an engine of the same artifact, dtype and device, one rank) over that engine's
        weights instead of a copy (a multi-version host's versions of one artifact, actors/worker/host.py).
        ValueError when ``share_weights_of`` does not match."""
        self.config = config
        if runner is None:
            from .torch_runner import TorchRunner
            runner = TorchRunner(config, share_weights_of.runner if share_weights_of is not None else None)
        self.runner = runner
        self.vocab_size, self._eos_token_ids = runner.vocab_size, runner.eos_token_ids
        self.token_bytes = runner.token_bytes
        self.book = RequestBook()
        self._build_blocks()
        self.usage = UsageMeter(self.blocks.num_blocks)

    def _build_blocks(self) -> None:
        """Block space, scheduler and stop rules over the runner's KV blocks (at load, after ``resize_kv``)."""
        self.blocks = KVBlocks(self.config, self.runner.num_blocks, self.runner.position_limit,
                               self.runner.admit_gate,
                               kv_release_window(getattr(self.runner, "model_config", None)))
        self.block_manager, self.scheduler = self.blocks.block_manager, self.blocks.scheduler
        self.max_model_len = self.blocks.max_model_len
        self.stop_rules = StopRules(self._eos_token_ids, self.max_model_len)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS / end-of-turn ids that finish a request ("stop", unless ignore_eos); the runner's by default."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self._eos_token_ids = tuple(ids)
        self.stop_rules = StopRules(self._eos_token_ids, self.max_model_len)

    def __getattr__(self, name: str):
        """``RUNNER_ATTRS`` read from the runner (AttributeError for other names, or when it lacks one)."""
        if name in RUNNER_ATTRS and "runner" in self.__dict__:
            return getattr(self.runner, name)
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def describe(self) -> str:
        """One start-up log line (the runner's)."""
        return self.runner.describe()

    def close(self) -> None:
        """Release the runner (tensor-parallel followers, groups)."""
        self.runner.close()

    def resize_kv(self, kv_bytes: int) -> None:
        """Replace the KV cache by one of ``kv_bytes`` bytes (a host re-splitting its budget when residency
        changes). Only on an idle engine: RuntimeError when a request is held or with tensor parallelism;
        ValueError below one block. Cached prefixes are dropped."""
        if not self.book.is_idle():
            raise RuntimeError("resize_kv needs an idle one-rank engine")
        self.runner.resize_kv(int(kv_bytes))
        self._build_blocks()
        self.usage.set_total_blocks(self.blocks.num_blocks)

    # ----------------------------------------------------------------- requests

    def add_request(self, req: EngineRequest, front: bool = False) -> list[str]:
        """Queue ``req`` (``front``: ahead of every waiting request, e.g. after ``preempt_request`` made
        room for it); ValueError if its prompt is empty, too long, has bad ids (prompt or logit_bias), the
        id is taken, its adapter cannot be served, or it has a grammar and the runner serves none.

        A migrated sequence (``req.resumed_output_ids``, ``req.rng_state``) starts with those tokens generated:
        its KV is recomputed from prompt + them in its first step (as after a recompute preemption), its
        random state continues from ``rng_state``, and its detokenizer, stop matcher and grammar matcher are
        replayed through them. Returns the text each resumed token released (already sent; [] otherwise)."""
        self._validate(req)
        self.runner.check_adapter(req.adapter, req.adapter_path, self.book.adapters_in_use())
        grammar = self._grammar(req)
        r = RequestState.of(req, self.runner.new_rng(req.params.seed, req.rng_state),
                            IncrementalDetokenizer(self.token_bytes), StopStringMatcher(req.params.stop),
                            adapter_salt(req.cache_salt, req.adapter), grammar)
        texts = replay(r.detok, r.stop, r.output_ids)
        for t in r.output_ids if grammar is not None else ():
            grammar.consume(t)
        self.book.add(r)
        self.scheduler.enqueue(r, front)  # the same record: the book and the scheduler share it
        return texts

    def _validate(self, req: EngineRequest) -> None:
        """ValueError for an empty or too long prompt, an id out of the vocabulary, or a taken request id."""
        n, ids = len(req.prompt_token_ids), (*req.prompt_token_ids, *req.resumed_output_ids)
        if n == 0:
            raise ValueError("prompt_token_ids is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError("prompt token id out of vocabulary range")
        if req.params.logit_bias and req.params.logit_bias[-1][0] >= self.vocab_size:  # sorted by id
            raise ValueError(f"logit_bias token id {req.params.logit_bias[-1][0]} is out of vocabulary range "
                             f"(vocabulary of {self.vocab_size})")
        if req.request_id in self.book:
            raise ValueError(f"duplicate request_id {req.request_id!r}")

    def _grammar(self, req: EngineRequest):
        """The request's grammar matcher (structured.GrammarState), None without a grammar; ValueError when the
        runner serves no structured outputs or the grammar is bad."""
        if req.params.grammar is None:
            return None
        if self.runner.structured is None:
            raise ValueError("structured outputs are not supported by this engine's runner")
        return self.runner.structured.new_state(req.params.grammar)

    def register_adapter(self, name: str, path: str) -> None:
        """Make LoRA adapter ``name`` (a PEFT directory at ``path``) servable; it is read on first use.
        ValueError when adapters are disabled or the name is malformed (AdapterManager.register)."""
        self.runner.register_adapter(name, path)

    def unregister_adapter(self, name: str) -> bool:
        """Forget adapter ``name`` (retired); False, and nothing changes, while a live request names it."""
        if name in self.book.adapters_in_use():
            return False
        self.runner.unregister_adapter(name)
        return True

    def detach_request(self, request_id: str) -> tuple[tuple[int, ...], bytes] | None:
        """Take a request out to migrate it (between steps): its blocks are freed (full ones stay in the
        prefix cache) and no output is reported for it. Returns (tokens generated so far, random state
        bytes of the runner), None when unknown."""
        r = self._release(request_id)
        if r is None:
            return None
        return tuple(r.output_ids), self.runner.rng_state(r.rng)

    def preempt_request(self, request_id: str) -> bool:
        """Recompute-preempt a running request between steps (vLLM's recompute preemption, Kwon et al.
        2023): its KV blocks are freed (full blocks stay in the prefix cache) and it waits at the tail of
        the queue; when readmitted it recomputes prompt + generated tokens and goes on generating as if
        uninterrupted. False when the request is not running (unknown, finished or already waiting)."""
        return self.scheduler.preempt(request_id)

    def is_running(self, request_id: str) -> bool:
        """True when ``request_id`` is in the running batch (admitted, not waiting or preempted)."""
        return self.scheduler.is_running(request_id)

    def has_request(self, request_id: str) -> bool:
        """True while ``request_id`` waits or runs in the engine (an abort not yet reported counts as gone)."""
        return request_id in self.book

    def abort_request(self, request_id: str) -> None:
        """Drop a request and free its blocks; next ``step()`` reports it finished ("abort")."""
        r = self._release(request_id)
        if r is not None:
            self.book.report_abort(r)

    def _release(self, request_id: str) -> RequestState | None:
        """Take ``request_id``'s record out of the book and the scheduler (its blocks freed, full ones kept in the
        prefix cache): the one exit of a request, finished, aborted or detached. None when unknown."""
        r = self.book.pop(request_id)
        if r is not None:
            self.scheduler.remove(request_id)
        return r

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, or has an abort still to report."""
        return not self.book.is_idle()

    # ----------------------------------------------------------------- step

    def step(self) -> list[StepOutput]:
        """Run one iteration; returns outputs (at most one per request)."""
        t0 = time.perf_counter()
        outputs = self.book.take_aborted()
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return outputs
        batch = self._runner_input(plan)
        out = self.runner.execute(batch)
        self.scheduler.commit(plan)
        self.usage.record_step(plan, [self.book.get(s.seq_id) for s in plan.seqs], len(out.sampled_ids),
                               self.scheduler, self.block_manager)
        reqs = [self.book.get(row.seq_id) for row in batch.sampling_rows]
        outputs += [self._on_token(r, t, lp) for r, t, lp in zip(reqs, out.sampled_ids, out.logprobs)]
        decodes = sum(1 for i in plan.seqs if i.num_new_tokens == 1)
        self.usage.rates.observe(decodes, plan.num_batched_tokens - decodes, time.perf_counter() - t0)
        return outputs

    def _runner_input(self, plan: StepPlan) -> RunnerInput:
        """The runner's view of ``plan``: per scheduled sequence its new tokens, block table and sampling."""
        rows = []
        for item in plan.seqs:
            r = self.book.get(item.seq_id)
            sampling = RowSampling(r.req.params, r.rng, r.output_ids, r.token_ids, r.grammar) \
                if item.samples else None
            rows.append(RunnerRow(item.seq_id, r.token_ids[item.start:item.start + item.num_new_tokens], item.start,
                                  self.block_manager.block_table(item.seq_id), item.samples, r.req.adapter,
                                  sampling))
        return RunnerInput(rows, self.config.block_size)

    def _on_token(self, r: RequestState, token: int, logprob: tuple | None = None) -> StepOutput:
        """Record ``token`` for ``r``, apply the stop rules, return its StepOutput (finishing it if done)."""
        rid = r.req.request_id
        text, reason = self.stop_rules.feed(r, token)
        self.scheduler.append_token(rid)
        cached = self.scheduler.cached_prompt_tokens(rid) if reason else 0
        if reason:
            self._release(rid)
        return StepOutput(rid, (token,), text, reason is not None, reason, r.num_prompt, len(r.output_ids),
                          None if logprob is None else (logprob,), cached)

    # ----------------------------------------------------------------- reporting

    def stats(self) -> EngineStats:
        """Snapshot of counters (a copy)."""
        return self.usage.snapshot(self.scheduler, self.block_manager, self.runner.extra_stats())

    @property
    def rates(self):
        """The measured step rates (step_rates.StepRates)."""
        return self.usage.rates

    def reset_counters(self) -> None:
        """Forget the counters, step-rate measurements and prefix-cache hit counts (after a warm-up pass)."""
        self.block_manager.prefix_query_tokens = self.block_manager.prefix_hit_tokens = 0
        self.scheduler.prefix_hits_by_tenant.clear()
        self.usage.reset(self.blocks.num_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget all cached prefixes (cold start for the next request); returns blocks dropped."""
        return self.block_manager.reset_prefix_cache()

    @property
    def max_num_seqs(self) -> int:
        """Sequence slots (sequences in one step), from the config."""
        return self.config.max_num_seqs

    @property
    def block_size(self) -> int:
        """Tokens per KV cache block, from the config."""
        return self.config.block_size

    def credits(self) -> tuple[int, int]:
        """(free KV blocks, free sequence slots = max_num_seqs - running - waiting, >= 0)."""
        used = self.scheduler.num_running + self.scheduler.num_waiting
        return self.block_manager.num_free_blocks, max(0, self.config.max_num_seqs - used)


def adapter_salt(salt: bytes, adapter: str | None) -> bytes:
    """The prefix-cache salt of a request: its tenant salt, extended by its adapter's name, so blocks computed
    with one adapter (or none) are never shared with another (different weights, different K/V)."""
    return salt + b"\x00lora:" + adapter.encode() if adapter else salt
