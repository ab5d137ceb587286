"""The OpenAI Responses API (``/v1/responses``) as pure translation to and from chat completions.

The gateway runs a Responses request as a chat-completions request through its one pipeline
(gateway/pipeline.py), so tenancy, quotas, priority and deadlines apply unchanged. This module holds
every shape of that translation and no I/O (gateway/responses_api.py does the I/O):

* :func:`parse_request` checks a ``POST /v1/responses`` body (ApiError 400 naming the Responses field);
* :func:`input_items` normalises ``input`` (a string or a list of items) into stored input items;
* :func:`chat_body` builds the chat-completions body: ``instructions`` -> a system message, history
  (``previous_response_id``: that response's items + output) and input items -> ``messages``,
  ``max_output_tokens`` -> ``max_tokens``, flat function ``tools`` -> chat tools, ``text.format`` ->
  ``response_format``; :func:`response_param` maps a validator's chat field name back;
* :func:`output_from_chat` turns a chat.completion into Responses output items (``reasoning`` with
  ``reasoning_text`` content when the model thought, ``message`` with ``output_text`` content,
  ``function_call`` per tool call) and :func:`response_object` builds the ``response`` object;
* :class:`StreamTranslator` turns the chat.completion.chunk objects of a streamed run into the
  Responses streaming events (``response.created`` ... ``response.completed``), numbered by
  ``sequence_number``.

Shapes follow the OpenAI API reference (Responses: create, retrieve, streaming events).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gateway.openai_format import ApiError

# Fields accepted but not acted on (besides the ones translated below).
ADVISORY = frozenset({"service_tier", "prompt_cache_key", "safety_identifier", "user", "stream_options"})
# Fields accepted only with their default value (anything else is a 400 naming them): what they ask for
# (reasoning, extra output data, truncation, a tool-call cap, logprobs) is not served here.
DEFAULT_ONLY = {"reasoning": (None, {}), "include": (None, []), "truncation": (None, "disabled"),
                "max_tool_calls": (None,), "top_logprobs": (None, 0)}
IGNORED = ADVISORY | frozenset(DEFAULT_ONLY)
TRANSLATED = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                        "tool_choice", "text", "parallel_tool_calls", "stream", "store", "background",
                        "previous_response_id", "metadata", "priority", "deadline_ms", "seed"})
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
STATUSES = ("queued", "in_progress", "completed", "incomplete", "failed", "cancelled")
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def new_id(prefix: str) -> str:
    """``<prefix>_<32 hex>`` (``resp``, ``msg``, ``fc``): a random OpenAI-style object id."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- request -------------------------------------------------------------------------------------

def parse_request(body: Any) -> dict:
    """Check a ``POST /v1/responses`` body; return it with defaults (``store`` True, ``stream`` /
    ``background`` False). ApiError 400 names the field (``input[2].content``, ``text.format`` ...)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for k in body:
        if k not in TRANSLATED and k not in IGNORED:
            raise _bad(f"Unknown parameter: '{k}'.", k)
        if k in DEFAULT_ONLY and not any(body[k] == d and type(body[k]) is type(d) for d in DEFAULT_ONLY[k]):
            raise _bad(f"'{k}' is not supported here: only {' or '.join(repr(d) for d in DEFAULT_ONLY[k])}", k)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _bad("'model' is a required string", "model")
    if "input" not in body or body["input"] is None:
        raise _bad("'input' is required (a string or a list of input items)", "input")
    for k in ("stream", "store", "background", "parallel_tool_calls"):
        if body.get(k) is not None and not isinstance(body[k], bool):
            raise _bad(f"'{k}' must be a boolean", k)
    for k in ("instructions", "previous_response_id"):
        if body.get(k) is not None and not isinstance(body[k], str):
            raise _bad(f"'{k}' must be a string", k)
    mot = body.get("max_output_tokens")
    if mot is not None and (not isinstance(mot, int) or isinstance(mot, bool) or mot < 1):
        raise _bad("'max_output_tokens' must be an integer >= 1", "max_output_tokens")
    for k, hi in (("temperature", 2.0), ("top_p", 1.0)):
        v = body.get(k)
        if v is not None and (not _is_num(v) or not 0 <= v <= hi):
            raise _bad(f"'{k}' must be a number between 0 and {hi:g}", k)
    md = body.get("metadata")
    if md is not None and (not isinstance(md, dict) or len(md) > 16
                           or not all(isinstance(v, str) and len(v) <= 512 for v in md.values())):
        raise _bad("'metadata' must be an object of at most 16 string values", "metadata")
    out = {**body, "store": body.get("store") is not False, "stream": body.get("stream") is True,
           "background": body.get("background") is True}
    if out["background"] and not out["store"]:
        raise _bad("background responses need store=true", "background")
    out["_items"] = input_items(body["input"])
    out["_tools"] = chat_tools(body.get("tools"))
    out["_tool_choice"] = chat_tool_choice(body.get("tool_choice"))
    out["_response_format"] = chat_response_format(body.get("text"))
    return out


def _text_of(content: Any, param: str) -> str:
    """Joined text of a message's content (a string or a list of text parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{param}' must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"'{param}[{j}]' has type {kind!r}; only input_text / output_text parts with a 'text' "
                       "string are supported", f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _item_id(item: dict, prefix: str) -> str:
    """The client's item ``id`` (a string of 1..128 characters) or a new ``<prefix>_...`` one."""
    given = item.get("id")
    return given if isinstance(given, str) and 0 < len(given) <= 128 else new_id(prefix)


