"""The runner seam (docs/decisions/0036-runner-seam.md): what ``LLMEngine`` hands a runner for one step and what
it gets back, and the ``ModelRunner`` interface every runner implements.

The engine keeps the request bookkeeping (admission, KV blocks, prefix cache, preemption, stop rules, usage);
a runner turns one step's batch (``RunnerInput``) into one sampled token per sampling row (``RunnerOutput``).
Runners: ``TorchRunner`` (torch_runner.py: the model forward and the sampler, CPU or CUDA) and
``ZeroComputeRunner`` (actors/worker/zero_compute.py: deterministic tokens, no model compute).

Pure module (no torch): the scheduler side and the zero-compute runner import it without torch. Fields follow
vLLM v1's ``sched/output.py`` style: every field commented with its meaning and shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from bus.messages import SamplingParams


@dataclass(frozen=True)
class RowSampling:
    """What a runner needs to sample one row's next token (present on the rows that sample)."""

    params: SamplingParams  # the request's sampling parameters (temperature, top-k/p, penalties, logprobs, seed)
    rng: Any  # the runner's random state of this request (``ModelRunner.new_rng``); None for a runner without one
    output_ids: list[int]  # [generated so far] tokens the request generated (frequency / presence penalties)
    token_ids: list[int]  # [prompt + generated] every token of the request (repetition penalty)
    grammar: Any = None  # structured.GrammarState of a constrained request (its mask applies); None = free


@dataclass(frozen=True)
class RunnerRow:
    """One scheduled sequence of the step: compute positions ``start .. start + len(token_ids) - 1``."""

    seq_id: str  # the request id
    token_ids: list[int]  # [num_new_tokens] the tokens fed this step (prompt chunk, or the last sampled token)
    start: int  # position of token_ids[0] (= tokens of this sequence already in the KV cache)
    block_table: list[int]  # [>= ceil((start + num_new_tokens) / block_size)] physical KV block ids, in order
    samples: bool  # True: the chunk reaches the end of the sequence, so a token is sampled at its last position
    adapter: str | None = None  # LoRA adapter name of the request; None = base model
    sampling: RowSampling | None = None  # set exactly when ``samples``

    @property
    def num_new_tokens(self) -> int:
        """Tokens computed for this row this step (>= 1)."""
        return len(self.token_ids)


@dataclass(frozen=True)
class RunnerInput:
    """One step's batch, in the scheduler's batch order."""

    seqs: list[RunnerRow]  # [num scheduled sequences] rows; prefill chunks and 1-token decodes mixed
    block_size: int  # tokens per KV block (maps a position to its block table entry)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens in the step (sum of the rows' num_new_tokens)."""
        return sum(len(r.token_ids) for r in self.seqs)

    @property
    def sampling_rows(self) -> list[RunnerRow]:
        """[S] the rows that sample, in batch order (the order of ``RunnerOutput``'s lists)."""
        return [r for r in self.seqs if r.samples]


@dataclass(frozen=True)
class RunnerOutput:
    """What a step produced: one entry per sampling row of the input, in its order."""

    sampled_ids: list[int]  # [S] the sampled token id of each sampling row (0 <= id < vocab_size)
    # [S] per sampling row: None unless its params.logprobs is set, else
    # (token id, logprob of it (float <= 0), ((top id, logprob), ...) with at most params.logprobs entries)
    logprobs: list[tuple | None]


class ModelRunner(Protocol):
    """A runner: the compute side of the engine (module docstring). ``execute`` is called from one thread."""

    vocab_size: int  # token ids are 0 .. vocab_size - 1
    eos_token_ids: tuple[int, ...]  # EOS / end-of-turn ids of the model
    token_bytes: list[bytes]  # [vocab_size] bytes of every token (the detokenizer's table)
    num_blocks: int  # KV cache blocks the runner holds (the block manager's capacity)
    position_limit: int  # positions the model covers (tokens); max_model_len is at most this
    structured: Any  # structured.Structured (grammar states and masks), or None: grammars are refused

    def new_rng(self, seed: int | None, state: bytes | None) -> Any:
        """A request's random state from its seed (None: random), continued from ``state`` (migration)."""

    def rng_state(self, rng: Any) -> bytes:
        """``rng``'s state as bytes (``new_rng(..., state)`` continues it; b"" when the runner has none)."""

    def check_adapter(self, name: str | None, path: str, in_use: set[str]) -> None:
        """Make adapter ``name`` ready for a new request (``in_use``: adapters of live requests); ValueError
        when it cannot be served."""

    def admit_gate(self, name: str, in_use: set[str]) -> bool:
        """True when a request of adapter ``name`` may be admitted now (``in_use``: adapters of running ones)."""

    def register_adapter(self, name: str, path: str) -> None:
        """Make LoRA adapter ``name`` (a PEFT directory at ``path``) servable; ValueError when it cannot be."""

    def unregister_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (the engine checks that no live request names it)."""

    def execute(self, batch: RunnerInput) -> RunnerOutput:
        """Compute ``batch`` (writing the rows' K/V into their blocks) and sample every sampling row."""

    def resize_kv(self, kv_bytes: int) -> int:
        """Replace the KV cache by one of ``kv_bytes`` bytes; returns its block count. RuntimeError or
        ValueError when the runner cannot."""

    def extra_stats(self) -> dict:
        """Runner-specific counters merged into ``EngineStats.extra``."""

    def describe(self) -> str:
        """One start-up log line: what the runner is and its capacity."""

    def close(self) -> None:
        """Release what the runner holds beyond memory (processes, groups)."""
