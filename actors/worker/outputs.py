"""The worker's output path: the :class:`Outbox` every chunk, completion record and scheduler event of
a worker goes through (used by the service and the migrator), and its pure pieces: the receiver
probe, the OpenAI-shaped logprobs of one engine step, usage and timing of a request, the stats message."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable


from actors import content_log
from actors.worker.live import Live
from bus import subjects, tracing
from bus.base import Bus, BusError, NoResponders
from bus.messages import Chunk, CompletionRecord, ProbeAnswer, ReceiverProbe, StepFrame, WorkerStats

log = logging.getLogger(__name__)

# A step frame holds chunks up to this many bytes before a new one is opened: well under NATS's default
# max_payload (1 MiB), so 32 streams of logprobs with 20 alternatives each still fit in a few messages.
FRAME_MAX_BYTES = 256 * 1024


async def probe_receiver(bus: Bus, reply: str, request_id: str, timeout: float = 1.0) -> bool:
    """Ask the receiver of ``reply`` whether it still waits for ``request_id``.

    NATS gives a publisher no signal when nobody subscribes, so a stream whose gateway died would
    otherwise run to its end. The gateway answers ``{"alive": bool}`` on its reply subjects; no
    responders or ``alive: false`` -> False. A timeout (busy receiver) counts as alive.
    """
    try:
        m = await bus.request(reply, ReceiverProbe(request_id).encode(), timeout)
        return ProbeAnswer.decode(m.data).alive
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


def usage(lv: Live, num_prompt: int, num_cached: int = 0) -> dict:
    """OpenAI ``usage`` of ``lv`` (token counts) with ``num_prompt`` prompt tokens, ``num_cached`` of them cached;
    a reasoning model's also ``completion_tokens_details.reasoning_tokens`` (actors/text/reasoning.py)."""
    u = {"prompt_tokens": num_prompt, "completion_tokens": lv.num_generated,
         "total_tokens": num_prompt + lv.num_generated,
         "prompt_tokens_details": {"cached_tokens": min(num_prompt, int(num_cached))}}
    if lv.thinking is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": min(lv.thinking.tokens, lv.num_generated)}
    return u


def timing(lv: Live, now: float) -> dict:
    """Worker part of the timing breakdown of ``lv`` ending at ``now`` (epoch s): validation, queue,
    prefill, decode (ms)."""
    m = lv.req.marks
    t_first = lv.t_first or now
    return {"validation_ms": max(0.0, (m.get("validate_out", 0.0) - m.get("validate_in", 0.0)) * 1e3),
            "queue_ms": max(0.0, (lv.t_in - m.get("validate_out", lv.t_in)) * 1e3),
            "prefill_ms": max(0.0, (t_first - lv.t_in) * 1e3),
            "decode_ms": max(0.0, (now - t_first) * 1e3)}


