"""Token sampling: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2019), min-p (Nguyen et al.
2024), logit bias (OpenAI), repetition penalty (CTRL, Keskar et al. 2019), frequency/presence penalties,
per-request seed.

Order on one row of raw logits [V] (float32, CPU), as in Hugging Face transformers / vLLM: ``logit_bias``
added -> repetition penalty over prompt + generated ids -> frequency / presence penalties over generated
ids -> (greedy: argmax here) -> temperature -> top-k -> top-p -> min-p -> one draw. Rows that use none of
bias / penalties keep the batched argmax (greedy) or the plain per-row path (sampled).

Each request owns a ``torch.Generator`` (CPU) seeded from ``SamplingParams.seed`` (or from OS
entropy when None), and draws exactly one multinomial sample per generated token.  Its samples
depend only on its own logits and its own generator, so they are reproducible whatever else is in
the batch.  Sampling runs on CPU in float32 (logits [V] are moved there), so results also do not
depend on the device's RNG.
"""

from __future__ import annotations

import random

import torch

from .types import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """CPU generator seeded with ``seed`` (random 63-bit seed when None)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
    return g


def generator_state(g: torch.Generator) -> bytes:
    """The generator's position as bytes (``get_state()``: 5056 for the CPU Mersenne Twister), for a
    migrated sequence (actors/worker/migration_state.py)."""
    return g.get_state().numpy().tobytes()


def set_generator_state(g: torch.Generator, state: bytes) -> torch.Generator:
    """Put ``g`` at the position ``generator_state`` saved (ValueError/RuntimeError on foreign bytes); returns g."""
    g.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8).clone())
    return g


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits of [V] (others -inf); 0 or >= V keeps all."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability mass reaches ``top_p`` (others -inf)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass of strictly higher-ranked tokens
    drop_sorted = mass_before >= top_p
    drop_sorted[0] = False  # the top token always stays (a top_p below float32's range rounds to 0)
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Min-p filter (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"; transformers'
    ``MinPLogitsWarper``): on [V] logits already divided by the temperature, set to -inf every token whose
    probability is below ``min_p`` times the top token's probability. The top token always stays; 0 = off."""
    if min_p <= 0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def apply_logit_bias(logits: torch.Tensor, logit_bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI ``logit_bias``: add each (token id, bias) to the raw [V] logits (a new tensor; ids < V, checked
    by the engine at admission). -100 in effect bans a token, +100 in effect forces it."""
    if not logit_bias:
        return logits
    ids = torch.tensor([i for i, _ in logit_bias], dtype=torch.int64)
    bias = torch.tensor([b for _, b in logit_bias], dtype=logits.dtype)
    return logits.index_add(0, ids, bias)


def apply_repetition_penalty(logits: torch.Tensor, penalty: float, token_ids: list[int] | None) -> torch.Tensor:
    """CTRL repetition penalty (Keskar et al. 2019, as transformers' ``RepetitionPenaltyLogitsProcessor`` and
    vLLM apply it): over the set of ``token_ids`` (prompt + generated), positive logits of [V] are divided by
    ``penalty`` and negative ones multiplied by it (> 1 discourages repeats, < 1 encourages them); 1 = off."""
    if penalty == 1.0 or not token_ids:
        return logits
    ids = torch.tensor(token_ids, dtype=torch.int64).unique()
    seen = logits[ids]
    return logits.index_copy(0, ids, torch.where(seen < 0, seen * penalty, seen / penalty))


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_ids: list[int] | None) -> torch.Tensor:
    """OpenAI frequency/presence penalties on [V] logits from the counts of tokens generated so far."""
    if not output_ids or (params.frequency_penalty == 0 and params.presence_penalty == 0):
        return logits
    ids = torch.tensor(output_ids, dtype=torch.int64)
    counts = torch.zeros(logits.shape[-1], dtype=logits.dtype).scatter_add_(
        0, ids, torch.ones(len(output_ids), dtype=logits.dtype))
    return logits - counts * params.frequency_penalty - (counts > 0).to(logits.dtype) * params.presence_penalty


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple:
    """(token, logprob of token, ((id, logprob) x k best)) under log-softmax of raw logits [V]."""
    lp = torch.log_softmax(logits.float().cpu(), -1)
    top = torch.topk(lp, k) if k > 0 else None
    best = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return token, float(lp[token]), best


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float logits [V] -> the logits a sampled (temperature > 0) draw uses: divided by the temperature, then
    top-k, top-p and min-p filtered (dropped tokens -inf), in transformers' warper order."""
    logits = apply_top_p(apply_top_k(logits.float().cpu() / params.temperature, params.top_k), params.top_p)
    return apply_min_p(logits, params.min_p)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample a token id from float logits [V] under ``params`` (bias / penalties already applied:
    :func:`adjusted_logits`); temperature 0 is argmax."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    return draw(filtered_logits(logits, params).softmax(-1), generator)


def needs_adjusting(params: SamplingParams, output_ids: list[int] | None) -> bool:
    """True when ``params`` change the raw logits of a row (logit bias, repetition, frequency or presence
    penalty); rows without them keep the batched fast path of :func:`sample_batch`."""
    return bool(params.logit_bias) or params.repetition_penalty != 1.0 or bool(
        output_ids and (params.frequency_penalty or params.presence_penalty))


def adjusted_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int] | None,
                    token_ids: list[int] | None) -> torch.Tensor:
    """Raw logits [V] (any float dtype / device) -> float32 CPU logits with ``logit_bias`` added, then the
    repetition penalty over ``token_ids`` (prompt + generated) and frequency / presence penalties over
    ``output_ids`` (generated) applied, in vLLM's order (bias, then penalties)."""
    row = apply_logit_bias(logits.float().cpu(), params.logit_bias)
    row = apply_repetition_penalty(row, params.repetition_penalty, token_ids)
    return apply_penalties(row, params, output_ids)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index from the categorical distribution ``probs`` [V] (float32, sum ~1) by inverse-transform
    sampling (Devroye 1986, ch. III.2): the first index whose cumulative mass exceeds u ~ U[0, mass).

    One uniform per token instead of ``torch.multinomial``'s per-call setup: 0.1 ms against 1.0 ms for a
    49,152-token vocabulary on this CPU, 8 % of a batch-8 decode step. Zero-probability tokens (filtered
    by top-k/top-p) have empty intervals and are never drawn.
    """
    cdf = probs.cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=cdf.dtype).to(cdf.device) * cdf[-1]  # CPU generator, any device
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[-1] - 1)


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
    output_ids: list[list[int]] | None = None, token_ids: list[list[int]] | None = None,
) -> list[int]:
    """Sample one token per row of ``logits`` [S, V] (float, any device) under ``params[i]`` with
    ``generators[i]``; returns S token ids. Greedy rows without bias / penalties use one batched argmax.

    ``output_ids[i]`` (tokens generated so far) feed frequency / presence penalties; ``token_ids[i]`` (prompt +
    generated) feed the repetition penalty (None: no ids, the penalty has nothing to act on).
    """
    greedy = logits.max(dim=-1).indices.tolist()  # first maximal index like argmax, ~4x faster on CPU
    out = []
    for i, p in enumerate(params):
        generated = output_ids[i] if output_ids else None
        if needs_adjusting(p, generated):
            row = adjusted_logits(logits[i], p, generated, token_ids[i] if token_ids else None)
            out.append(int(torch.argmax(row)) if p.temperature == 0 else sample_one(row, p, generators[i]))
        else:
            out.append(greedy[i] if p.temperature == 0 else sample_one(logits[i], p, generators[i]))
    return out
