"""Warm-up pass: run a few prefill and decode shapes through a freshly loaded engine (issue 17 item 3).

The first forward of each shape pays one-time costs: oneDNN builds a primitive per shape, OpenMP starts
its thread team, torch allocates its caches, the native kernels touch their code and tables. Run before
the worker advertises credits, they stay out of the first user request's TTFT. ``warm_up`` adds greedy
requests of ``PREFILL_LENS`` prompt tokens (token ids from 1, EOS ignored), ``DECODE_TOKENS`` tokens
each, all in one batch (so decode runs at that many rows and at one), steps until they finish, then
forgets their prefix-cache blocks and resets the engine's counters and measured step rates
(``StepRates``): the worker's statistics and ``/metrics`` start at zero as if nothing had run, and the
scheduler's deadline estimates do not start from the warm-up's cold first steps (one of 1-3 s made a
600 s deadline look unmeetable).
"""

from __future__ import annotations

import time

from .types import EngineRequest, SamplingParams

PREFILL_LENS = (16, 64, 8, 8)  # prompt tokens per warm-up request: two prefill shapes, then a batch of 4
DECODE_TOKENS = 4  # tokens generated per warm-up request (decode steps at 4 rows, then fewer)
MAX_STEPS = 64  # bound on engine steps (the pass always ends well before on a working engine)


def warm_up(engine, prefill_lens: tuple[int, ...] = PREFILL_LENS, decode_tokens: int = DECODE_TOKENS) -> float:
    """Run the warm-up pass on ``engine`` (an idle ``LLMEngine``); returns its wall time (s).

    Prompts longer than the engine's ``max_model_len - decode_tokens`` are cut to fit.  RuntimeError if
    the pass has not finished after MAX_STEPS steps (its requests are aborted first)."""
    t0 = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    limit = max(1, engine.max_model_len - decode_tokens)
    ids = [f"__warmup__{i}" for i in range(len(prefill_lens))]
    for rid, n in zip(ids, prefill_lens):
        engine.add_request(EngineRequest(rid, tuple(1 + (j % 97) for j in range(min(n, limit))), params))
    steps = 0
    while engine.has_unfinished() and steps < MAX_STEPS:
        engine.step()
        steps += 1
    if engine.has_unfinished():
        for rid in ids:
            engine.abort_request(rid)
        raise RuntimeError(f"warm-up did not finish in {MAX_STEPS} steps")
    _forget(engine)
    return time.monotonic() - t0


def _forget(engine) -> None:
    """Drop the warm-up's prefix-cache blocks, counters and step-rate measurements."""
    engine.reset_prefix_cache()
    engine.reset_counters()
