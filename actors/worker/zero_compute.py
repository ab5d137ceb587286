"""The zero-compute engine: the ``LLMEngine`` interface with no model behind it (``--engine zero-compute``).

What it is for: measuring what the platform itself costs (``actorserve bench platform``, issue 15 item 6,
docs/decisions/0029-platform-cost.md). A worker started with ``--engine zero-compute`` serves every request
of its version with deterministic tokens and never runs a forward pass, so the CPU the stack spends is the
gateway's, validator's, scheduler's, the worker shell's, the bus's and etcd's alone. It is never chosen
unless asked for: the worker's default is ``--engine torch``; its log, its etcd record (``"engine":
"zero-compute"``) and ``actorserve status`` name it.

What it keeps of the real engine (actors/worker/engine/engine.py), so that the worker shell, the scheduler
and the gateway see the same traffic:

* batching: the same pure ``IterationScheduler`` and ``BlockManager`` (chunked prefill under
  ``max_num_batched_tokens``, ``max_num_seqs`` slots, KV blocks sized from the GGUF's shape and the byte
  budget as ``KVCache`` sizes them, prefix caching, recompute preemption);
* the real tokenizer's bytes (read from the GGUF's metadata only, no tensor is loaded), the incremental
  detokenizer and the stop-string matcher: ``max_tokens``, ``max_model_len``, ``stop``,
  ``stop_token_ids``, ``ignore_eos`` behave as in the real engine;
* the outputs: one ``StepOutput`` per sampled row per step, aborts reported on the next step.

The tokens: output position ``i`` of every request is ``cycle[i % len(cycle)]``, where ``cycle`` is the first
``CYCLE_LEN`` vocabulary ids (by id) whose bytes are an ASCII space followed by 2 or more ASCII letters (a
word each), so the text is readable and every token decodes on its own. With ``eos_after = n > 0`` the
``n``-th output token is the GGUF's EOS id instead, which ends the request ("stop") unless ``ignore_eos``.
Logprobs, when asked for, are 0.0 (probability 1: the output is fixed) with the token itself as the only
top entry. Structured outputs (``params.grammar``) are refused with ValueError (the worker answers 400).
``step_ms``: each step sleeps that long (ms) to stand for a forward pass; 0 (default) returns at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from actors.text.gguf_meta import read_gguf_metadata
from actors.worker.engine.block_manager import BlockManager
from actors.worker.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, replay, token_bytes_table
from actors.worker.engine.iteration_scheduler import IterationScheduler, StepPlan
from actors.worker.engine.request_book import RequestBook
from actors.worker.engine.step_rates import StepRates
from actors.worker.engine.types import EngineRequest, EngineStats, StepOutput

ENGINE_NAME = "zero-compute"
CYCLE_LEN = 16  # distinct tokens of the output cycle
_KV_ELEM_BYTES = 4  # the KV cache of the float32 default engine (bytes per element), for block counts


@dataclass
class ZeroComputeConfig:
    """Settings; ValueError on bad values. Same meanings as ``EngineConfig``'s fields of the same name."""

    model_path: str  # GGUF: tokenizer, EOS ids, context length and KV shape are read from its metadata
    kv_cache_bytes: int = 256 * 2**20  # budget the block count is derived from (bytes; no memory is taken)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the GGUF's context length (capped by KV capacity)
    enable_prefix_caching: bool = True
    eos_after: int = 0  # > 0: the eos_after-th output token is EOS (ends it unless ignore_eos); 0: never
    step_ms: float = 0.0  # sleep per step standing for a forward pass (ms); 0: none

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required")
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.eos_after < 0 or self.step_ms < 0:
            raise ValueError("eos_after and step_ms must be >= 0")


@dataclass
class _Request:
    req: EngineRequest
    token_ids: list[int]  # prompt + generated
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    output_ids: list[int] = field(default_factory=list)
    prompt_served: int = 0

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)


def word_cycle(token_bytes: list[bytes], n: int = CYCLE_LEN) -> tuple[int, ...]:
    """The first ``n`` ids whose bytes are b" " + 2 or more ASCII letters; fewer found: any non-empty
    tokens fill up. ValueError when the vocabulary has no non-empty token."""
    words = [i for i, b in enumerate(token_bytes)
             if len(b) >= 3 and b[:1] == b" " and b[1:].isascii() and b[1:].isalpha()][:n]
    if len(words) < n:
        words += [i for i, b in enumerate(token_bytes) if b and i not in words][: n - len(words)]
    if not words:
        raise ValueError("the GGUF vocabulary has no token with text")
    return tuple(words)