def input_items(value: Any) -> list[dict]:
    """Normalised input items (each with an ``id``): a string is one user message; list entries are
    messages (``{"role", "content"}``, ``type`` optional), ``function_call`` and ``function_call_output``
    items. ApiError 400 names ``input`` / ``input[i]...``."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty list of input items", "input")
    out = []
    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"'{p}' must be an object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise _bad(f"'{p}.role' must be one of {', '.join(MESSAGE_ROLES)}", f"{p}.role")
            text = _text_of(item.get("content"), f"{p}.content")
            part = "output_text" if role == "assistant" else "input_text"
            content = [{"type": part, "text": text, **({"annotations": []} if role == "assistant" else {})}]
            out.append({"type": "message", "id": _item_id(item, "msg"), "role": role, "content": content,
                        "status": "completed"})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise _bad(f"'{p}.{k}' must be a string", f"{p}.{k}")
            out.append({"type": "function_call", "id": _item_id(item, "fc"), "call_id": item["call_id"],
                        "name": item["name"], "arguments": item["arguments"], "status": "completed"})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"'{p}.call_id' must be a string", f"{p}.call_id")
            text = _text_of(item.get("output"), f"{p}.output")
            out.append({"type": "function_call_output", "id": _item_id(item, "fco"),
                        "call_id": item["call_id"], "output": text, "status": "completed"})
        elif kind == "reasoning":  # a previous answer's thinking handed back: kept, not put into the prompt
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                                      for c in parts):
                raise _bad(f"'{p}.content' must be a list of reasoning_text parts", f"{p}.content")
            out.append(reasoning_item("".join(c["text"] for c in parts), item_id=_item_id(item, "rs")))
        else:
            raise _bad(f"'{p}.type' {kind!r} is not supported (message, function_call, function_call_output, "
                       "reasoning)", f"{p}.type")
    return out


def chat_tools(tools: Any) -> list[dict] | None:
    """Flat Responses function tools ``{"type": "function", "name", "parameters", ...}`` as chat tools
    ``{"type": "function", "function": {...}}``; None for none. Other tool types: ApiError 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"'tools[{i}].type' {kind!r} is not supported; only 'function' tools are", f"tools[{i}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"'tools[{i}].name' must be a non-empty string", f"tools[{i}].name")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice``: "auto" / "none" / "required" unchanged, ``{"type": "function", "name"}`` as the
    chat ``{"type": "function", "function": {"name"}}``; None for none."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def chat_response_format(text: Any) -> dict | None:
    """``text.format`` as the chat ``response_format`` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise _bad("'text.format' of type json_schema needs a 'name' string and a 'schema' object",
                       "text.format")
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": js}
    raise _bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text.format")


def messages(items: list[dict]) -> list[dict]:
    """Chat messages of stored items: messages keep role and text; consecutive ``function_call`` items
    become one assistant message's ``tool_calls`` (joined to a preceding assistant message);
    ``function_call_output`` becomes a ``tool`` message; ``reasoning`` items are left out (as reasoning
    models' templates drop past thinking)."""
    out: list[dict] = []
    for it in items:
        if it["type"] == "message":
            out.append({"role": it["role"], "content": "\n".join(p.get("text", "") for p in it["content"])})
        elif it["type"] == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
                out[-1].setdefault("tool_calls", []).append(call)
                if not out[-1].get("content"):
                    out[-1]["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif it["type"] == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def chat_body(req: dict, history: list[dict]) -> dict:
    """The chat-completions body of a parsed request (:func:`parse_request`) after ``history`` items."""
    msgs = ([{"role": "system", "content": req["instructions"]}] if req.get("instructions") else [])
    msgs += messages(history + req["_items"])
    body: dict[str, Any] = {"model": req["model"], "messages": msgs, "stream": req["stream"]}
    if req.get("max_output_tokens") is not None:
        body["max_tokens"] = req["max_output_tokens"]
    for k in ("temperature", "top_p", "priority", "deadline_ms", "seed", "parallel_tool_calls"):
        if req.get(k) is not None:
            body[k] = req[k]
    for k, v in (("tools", req["_tools"]), ("tool_choice", req["_tool_choice"]),
                 ("response_format", req["_response_format"])):
        if v is not None:
            body[k] = v
    return body


_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input"}


def response_param(param: str | None) -> str | None:
    """The Responses field of a chat field a validator named (``max_tokens`` -> ``max_output_tokens``,
    ``messages[3].content`` -> ``input``, ``response_format...`` -> ``text.format``, ``tools[0].function.x``
    -> ``tools[0].x``)."""
    if not param:
        return param
    head = param.split("[")[0].split(".")[0]
    if head in _PARAMS:
        return _PARAMS[head]
    if head == "tools":
        return param.replace(".function", "")
    return param


# -- response ------------------------------------------------------------------------------------

def usage(chat_usage: dict | None) -> dict:
    """Responses usage of chat usage (``prompt_tokens`` -> ``input_tokens`` ...)."""
    u = chat_usage or {}
    i, o = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    from gateway.merge import cached_tokens

    r = int(((u.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return {"input_tokens": i, "input_tokens_details": {"cached_tokens": cached_tokens(u)}, "output_tokens": o,
            "output_tokens_details": {"reasoning_tokens": r}, "total_tokens": i + o}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """An assistant ``message`` output item with one ``output_text`` part."""
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """A ``reasoning`` output item: the model's thinking as one ``reasoning_text`` part (no summary)."""
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    """A ``function_call`` output item of a chat tool call ``{"id", "function": {"name", "arguments"}}``."""
    fn = call.get("function") or {}
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call.get("id") or new_id("call"),
            "name": fn.get("name", ""), "arguments": fn.get("arguments") or "", "status": status}


def output_from_chat(chat: dict) -> tuple[list[dict], str | None]:
    """``(output items, finish_reason)`` of a chat.completion body (its first choice)."""
    choice = (chat.get("choices") or [{}])[0]
    msg, finish = choice.get("message") or {}, choice.get("finish_reason")
    status = "incomplete" if finish == "length" else "completed"
    calls = msg.get("tool_calls") or []
    items = [reasoning_item(msg["reasoning_content"], status)] if msg.get("reasoning_content") else []
    if msg.get("content") or not calls:
        items.append(message_item(msg.get("content") or "", status))
    return items + [call_item(c) for c in calls], finish


def status_of(finish: str | None) -> tuple[str, dict | None]:
    """``(status, incomplete_details)`` of a chat finish reason (``length``: incomplete, max_output_tokens)."""
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_object(rec: dict) -> dict:
    """The ``response`` object of a stored / in-flight record (see gateway/responses_api.py ``record``)."""
    req = rec["request"]
    fmt = (req.get("text") or {}).get("format") or {"type": "text"}
    return {"id": rec["id"], "object": "response", "created_at": rec["created_at"], "status": rec["status"],
            "background": req.get("background", False), "error": rec.get("error"),
            "incomplete_details": rec.get("incomplete_details"), "instructions": req.get("instructions"),
            "max_output_tokens": req.get("max_output_tokens"), "model": rec.get("model") or req["model"],
            "output": rec.get("output") or [], "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "previous_response_id": req.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "store": req.get("store", True),
            "temperature": req.get("temperature", 1.0), "text": {"format": fmt},
            "tool_choice": req.get("tool_choice") or "auto", "tools": req.get("tools") or [],
            "top_p": req.get("top_p", 1.0), "truncation": "disabled", "usage": rec.get("usage"),
            "user": req["user"] if isinstance(req.get("user"), str) else None, "metadata": req.get("metadata") or {},
            "completed_at": rec.get("completed_at")}


def public_request(req: dict) -> dict:
    """The request fields a response echoes (no input, no internal ``_`` fields)."""
    return {k: v for k, v in req.items() if not k.startswith("_") and k != "input"}


def lost(rec: dict, now: float, grace_s: float = 30.0) -> dict:
    """A record shown at ``now``: one still queued / in progress long past its deadline (its gateway
    died) reads as failed with code ``gateway_lost``; any other record is returned unchanged."""
    if rec["status"] in ("queued", "in_progress") and now > rec.get("deadline_at", now) + grace_s:
        return {**rec, "status": "failed",
                "error": {"code": "gateway_lost", "message": "the gateway running this response stopped"}}
    return rec


# -- streaming -----------------------------------------------------------------------------------

class StreamTranslator:
    """Chat chunk objects in, Responses streaming events out (each with ``sequence_number``).

    ``start(resp)`` gives ``response.created`` and ``response.in_progress``; ``chunk(obj)`` the events
    of one chat.completion.chunk (``reasoning_content`` deltas open a ``reasoning`` item and its
    ``reasoning_text`` part, text deltas a ``message`` item and its ``output_text`` part, tool-call deltas a
    ``function_call`` item each); ``finish(resp)`` closes the open items and ends
    with ``response.completed`` (``response.incomplete`` / ``response.failed`` by ``resp["status"]``).
    ``output`` holds the finished output items."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict] = []
        self._msg: dict | None = None  # the open message item
        self._rs: dict | None = None  # the open reasoning item
        self._calls: dict[int, dict] = {}  # open function_call items by chat tool-call index

    def _ev(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self, resp: dict) -> list[dict]:
        """``response.created`` and ``response.in_progress`` of ``resp`` (a response object)."""
        return [self._ev("response.created", response=resp), self._ev("response.in_progress", response=resp)]

    def _open_message(self, reasoning: bool = False) -> list[dict]:
        item = {**(reasoning_item if reasoning else message_item)("", "in_progress"), "content": []}
        idx = len(self.output)
        self.output.append(item)
        if reasoning:
            self._rs = item
        else:
            self._msg = item
        part = ({"type": "reasoning_text", "text": ""} if reasoning
                else {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        evs = [self._ev("response.output_item.added", output_index=idx, item=dict(item, content=[])),
               self._ev("response.content_part.added", item_id=item["id"], output_index=idx, content_index=0,
                        part=dict(part))]
        item["content"].append(part)
        return evs

    def _close_message(self, status: str, reasoning: bool = False) -> list[dict]:
        if reasoning:
            m, self._rs = self._rs, None
        else:
            m, self._msg = self._msg, None
        if m is None:
            return []
        idx, part = self.output.index(m), m["content"][0]
        m["status"] = status
        done = (self._ev("response.reasoning_text.done", item_id=m["id"], output_index=idx, content_index=0,
                         text=part["text"]) if reasoning else
                self._ev("response.output_text.done", item_id=m["id"], output_index=idx, content_index=0,
                         text=part["text"], logprobs=[]))
        return [done,
                self._ev("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0,
                         part=dict(part)),
                self._ev("response.output_item.done", output_index=idx, item=m)]

    def chunk(self, obj: dict) -> list[dict]:
        """The events of one chat.completion.chunk object (role-only and usage chunks give none)."""
        evs: list[dict] = []
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self._rs is None:
                    evs += self._open_message(reasoning=True)
                idx = self.output.index(self._rs)
                self._rs["content"][0]["text"] += delta["reasoning_content"]
                evs.append(self._ev("response.reasoning_text.delta", item_id=self._rs["id"], output_index=idx,
                                    content_index=0, delta=delta["reasoning_content"]))
            if delta.get("content"):
                evs += self._close_message("completed", reasoning=True)
                if self._msg is None:
                    evs += self._open_message()
                idx = self.output.index(self._msg)
                self._msg["content"][0]["text"] += delta["content"]
                evs.append(self._ev("response.output_text.delta", item_id=self._msg["id"], output_index=idx,
                                    content_index=0, delta=delta["content"], logprobs=[]))
            for tc in delta.get("tool_calls") or []:
                evs += self._tool_delta(tc)
        return evs

    def _tool_delta(self, tc: dict) -> list[dict]:
        evs = self._close_message("completed", reasoning=True) + self._close_message("completed")
        k = tc.get("index", 0)
        fn = tc.get("function") or {}
        item = self._calls.get(k)
        if item is None:
            item = call_item({"id": tc.get("id"), "function": {"name": fn.get("name", ""), "arguments": ""}},
                             "in_progress")
            self._calls[k] = item
            self.output.append(item)
            evs.append(self._ev("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            evs.append(self._ev("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.output.index(item), delta=fn["arguments"]))
        return evs

    def finish(self, resp: dict) -> list[dict]:
        """Close every open item and end with the terminal event of ``resp`` (its ``output`` is set to
        the translated items)."""
        status = resp["status"]
        end = "incomplete" if status == "incomplete" else "completed"
        evs = self._close_message(end, reasoning=True) + self._close_message(end)
        for item in self._calls.values():
            idx = self.output.index(item)
            item["status"] = "completed"
            evs += [self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                             arguments=item["arguments"]),
                    self._ev("response.output_item.done", output_index=idx, item=item)]
        self._calls = {}
        resp["output"] = self.output
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(status, "response.completed")
        return evs + [self._ev(kind, response=resp)]


def replay_events(resp: dict) -> list[dict]:
    """The streaming events of a finished response object (an ``Idempotency-Key`` replay): the same
    event sequence a live stream of its output gives, with the stored item ids."""
    tr = StreamTranslator()
    evs = tr.start({**resp, "status": "in_progress", "output": [], "usage": None})
    calls = 0
    for item in resp["output"]:
        if item["type"] == "reasoning":
            text = "".join(p.get("text", "") for p in item.get("content") or ())
            evs += tr._close_message("completed") + tr._open_message(reasoning=True)
            evs += tr.chunk({"choices": [{"delta": {"reasoning_content": text}}]}) if text else []
        elif item["type"] == "message":
            evs += tr._close_message("completed", True) + tr._close_message("completed") + tr._open_message()
            evs += tr.chunk({"choices": [{"delta": {"content": "".join(p.get("text", "") for p in item["content"])}}]})
        elif item["type"] == "function_call":
            evs += tr.chunk({"choices": [{"delta": {"tool_calls": [
                {"index": calls, "id": item["call_id"], "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}]}}]})
            calls += 1
    evs += tr.finish(dict(resp))
    ids = {new["id"]: old["id"] for new, old in zip(tr.output, resp["output"])}
    for ev in evs:
        if ev.get("item_id") in ids:
            ev["item_id"] = ids[ev["item_id"]]
        if isinstance(ev.get("item"), dict) and ev["item"].get("id") in ids:
            ev["item"] = {**ev["item"], "id": ids[ev["item"]["id"]]}
    evs[-1]["response"] = resp
    return evs


def now_s() -> int:
    """Epoch seconds (``created_at`` / ``completed_at``)."""
    return int(time.time())
