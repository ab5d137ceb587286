"""Merging the chunks of one API request's choices into OpenAI responses (shared by HTTP and NATS fronts).

A request with ``n`` > 1 or a list of prompts was fanned out by the validator into engine requests
``<request_id>-<index>`` (index = prompt_index * n + i); a single choice keeps ``<request_id>``. Every chunk
carries its choice's index in ``Chunk.choice_index`` (the ids are never parsed).
``ChoiceMerger.add`` takes every chunk in arrival order and returns the streaming objects it yields
(each with the right choice ``index``; one role delta first and exactly one finish_reason per index);
``body`` builds the non-streaming response. Both fronts use it, so their semantics cannot drift.
Tool calls (parsed by the worker, ``Chunk.tool_calls``; docs/tools.md) stream as one ``delta.tool_calls``
event per delta and join into ``message.tool_calls`` (content null when the answer is only calls), so the
joined stream equals the non-streamed answer. A reasoning model's thinking (``Chunk.reasoning``, split out by the
worker; docs/decisions/0044-reasoning-output.md) streams as ``delta.reasoning_content`` and joins into
``message.reasoning_content`` (vLLM's names), present only when there was thinking; its tokens are summed into
``usage.completion_tokens_details.reasoning_tokens``.

Usage: ``prompt_tokens`` counts each prompt once (not once per choice, as at OpenAI), ``completion_tokens``
sums every choice. Streaming: with ``stream_options.include_usage`` every content chunk has ``usage: null``
and one last ``choices: []`` chunk carries the totals and ``usage.actorserve_timing``; without it no chunk
has ``usage`` and the last chunk carries the timing breakdown as the top-level extension field
``actorserve_timing`` (docs/decisions/0007-api.md).
"""

from __future__ import annotations

import time
from typing import Any

from bus.messages import Chunk
from gateway.openai_format import full_timing, join_tool_calls, object_id
from gateway.request_body import ApiBody