class ZeroComputeEngine(RequestBook):
    """See module docstring. Not thread-safe (one caller: the worker's step loop), like ``LLMEngine``."""

    name = ENGINE_NAME
    quantization = None
    dtype_name = "none"

    def __init__(self, config: ZeroComputeConfig) -> None:
        self.config = config
        meta = read_gguf_metadata(config.model_path, full_arrays=("tokenizer.ggml.tokens",
                                                                  "tokenizer.ggml.token_type"))
        types = meta.get("tokenizer.ggml.token_type")
        self.token_bytes = token_bytes_table(meta["tokenizer.ggml.tokens"], types if isinstance(types, list) else None)
        self.vocab_size = len(self.token_bytes)
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
        self.cycle = word_cycle(self.token_bytes)
        self.num_blocks = max(1, config.kv_cache_bytes // _block_bytes(meta, config.block_size))
        arch = meta.get("general.architecture", "llama")
        limit = config.max_model_len or int(meta.get(f"{arch}.context_length", 2048))
        self.max_model_len = min(limit, self.num_blocks * config.block_size)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = IterationScheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._requests: dict[str, _Request] = {}
        self._aborted: list[StepOutput] = []
        self._stats = EngineStats(num_total_blocks=self.num_blocks)
        self.rates = StepRates()
        self._served_lock = threading.Lock()

    def describe(self) -> str:
        """One start-up log line: what this engine is and its capacity."""
        return (f"engine {ENGINE_NAME}: NO MODEL COMPUTE (deterministic tokens, platform measurement only); "
                f"{self.num_blocks} blocks x {self.config.block_size} tokens, max_model_len {self.max_model_len}")

    # ---- requests (same contract as LLMEngine) ----------------------------------------------
    def add_request(self, req: EngineRequest, front: bool = False) -> list[str]:
        """Queue ``req``; ValueError on an empty / too long / out-of-vocabulary prompt, a duplicate id, or a
        grammar. Returns the text of resumed tokens (a migrated sequence), as ``LLMEngine.add_request``."""
        done = list(req.resumed_output_ids)
        ids = (*req.prompt_token_ids, *done)
        if not req.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError("prompt token id out of vocabulary range")
        if req.params.grammar is not None:
            raise ValueError("structured outputs are not supported by the zero-compute engine")
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request_id {req.request_id!r}")
        r = _Request(req, list(ids), IncrementalDetokenizer(self.token_bytes), StopStringMatcher(req.params.stop),
                     output_ids=done, prompt_served=len(req.prompt_token_ids) if done else 0)
        texts = replay(r.detok, r.stop, done)
        self._requests[req.request_id] = r
        self.scheduler.add(req.request_id, len(ids), r.token_ids, front=front, urgent=req.urgent,
                           priority=req.priority)
        return texts

    def detach_request(self, request_id: str) -> tuple[tuple[int, ...], bytes] | None:
        """Take a request out to migrate it: (tokens generated, b"" — no sampler state), None when unknown."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        self.scheduler.remove(request_id)
        return tuple(r.output_ids), b""

    # ---- step --------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One iteration of the real engine's plan with the forward pass replaced by the token cycle."""
        t0 = time.perf_counter()
        outputs, self._aborted = self._aborted, []
        plan = self.scheduler.schedule()
        if plan.is_empty():
            return outputs
        if self.config.step_ms:
            time.sleep(self.config.step_ms / 1e3)
        self.scheduler.commit(plan)
        sampling = [self._requests[s.seq_id] for s in plan.seqs if s.samples]
        self._update_stats(plan, len(sampling))
        outputs += [self._on_token(r, self._next_token(r)) for r in sampling]
        decodes = sum(1 for s in plan.seqs if s.num_new_tokens == 1)
        self.rates.observe(decodes, plan.num_batched_tokens - decodes, time.perf_counter() - t0)
        return outputs

    def _next_token(self, r: _Request) -> int:
        i = len(r.output_ids)
        if self.config.eos_after and i + 1 == self.config.eos_after and self.eos_token_ids:
            return self.eos_token_ids[0]
        return self.cycle[i % len(self.cycle)]

    def _on_token(self, r: _Request, token: int) -> StepOutput:
        """Record ``token``, apply the stop rules of ``LLMEngine._on_token``, return its StepOutput."""
        r.output_ids.append(token)
        r.token_ids.append(token)
        self.scheduler.append_token(r.req.request_id)
        p = r.req.params
        reason = "stop" if token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos) else None
        text = "" if reason else r.stop.feed(r.detok.add_tokens([token]))
        if not reason:
            reason = "stop" if r.stop.stopped else self._length_reason(r)
        if reason and not r.stop.stopped:
            text += r.stop.feed(r.detok.flush()) + r.stop.flush()
            reason = "stop" if r.stop.stopped else reason
        if reason:
            self.scheduler.remove(r.req.request_id)
            del self._requests[r.req.request_id]
        lp = None if p.logprobs is None else ((token, 0.0, ((token, 0.0),)),)
        return StepOutput(r.req.request_id, (token,), text, reason is not None, reason, r.num_prompt,
                          len(r.output_ids), lp)

    def _length_reason(self, r: _Request) -> str | None:
        if len(r.output_ids) >= r.req.params.max_tokens or len(r.token_ids) >= self.max_model_len:
            return "length"
        return None

    # ---- reporting ---------------------------------------------------------------------------
    def _update_stats(self, plan: StepPlan, num_sampled: int) -> None:
        s = self._stats
        s.num_steps += 1
        s.num_generated_tokens += num_sampled
        s.max_batch_size_seen = max(s.max_batch_size_seen, len(plan.seqs))
        with self._served_lock:
            for item in plan.seqs:
                r = self._requests[item.seq_id]
                end = min(item.start + item.num_new_tokens, r.num_prompt)
                new_prompt = max(0, end - max(item.start, r.prompt_served))
                s.num_prompt_tokens += new_prompt
                counts = s.served.setdefault(r.req.tenant, [0, 0])
                counts[0] += new_prompt
                counts[1] += int(item.samples)
                r.prompt_served = max(r.prompt_served, end)
        s.extra["num_preemptions"] = self.scheduler.num_preemptions
        s.extra["prefix_cache_hit_tokens"] = self.block_manager.prefix_hit_tokens
        s.extra["prefix_cache_query_tokens"] = self.block_manager.prefix_query_tokens


def _block_bytes(meta: dict, block_size: int) -> int:
    """Bytes of one KV block of the GGUF's shape in float32, as ``kv_cache.bytes_per_block`` computes it."""
    arch = meta.get("general.architecture", "llama")
    layers = int(meta.get(f"{arch}.block_count", 1))
    heads = int(meta.get(f"{arch}.attention.head_count", 1))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0)) or int(meta.get(f"{arch}.embedding_length", 64)) // heads
    return layers * 2 * block_size * kv_heads * head_dim * _KV_ELEM_BYTES
