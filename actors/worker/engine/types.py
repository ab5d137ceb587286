"""Engine-facing data types: what goes into the engine and what comes out of one step.

Pure module (no torch, no nats). The worker actor converts bus messages into these and back.
Shapes follow vLLM v1's ``sched/output.py`` style: every field documented with its meaning and unit.
The engine interface takes a ``model_key`` and ``adapter`` on every request so a worker can later
serve several models and LoRA adapters without reshaping it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping parameters (validated by the validator; re-checked here).

    Raises ValueError from ``__post_init__`` on out-of-range values.
    """

    temperature: float = 1.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # per-request RNG seed; None = nondeterministic
    max_tokens: int = 16  # generated-token cap (tokens)
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids besides EOS
    stop: tuple[str, ...] = ()  # stop strings; matched on detokenized text, excluded from output
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # None: off; k >= 0: sampled token's logprob plus the top k (raw distribution)
    frequency_penalty: float = 0.0  # OpenAI: logit -= count(token in output) * frequency_penalty
    presence_penalty: float = 0.0  # OpenAI: logit -= (count > 0) * presence_penalty

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")


@dataclass(frozen=True)
class EngineRequest:
    """One generation request as the engine sees it."""

    request_id: str  # unique id (the platform request id)
    prompt_token_ids: tuple[int, ...]  # tokenized prompt, len >= 1
    params: SamplingParams
    model_key: str = ""  # which loaded model serves it ("" = the worker's only model)
    adapter: str | None = None  # LoRA adapter name (later issue); None = base model
    arrival_time: float = 0.0  # time.monotonic() at arrival (s), for FCFS ordering


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request.

    All tokens produced for a request in one step are in one StepOutput (travel in one message).
    """

    request_id: str
    new_token_ids: tuple[int, ...]  # token ids sampled this step (may be () for a prefill-only chunk)
    text: str  # detokenized text delta, valid UTF-8, stop strings removed/held back
    finished: bool  # True on the last output for this request
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished
    num_prompt_tokens: int = 0  # prompt length (tokens)
    num_generated_tokens: int = 0  # total generated so far, including this step (tokens)
    # per new token when SamplingParams.logprobs is set: (token id, logprob, ((top id, logprob), ...))
    logprobs: tuple | None = None


@dataclass
class EngineStats:
    """Running counters of one engine (reported on ``as.int.stats.<worker_id>``)."""

    num_steps: int = 0  # forward passes run
    num_generated_tokens: int = 0  # tokens sampled, all requests
    num_prompt_tokens: int = 0  # prompt tokens prefilled
    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # sequences waiting for KV blocks / a slot
    num_free_blocks: int = 0  # free KV cache blocks
    num_total_blocks: int = 0  # KV cache blocks in all
    max_batch_size_seen: int = 0  # largest number of sequences in one step
    extra: dict = field(default_factory=dict)