class ChoiceMerger:
    """Accumulates the choices of one request; see the module docstring.

    ``body``: the request's :class:`gateway.request_body.ApiBody` (``n``, ``logprobs``, ``include_usage``);
    a dict is read into one here (callers that hold no ApiBody: tests, tools)."""

    def __init__(self, endpoint: str, request_id: str, model: str, body: ApiBody | dict, marks: dict,
                 num_choices: int, created: int | None = None) -> None:
        if not isinstance(body, ApiBody):
            body = ApiBody.parse(endpoint, body)
        self.endpoint, self.request_id, self.model, self.marks = endpoint, request_id, model, marks
        self.k, self.n = num_choices, body.n
        self.created = created or int(time.time())
        self.chat = endpoint == "chat"
        self.logprobs = body.logprobs
        self.include_usage = body.include_usage
        self.texts: dict[int, list[str]] = {}
        self.lps: dict[int, list[dict]] = {}
        self.calls: dict[int, list[dict]] = {}  # tool_calls deltas per choice (Chunk.tool_calls)
        self.thoughts: dict[int, list[str]] = {}  # reasoning text per choice (Chunk.reasoning)
        self.offsets: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}
        self.usages: dict[int, dict] = {}
        self.worker_timing: dict | None = None
        self.timing: dict | None = None

    @property
    def done(self) -> bool:
        """Every choice has its final chunk."""
        return len(self.finish) >= self.k

    def index(self, chunk: Chunk) -> int:
        """Choice index of a chunk (``Chunk.choice_index``; 0 for an unsplit request)."""
        return chunk.choice_index

    # ------------------------------------------------------------------ shapes
    def _obj(self) -> dict[str, Any]:
        return {"id": object_id(self.endpoint, self.request_id),
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None}

    def _lp_obj(self, i: int, entries: list[dict] | None) -> dict | None:
        """OpenAI logprobs object of a list of token entries (chat or completions shape)."""
        if not self.logprobs:
            return None
        entries = entries or []
        if self.chat:
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                                                  for t in e.get("top_logprobs", ())]} for e in entries],
                    "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e["token"])
            out["token_logprobs"].append(e["logprob"])
            top = {t["token"]: t["logprob"] for t in e.get("top_logprobs", ())}
            top.setdefault(e["token"], e["logprob"])
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offsets.get(i, 0))
            self.offsets[i] = self.offsets.get(i, 0) + len(e["token"])
        return out

    def _choice(self, i: int, text: str | None = None, role: bool = False, finish: str | None = None,
                logprobs: dict | None = None, tool_call: dict | None = None, thought: str | None = None
                ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if thought is not None:
                delta["reasoning_content"] = thought
            if text is not None:
                delta["content"] = text
            if tool_call is not None:  # one OpenAI tool_calls delta per event, as OpenAI streams them
                delta["tool_calls"] = [tool_call]
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def _event(self, choice: dict) -> dict[str, Any]:
        ev = {**self._obj(), "choices": [choice]}
        if self.include_usage:
            ev["usage"] = None
        return ev

    def usage(self) -> dict[str, int]:
        """Totals: each prompt's tokens once, every choice's completion tokens."""
        prompt = sum(u.get("prompt_tokens", 0) for i, u in self.usages.items() if i % self.n == 0)
        completion = sum(u.get("completion_tokens", 0) for u in self.usages.values())
        cached = sum(cached_tokens(u) for i, u in self.usages.items() if i % self.n == 0)  # per prompt, once
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": min(prompt, cached)}}
        details = [u["completion_tokens_details"] for u in self.usages.values()
                   if isinstance(u.get("completion_tokens_details"), dict)]
        if details:  # a reasoning model's thinking tokens (actors/worker/outputs.py usage)
            out["completion_tokens_details"] = {"reasoning_tokens": sum(int(d.get("reasoning_tokens", 0) or 0)
                                                                        for d in details)}
        return out

    # ------------------------------------------------------------------ streaming
    def add(self, chunk: Chunk) -> list[dict[str, Any]]:
        """Record one (non-error) chunk; return the streaming objects it produces, in order."""
        i = self.index(chunk)
        events = []
        if self.chat and i not in self.texts:
            events.append(self._event(self._choice(i, "", role=True)))
        self.texts.setdefault(i, [])
        if chunk.model:
            self.model = chunk.model
        entries = list(chunk.logprobs or ()) if self.logprobs else []
        if chunk.reasoning:
            self.thoughts.setdefault(i, []).append(chunk.reasoning)
            events.append(self._event(self._choice(i, thought=chunk.reasoning)))
        if chunk.text or entries:
            self.texts[i].append(chunk.text)
            self.lps.setdefault(i, []).extend(entries)
            events.append(self._event(self._choice(i, chunk.text, logprobs=self._lp_obj(i, entries))))
        for call in chunk.tool_calls or ():
            self.calls.setdefault(i, []).append(call)
            events.append(self._event(self._choice(i, tool_call=call)))
        if chunk.final and i not in self.finish:
            self.finish[i] = chunk.finish_reason
            self.usages[i] = dict(chunk.usage or {})
            self.worker_timing = chunk.timing
            fin = self._event(self._choice(i, None if self.chat else "", finish=chunk.finish_reason))
            events.append(fin)
            if self.done:
                timing = self.final_timing()
                if self.include_usage:
                    events.append({**self._obj(), "choices": [],
                                   "usage": {**self.usage(), "actorserve_timing": timing}})
                else:
                    fin["actorserve_timing"] = timing
        return events

    def final_timing(self) -> dict[str, float]:
        """The full timing breakdown, computed once when the last choice finished."""
        if self.timing is None:
            self.timing = full_timing(self.worker_timing, self.marks, time.time())
        return self.timing

    # ------------------------------------------------------------------ non-streaming
    def body(self) -> dict[str, Any]:
        """The chat.completion / text_completion object (after every chunk was added)."""
        choices = []
        self.offsets = {}
        for i in sorted(self.texts):
            text = "".join(self.texts[i])
            lp = self._lp_obj(i, self.lps.get(i, [])) if self.logprobs else None
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
                if self.thoughts.get(i):
                    message["reasoning_content"] = "".join(self.thoughts[i])
                if self.calls.get(i):  # content null when the answer is only calls (OpenAI)
                    message.update(content=text or None, tool_calls=join_tool_calls(self.calls[i]))
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": self.finish.get(i)})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": self.finish.get(i)})
        return {"id": object_id(self.endpoint, self.request_id),
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": {**self.usage(), "actorserve_timing": self.final_timing()}, "system_fingerprint": None}


def cached_tokens(usage: dict | None) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix cache), 0 when absent."""
    details = (usage or {}).get("prompt_tokens_details")
    return int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0
