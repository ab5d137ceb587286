"""The zero-compute engine: ``LLMEngine`` over a runner that does no model compute (``--engine zero-compute``).

What it is for: measuring what the platform itself costs (``actorserve bench platform``, issue 15 item 6,
docs/decisions/0029-platform-cost.md). A worker started with ``--engine zero-compute`` serves every request
of its version with deterministic tokens and never runs a forward pass, so the CPU the stack spends is the
gateway's, validator's, scheduler's, the worker shell's, the bus's and etcd's alone. It is never chosen
unless asked for: the worker's default is ``--engine torch``; its log, its etcd record (``"engine":
"zero-compute"``) and ``actorserve status`` name it.

It is the real engine (actors/worker/engine/engine.py) with ``ZeroComputeRunner`` behind the runner seam
(actors/worker/engine/runner.py, docs/decisions/0036-runner-seam.md): the request bookkeeping is the same code,
so the worker shell, the scheduler and the gateway see the same traffic:

* batching: the same pure ``IterationScheduler`` and ``BlockManager`` (chunked prefill under
  ``max_num_batched_tokens``, ``max_num_seqs`` slots, KV blocks sized from the GGUF's shape and the byte
  budget as ``KVCache`` sizes them, prefix caching, recompute preemption);
* the real tokenizer's bytes (read from the GGUF's metadata only, no tensor is loaded), the incremental
  detokenizer and the stop-string matcher: ``max_tokens``, ``max_model_len``, ``stop``,
  ``stop_token_ids``, ``ignore_eos`` behave as in the real engine;
* the outputs and counters: one ``StepOutput`` per sampled row per step (``num_cached_tokens`` on the last),
  aborts reported on the next step, ``EngineStats`` counted as the real engine counts them.

The tokens: output position ``i`` of every request is ``cycle[i % len(cycle)]``, where ``cycle`` is the first
``CYCLE_LEN`` vocabulary ids (by id) whose bytes are an ASCII space followed by 2 or more ASCII letters (a
word each), so the text is readable and every token decodes on its own. With ``eos_after = n > 0`` the
``n``-th output token is the GGUF's EOS id instead, which ends the request ("stop") unless ``ignore_eos``.
Logprobs, when asked for, are 0.0 (probability 1: the output is fixed) with the token itself as the only
top entry. Structured outputs (``params.grammar``) are refused with ValueError (the worker answers 400).
``step_ms``: each step sleeps that long (ms) to stand for a forward pass; 0 (default) returns at once.
``curve`` (a measured ``ThroughputCurve``, control/policy/curves.py): each step sleeps what the curve says a step
of its shape takes instead (``ThroughputCurve.step_ms_at``: ITL at its decode rows plus a lone prefill of its
prompt tokens), so the stack sees a real engine's timing without its CPU use: ``actorserve bench sim-check
--engine zero-compute`` holds the simulator to the live stack's queueing, batching and scheduling this way
(issue [29] item 4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from actors.text.gguf_meta import read_gguf_metadata
from actors.worker.engine.detokenizer import token_bytes_table
from actors.worker.engine.engine import LLMEngine
from actors.worker.engine.runner import RunnerInput, RunnerOutput, RowSampling
from control.policy.curves import ThroughputCurve

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
    curve: ThroughputCurve | None = None  # sleep per step as this measured curve says (not with step_ms)

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
        if self.curve is not None and self.step_ms:
            raise ValueError("give step_ms or curve, not both")
        if self.curve is not None and not self.curve.prefill:
            raise ValueError("the curve needs prefill points (actorserve profile measures them)")


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


class ZeroComputeRunner:
    """The ``ModelRunner`` (runner.py) that computes nothing: output position ``i`` of a request is
    ``cycle[i % len(cycle)]`` (or EOS at ``eos_after``), its logprob 0.0. Reads only the GGUF's metadata."""

    name = ENGINE_NAME
    quantization = None
    dtype_name = "none"
    structured = None  # grammars are refused

    def __init__(self, config: ZeroComputeConfig) -> None:
        self.config = config
        meta = read_gguf_metadata(config.model_path, full_arrays=("tokenizer.ggml.tokens",
                                                                  "tokenizer.ggml.token_type"))
        types = meta.get("tokenizer.ggml.token_type")
        self.token_bytes = token_bytes_table(meta["tokenizer.ggml.tokens"], types if isinstance(types, list) else None,
                                             model=meta.get("tokenizer.ggml.model"),
                                             add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        self.vocab_size = len(self.token_bytes)
        eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos if i is not None))
        self.cycle = word_cycle(self.token_bytes)
        self.num_blocks = max(1, config.kv_cache_bytes // _block_bytes(meta, config.block_size))
        arch = meta.get("general.architecture", "llama")
        self.position_limit = config.max_model_len or int(meta.get(f"{arch}.context_length", 2048))

    def describe(self) -> str:
        """One start-up log line: what this runner is and its capacity."""
        max_len = min(self.position_limit, self.num_blocks * self.config.block_size)
        return (f"engine {ENGINE_NAME}: NO MODEL COMPUTE (deterministic tokens, platform measurement only); "
                f"{self.num_blocks} blocks x {self.config.block_size} tokens, max_model_len {max_len}")

    def close(self) -> None:
        """Nothing to release."""

    def new_rng(self, seed: int | None, state: bytes | None) -> None:
        """No random state: the output is fixed."""
        return None

    def rng_state(self, rng: None) -> bytes:
        """b"" (no sampler state to migrate)."""
        return b""

    def check_adapter(self, name: str | None, path: str, in_use: set[str]) -> None:
        """Every adapter is served (as the base model: no weights)."""

    def admit_gate(self, name: str, in_use: set[str]) -> bool:
        """Always True (no adapter slots to find)."""
        return True

    def register_adapter(self, name: str, path: str) -> None:
        """ValueError: no adapters are kept (the worker shell skips a runner without ``adapters``)."""
        raise ValueError("the zero-compute engine keeps no LoRA adapters")

    def unregister_adapter(self, name: str) -> None:
        """Nothing kept, nothing to forget."""

    def resize_kv(self, kv_bytes: int) -> int:
        """RuntimeError: a zero-compute engine is never one of a multi-version host's versions."""
        raise RuntimeError("the zero-compute engine does not resize its KV cache")

    def extra_stats(self) -> dict:
        """No runner counters."""
        return {}

    def execute(self, batch: RunnerInput) -> RunnerOutput:
        """The next cycle token of every sampling row, after ``step_ms`` (or the curve's time for this step) of
        sleep; logprobs 0.0 with the token itself as the only top entry."""
        if self.config.step_ms:
            time.sleep(self.config.step_ms / 1e3)
        elif self.config.curve is not None:
            time.sleep(self.config.curve.step_ms_at(*step_shape(batch)) / 1e3)
        tokens = [self._next_token(row.sampling) for row in batch.sampling_rows]
        lps = [None if row.sampling.params.logprobs is None else (t, 0.0, ((t, 0.0),))
               for row, t in zip(batch.sampling_rows, tokens)]
        return RunnerOutput(tokens, lps)

    def _next_token(self, s: RowSampling) -> int:
        i = len(s.output_ids)
        if self.config.eos_after and i + 1 == self.config.eos_after and self.eos_token_ids:
            return self.eos_token_ids[0]
        return self.cycle[i % len(self.cycle)]


def step_shape(batch: RunnerInput) -> tuple[int, int]:
    """(decode rows, prefill tokens) of a step: a decode is a one-token row of a request that has generated
    before; every other row's tokens (prompt chunks, a preempted request's recompute) are prefill."""
    decodes = sum(1 for r in batch.seqs if r.num_new_tokens == 1 and r.sampling is not None and r.sampling.output_ids)
    return decodes, batch.num_batched_tokens - decodes


class ZeroComputeEngine(LLMEngine):
    """``LLMEngine`` over a ``ZeroComputeRunner`` (module docstring). Not thread-safe, like ``LLMEngine``."""

    def __init__(self, config: ZeroComputeConfig) -> None:
        """Read ``config.model_path``'s metadata (no tensor); ValueError on a bad GGUF."""
        super().__init__(config, runner=ZeroComputeRunner(config))


def _block_bytes(meta: dict, block_size: int) -> int:
    """Bytes of one KV block of the GGUF's shape in float32, as ``kv_cache.bytes_per_block`` computes it."""
    arch = meta.get("general.architecture", "llama")
    layers = int(meta.get(f"{arch}.block_count", 1))
    heads = int(meta.get(f"{arch}.attention.head_count", 1))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0)) or int(meta.get(f"{arch}.embedding_length", 64)) // heads
    return layers * 2 * block_size * kv_heads * head_dim * _KV_ELEM_BYTES