class Outbox:
    """The one way out for a worker's outputs: chunks to a request's receiver, completion records,
    scheduler events. ``send``, ``finish``, ``record`` and ``event`` only collect, in order; ``flush``
    publishes what was collected (the step loop flushes once per step, so what a flush sends is decided
    here and nowhere else). A failed publish is logged, never raised.

    ``live`` is the worker's table of held requests (request id -> :class:`Live`): a final chunk takes its
    request out of it. ``on_resumed(lv)`` is called at the first chunk of a sequence migrated here.

    Step frames (issue [25], decision 0052): the chunks of a request whose receiver asked for them
    (``GenerateRequest.frames``) are not published one by one: between two flushes they gather into one
    :class:`bus.messages.StepFrame` per frame subject (a new frame once one holds ``frame_max_bytes``), which
    takes the place in the send order of its first chunk. Chunks of one request keep their order (they are
    in one frame, or in frames published in order on one connection).
    """

    def __init__(self, bus: Bus, worker_id: str, live: dict[str, Live],
                 on_resumed: Callable[[Live], None] | None = None, frame_max_bytes: int = FRAME_MAX_BYTES) -> None:
        self.bus, self.worker_id, self.live, self.on_resumed = bus, worker_id, live, on_resumed
        self.frame_max_bytes = frame_max_bytes
        self.num_finished = 0  # requests ended (final chunk collected), any reason
        self.num_aborted = 0  # of those, ended by ``finish(..., aborted=True)``
        # (subject, payload) collected, not yet published; a step frame's payload is the list of its chunks'
        # encoded bytes, joined at flush
        self._queue: list[tuple[str, bytes | list[bytes]]] = []
        self._open: dict[str, list[bytes]] = {}  # frame subject -> the parts of its open frame (also in _queue)
        self._open_bytes: dict[str, int] = {}  # frame subject -> bytes of its open frame

    def __len__(self) -> int:
        """Messages collected and not yet flushed (a step frame counts once)."""
        return len(self._queue)

    def event(self, subject: str, data: bytes) -> None:
        """Collect a message for ``subject`` (e.g. the scheduler's first-token event)."""
        self._queue.append((subject, data))

    def send(self, lv: Live, chunk: Chunk) -> None:
        """Collect ``chunk`` for ``lv``'s receiver and advance its chunk seq; a final chunk ends ``lv``
        (out of ``live``, counted finished)."""
        lv.seq += 1
        if lv.handoff and self.on_resumed is not None:
            self.on_resumed(lv)  # the hand-over gap of a migrated sequence ends here
        if chunk.text:
            content_log.log_content("output", lv.req.request_id, chunk.text)  # ACTORSERVE_LOG_PROMPTS=1 only
        if lv.req.frames:
            self._frame(lv.req.frames, chunk.encode())
        else:
            self._queue.append((lv.req.reply, chunk.encode()))
        if chunk.final:
            self.live.pop(lv.req.request_id, None)
            self.num_finished += 1

    def _frame(self, subject: str, data: bytes) -> None:
        """Add an encoded chunk to the open step frame of ``subject`` (opened here, in send order, when there is
        none or the open one would pass ``frame_max_bytes``)."""
        parts = self._open.get(subject)
        if parts is None or self._open_bytes[subject] + len(data) > self.frame_max_bytes:
            parts = self._open[subject] = []
            self._open_bytes[subject] = 0
            self._queue.append((subject, parts))
        parts.append(data)
        self._open_bytes[subject] += len(data) + 1

    def finish(self, lv: Live, err: dict, status: str = "error", aborted: bool = False) -> None:
        """End ``lv`` with the error ``err`` (a ``ServeError`` wire dict): a final ``abort`` chunk and its completion
        record of ``status``; ``aborted`` counts it in ``num_aborted``."""
        if aborted:
            self.num_aborted += 1
        u = usage(lv, len(lv.req.prompt_token_ids))
        t = timing(lv, time.time())
        self.send(lv, Chunk(lv.req.request_id, lv.seq, final=True, finish_reason="abort", usage=u, timing=t,
                            error=err, model=lv.req.model_ref, worker_id=self.worker_id,
                            choice_index=lv.req.choice_index))
        self.record(lv, status, "abort", u, t, err.get("code"))

    def record(self, lv: Live, status: str, reason, usage: dict, timing: dict, code=None) -> None:
        """Collect ``lv``'s ``CompletionRecord`` (``status``, finish ``reason``, ``usage``, ``timing`` in ms,
        error ``code``) and record its prefill/decode spans when traced."""
        rec = CompletionRecord(lv.req.request_id, lv.req.tenant, lv.req.name, lv.req.version, status, reason,
                               usage["prompt_tokens"], usage["completion_tokens"], timing, lv.req.priority,
                               code, self.worker_id, time.time(), lv.req.choice_index,
                               lv.tools.num_calls if lv.tools else 0)
        if lv.trace is not None:
            self._record_spans(lv, status, usage, timing)
        self._queue.append((subjects.done(lv.req.name, lv.req.version), rec.encode()))

    def _record_spans(self, lv: Live, status: str, usage: dict, timing: dict) -> None:
        """``prefill`` and ``decode`` spans from the measured ``prefill_ms`` / ``decode_ms`` (one engine step
        serves many requests, so the spans are recorded afterwards with explicit times, not around steps)."""
        t_first = lv.t_in + timing["prefill_ms"] / 1e3
        attrs = {"actorserve.request_id": lv.req.request_id, "actorserve.worker_id": self.worker_id,
                 "actorserve.status": status}
        tracing.record_span("prefill", lv.t_in, t_first, lv.trace,
                            {**attrs, "actorserve.prompt_tokens": usage["prompt_tokens"]})
        tracing.record_span("decode", t_first, t_first + timing["decode_ms"] / 1e3, lv.trace,
                            {**attrs, "actorserve.completion_tokens": usage["completion_tokens"]})

    async def flush(self) -> int:
        """Publish everything collected, in order; returns how many messages were published or failed.
        Cancelled midway: the messages not yet tried stay collected for the next flush."""
        batch, self._queue, self._open, self._open_bytes = self._queue, [], {}, {}
        for i, (subject, data) in enumerate(batch):
            try:
                await self.bus.publish(subject, StepFrame.join(data) if isinstance(data, list) else data)
            except BusError as exc:
                log.warning("publish to %s failed: %s", subject, exc)
            except asyncio.CancelledError:
                self._queue[:0] = batch[i + 1:]
                raise
        return len(batch)
