"""Token sampling: greedy, temperature, top-k, top-p (nucleus, Holtzman et al. 2019), per-request seed.

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


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample a token id from float logits [V] under ``params``."""
    logits = logits.float().cpu()
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = apply_top_p(apply_top_k(logits / params.temperature, params.top_k), params.top_p)
    return draw(logits.softmax(-1), generator)


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
    output_ids: list[list[int]] | None = None,
) -> list[int]:
    """Sample one token per row of ``logits`` [S, V]; greedy rows use one batched argmax.

    ``output_ids`` (tokens generated so far, per row) feed frequency/presence penalties.
    """
    greedy = logits.max(dim=-1).indices.tolist()  # first maximal index like argmax, ~4x faster on CPU
    out = []
    for i, p in enumerate(params):
        if output_ids and output_ids[i] and (p.frequency_penalty or p.presence_penalty):
            row = apply_penalties(logits[i].float().cpu(), p, output_ids[i])
            out.append(int(torch.argmax(row)) if p.temperature == 0 else sample_one(row, p, generators[i]))
        else:
            out.append(greedy[i] if p.temperature == 0 else sample_one(logits[i], p, generators[i]))
    return out
