"""Engine-facing data types: what goes into the engine and what comes out of one step.

Pure module (no torch, no nats). The worker actor converts bus messages into these and back, except
``SamplingParams``: the engine takes the wire message itself (``bus.messages.SamplingParams``, validated at
construction; a pure dataclass module with no nats import), so the field list exists once.
Shapes follow vLLM v1's ``sched/output.py`` style: every field documented with its meaning and unit.
The engine interface takes a ``model_key`` and ``adapter`` on every request so a worker can later
serve several models and LoRA adapters without reshaping it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.messages import SamplingParams

__all__ = ["SamplingParams", "EngineRequest", "StepOutput", "EngineStats"]


@dataclass(frozen=True)
class EngineRequest:
    """One generation request as the engine sees it."""

    request_id: str  # unique id (the platform request id)
    prompt_token_ids: tuple[int, ...]  # tokenized prompt, len >= 1
    params: SamplingParams
    model_key: str = ""  # which loaded model serves it ("" = the worker's only model)
    adapter: str | None = None  # LoRA adapter name; None = base model
    adapter_path: str = ""  # its PEFT directory (registry record, via the gateway): registers it if the engine lacks it
    arrival_time: float = 0.0  # time.monotonic() at arrival (s), for FCFS ordering
    priority: str = "interactive"  # priority class (bus.messages.PRIORITIES): "batch" is preempted first
    tenant: str = ""  # accounting key of the service counters (EngineStats.served)
    urgent: bool = False  # prefill priority (Dispatch.urgent): queued ahead of ordinary waiting requests
    tenant_weight: float = 1.0  # the tenant's fair-share weight (Dispatch.tenant_weight): its KV share under contention
    cache_salt: bytes = b""  # prefix-cache salt (Dispatch.cache_salt, actors/cache_salt.py); b"" = unsalted
    # a migrated sequence (actors/worker/migration_state.py): tokens another engine generated already (its KV is
    # recomputed from prompt + these) and that engine's sampler RNG state (torch.Generator.get_state() bytes)
    resumed_output_ids: tuple[int, ...] = ()
    rng_state: bytes | None = None


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
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (tokens; set on the finished output)


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
    step_ms: float = 0.0  # predicted decode step time at the current running batch (EWMA, ms; 0 = unmeasured)
    prefill_tokens_per_s: float = 0.0  # prefill speed (EWMA, tokens/s; 0 = unmeasured)
    # tokens served since the engine started, per EngineRequest.tenant: {tenant: [prompt tokens computed for
    # the first time, tokens generated]} (recomputation after a preemption and prefix-cache hits not counted)
    served: dict = field(default_factory=dict)
    paused: list = field(default_factory=list)  # ids of preempted requests waiting to resume
    extra: dict = field(default_factory=dict)
