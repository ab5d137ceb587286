"""Pieces of the worker's output path kept out of the service shell (actors/worker/service.py): the
receiver probe, the OpenAI-shaped logprobs of one engine step and the worker's stats message."""

from __future__ import annotations

import time

import orjson

from bus.base import Bus, BusError, NoResponders
from bus.messages import WorkerStats


async def probe_receiver(bus: Bus, reply: str, request_id: str, timeout: float = 1.0) -> bool:
    """Ask the receiver of ``reply`` whether it still waits for ``request_id``.

    NATS gives a publisher no signal when nobody subscribes, so a stream whose gateway died would
    otherwise run to its end. The gateway answers ``{"alive": bool}`` on its reply subjects; no
    responders or ``alive: false`` -> False. A timeout (busy receiver) counts as alive.
    """
    try:
        m = await bus.request(reply, b'{"probe":"%s"}' % request_id.encode(), timeout)
        return bool(orjson.loads(m.data).get("alive", True))
    except NoResponders:
        return False
    except (BusError, ValueError, AttributeError):
        return True


def token_entry(engine, token_id: int, logprob: float) -> dict:
    """``{"token", "bytes", "logprob"}`` of one token (its bytes from ``engine.token_bytes``; logprob >= -9999)."""
    table = getattr(engine, "token_bytes", None) or ()
    raw = table[token_id] if 0 <= token_id < len(table) else b""
    return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "logprob": max(float(logprob), -9999.0)}


def step_logprobs(engine, sampling, out) -> list[dict] | None:
    """OpenAI chat-shaped logprobs of one StepOutput's tokens under ``sampling`` (the request's
    SamplingParams); a stop token ending the request is left out. None when logprobs were not asked for."""
    lps = getattr(out, "logprobs", None)
    if not lps:
        return None if sampling.logprobs is None else []
    stop_ids = set(sampling.stop_token_ids) | set(getattr(engine, "eos_token_ids", ()))
    entries = []
    for token_id, lp, top in lps:
        if out.finished and out.finish_reason == "stop" and token_id in stop_ids and not sampling.ignore_eos:
            continue
        e = token_entry(engine, token_id, lp)
        e["top_logprobs"] = [token_entry(engine, i, v) for i, v in top]
        entries.append(e)
    return entries


def worker_stats(st, cfg, num_finished: int, num_aborted: int, max_cancel_steps: int) -> WorkerStats:
    """The ``WorkerStats`` message of an engine's ``EngineStats`` ``st`` and the service's counters;
    ``cfg``: the service's ``WorkerConfig`` (worker id, model name, version)."""
    x = st.extra
    return WorkerStats(cfg.worker_id, cfg.name, cfg.version, st.num_steps, st.num_generated_tokens,
                       st.num_prompt_tokens, st.num_running, st.num_waiting, st.num_free_blocks, st.num_total_blocks,
                       st.max_batch_size_seen, num_finished, num_aborted, time.time(), max_cancel_steps,
                       int(x.get("prefix_cache_hit_tokens", 0)), int(x.get("prefix_cache_query_tokens", 0)),
                       int(x.get("num_constrained_steps", 0)), float(x.get("grammar_compile_ms_total", 0.0)),
                       int(x.get("grammar_cache_hits", 0)), int(x.get("grammar_cache_misses", 0)),
                       dict(x.get("prefix_hits_by_tenant", {})), int(x.get("num_kv_reclaims", 0)))
