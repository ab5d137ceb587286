"""OpenAI wire shapes: errors (``ApiError``, an alias of ``bus.errors.ServeError``), chat/completions responses
and streaming chunks.

Field names and object types follow the OpenAI API reference (chat.completion, chat.completion.chunk,
text_completion); ``model`` is the concrete ``name@version`` that served the request.
"""

from __future__ import annotations

import time
from typing import Any

from bus.errors import ServeError

TIMING_KEYS = ("gateway_ms", "auth_ms", "validation_ms", "queue_ms", "prefill_ms", "decode_ms", "transport_ms")


#: the gateway's name for :class:`bus.errors.ServeError`, the one error of the request path (an alias:
#: ``ApiError is ServeError``; ~200 raise sites across the fronts keep their name)
ApiError = ServeError


def object_id(endpoint: str, request_id: str) -> str:
    """Response id: ``chatcmpl-<request id>`` or ``cmpl-<request id>``."""
    return f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{request_id}"


def full_timing(worker_timing: dict | None, marks: dict[str, float], t_end: float) -> dict[str, float]:
    """Complete timing breakdown (ms): gateway's own parts, the worker's, transport as the remainder."""
    t = {k: 0.0 for k in TIMING_KEYS}
    t.update({k: float(v) for k, v in (worker_timing or {}).items() if k in t})
    t["auth_ms"] = (marks.get("auth_done", 0) - marks.get("gateway_in", 0)) * 1e3
    t["gateway_ms"] = (marks.get("gateway_out", 0) - marks.get("auth_done", 0)) * 1e3
    total = (t_end - marks.get("gateway_in", t_end)) * 1e3
    t["transport_ms"] = max(0.0, total - sum(v for k, v in t.items() if k != "transport_ms"))
    return {k: round(v, 3) for k, v in t.items()}


def join_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``message.tool_calls`` of a non-streamed answer from its streaming deltas (``Chunk.tool_calls``):
    per ``index``, the opening delta's ``id``, ``type`` and ``function.name`` and every delta's
    ``function.arguments`` concatenated, in index order (so the joined stream equals the answer)."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        fn = d.get("function") or {}
        call = calls.setdefault(int(d.get("index", 0)), {"id": "", "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
        for key in ("id", "type"):
            if d.get(key):
                call[key] = d[key]
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def completion_body(endpoint: str, request_id: str, model: str, text: str, finish_reason: str | None,
                    usage: dict, timing: dict, created: int | None = None) -> dict[str, Any]:
    """Non-streaming response (chat.completion or text_completion) with usage.actorserve_timing."""
    if endpoint == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": object_id(endpoint, request_id), "object": "chat.completion" if endpoint == "chat"
            else "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [choice], "usage": {**usage, "actorserve_timing": timing}, "system_fingerprint": None}


def stream_chunk(endpoint: str, request_id: str, model: str, created: int, *, text: str = "",
                 role: bool = False, finish_reason: str | None = None) -> dict[str, Any]:
    """One streaming chunk (chat.completion.chunk or text_completion)."""
    if endpoint == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
            {"content": text} if text or finish_reason is None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": object_id(endpoint, request_id), "object": obj, "created": created, "model": model,
            "choices": [choice], "system_fingerprint": None}


def usage_chunk(endpoint: str, request_id: str, model: str, created: int, usage: dict) -> dict[str, Any]:
    """The final ``choices: []`` chunk carrying usage (stream_options.include_usage)."""
    obj = "chat.completion.chunk" if endpoint == "chat" else "text_completion"
    return {"id": object_id(endpoint, request_id), "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage, "system_fingerprint": None}
