"""Validation of OpenAI chat-completions / completions request bodies (pure: no I/O, no nats).

Two steps:

1. :func:`validate_chat` / :func:`validate_completion` (or :func:`validate_request`) check the JSON
   body field by field (the checks both share: actors/validator/fields.py) and return a frozen
   :class:`ValidatedRequest`; every refusal is a :class:`~actors.validator.errors.RequestError`
   (HTTP 400, `param` naming the field, as OpenAI does).
2. :func:`prepare_prompt` (actors/validator/prompts.py) renders the chat template, tokenizes, checks the
   length against the model's context window and settles `max_tokens`; then
   :func:`actors.validator.sampling.sampling_params` builds the wire SamplingParams
   (request > manifest default > server default).

Every request field of an endpoint is in exactly one class of one table (:data:`ACTED`, :data:`REFUSED`,
:data:`ADVISORY`; :func:`check_fields`): nothing is accepted and silently ignored. Structured-output fields
become one llguidance grammar (actors/validator/structured.py).

Field rules follow OpenAI's API reference; where OpenAI is silent or a choice was needed, vLLM's
OpenAI-compatible server is the model (see docs/decisions/0003-tokenizer.md).
"""

from __future__ import annotations

import json
from typing import Any

from control.policy.limits import (COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_CHOICES, MAX_COMPLETION_LOGPROBS,  # noqa: F401
                                   MAX_STOP_SEQUENCES, MAX_TOP_LOGPROBS, RESERVED_TEMPLATE_VARIABLES,
                                   choice_count)  # (re-exported)
from control.policy.numbers import is_int

from .fields import (MAX_N, PRIORITIES, ValidatedRequest, bad, chat_template_kwargs, check_unknown,
                     common_fields, opt_bool, opt_max_tokens)
from .prompts import default_stop_token_ids, prepare_prompt
from .tools import tool_grammar, validate_tools

__all__ = [
    "ValidatedRequest",
    "validate_request",
    "validate_chat",
    "validate_completion",
    "prepare_prompt",
    "default_stop_token_ids",
    "ROLES",
    "PRIORITIES",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "choice_count",
    "MAX_N",
    "MAX_CHOICES",
    "MAX_STOP_SEQUENCES",
    "MAX_TOP_LOGPROBS",
    "MAX_COMPLETION_LOGPROBS",
    "ACTED",
    "REFUSED",
    "ADVISORY",
    "check_fields",
    "RESERVED_TEMPLATE_VARIABLES",
]

ROLES = ("system", "user", "assistant", "tool")

# ---- Every request field, per endpoint, in exactly one class (no field is accepted and silently ignored).
# The /openapi.json request schemas (gateway/openapi.py) list exactly these fields; tests/unit/
# test_no_ignored_fields.py holds the three together, with the ADVISORY / REFUSED tables of docs/api.md.
TOOL_CALLING = ("tools", "tool_choice", "parallel_tool_calls")  # actors/validator/tools.py
STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "guided_whitespace_pattern")  # actors/validator/structured.py
_ACTED_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "n", "stream", "stream_options", "priority", "deadline_ms", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "logprobs", "ignore_eos", "logit_bias") + STRUCTURED
# ACTED: the field changes what is generated or how it is delivered.
ACTED: dict[str, frozenset[str]] = {
    "chat": frozenset(_ACTED_COMMON + ("messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs")
                      + TOOL_CALLING),
    "completions": frozenset(_ACTED_COMMON + ("prompt", "echo")),
}
_NOT_STORED = ((None, False), "completions are not stored here")
# REFUSED: field -> (the values accepted because they ask for nothing, why any other value is a 400 naming it).
REFUSED: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    "chat": {"modalities": ((None, ["text"]), "only text output is supported"),
             "audio": ((None,), "audio output is not supported"),
             "prediction": ((None,), "predicted outputs are not supported"),
             "web_search_options": ((None,), "web search is not supported"),
             "functions": ((None,), "deprecated: use 'tools'"),
             "function_call": ((None,), "deprecated: use 'tool_choice'"),
             "store": _NOT_STORED},
    "completions": {"suffix": ((None, ""), "insertion after a suffix is not supported"),
                    "best_of": ((None, 1), "only best_of=1 is supported"),
                    "store": _NOT_STORED},
}
# ADVISORY: field -> the JSON type its value must have; accepted, and what each does here is in docs/api.md.
ADVISORY: dict[str, dict[str, type]] = {
    "chat": {"user": str, "metadata": dict, "service_tier": str, "safety_identifier": str, "prompt_cache_key": str,
             "reasoning_effort": str, "verbosity": str, "guided_decoding_backend": str},
    "completions": {"user": str, "metadata": dict, "service_tier": str, "guided_decoding_backend": str},
}
_ENDPOINT_NAMES = {"chat": "chat.completions", "completions": "completions"}


def _same(value: Any, accepted: Any) -> bool:
    return type(value) is type(accepted) and value == accepted


def check_fields(body: dict, endpoint: str) -> dict[str, Any]:
    """Apply the field classes of ``endpoint`` ("chat" | "completions") to ``body``; return the extras.

    A field in no class is a 400 naming it (OpenAI's "Unrecognized request argument"); a REFUSED field with
    a value other than its accepted ones is a 400 naming it; an ADVISORY field of the wrong JSON type is a
    400 naming it. Returns the advisory and tool-calling fields given (``ValidatedRequest.extras``), ``tools``
    aside (its own field)."""
    refused, advisory = REFUSED[endpoint], ADVISORY[endpoint]
    check_unknown(body, ACTED[endpoint], frozenset(refused) | frozenset(advisory), _ENDPOINT_NAMES[endpoint])
    for name, (accepted, why) in refused.items():
        if name in body and not any(_same(body[name], a) for a in accepted):
            shown, got = " or ".join(json.dumps(a) for a in accepted), json.dumps(body[name])
            raise bad(f"'{name}' is not supported on this server: {why} (accepted: {shown}, got "
                      f"{got if len(got) <= 60 else got[:57] + '...'})", name)
    for name, typ in advisory.items():
        if body.get(name) is not None and not isinstance(body[name], typ):
            what = "an object" if typ is dict else "a string"
            raise bad(f"'{name}' must be {what}, got {type(body[name]).__name__}", name)
    carried = set(advisory) | (set(TOOL_CALLING) - {"tools"} if endpoint == "chat" else set())
    return {k: body[k] for k in body if k in carried}


def _message_content(m: dict, i: int, role: str) -> str:
    param = f"messages[{i}].content"
    if "content" not in m or m["content"] is None:
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            return ""
        raise bad(f"messages[{i}] ({role}) must have a 'content'", param)
    content = m["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise bad(f"messages[{i}].content[{j}] must be an object", param)
            ptype = part.get("type")
            if ptype != "text":
                raise bad(
                    f"messages[{i}].content[{j}] has type {ptype!r}; only 'text' content parts are supported",
                    param,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"messages[{i}].content[{j}].text must be a string", param)
            texts.append(text)
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of content parts", param)


def _messages(body: dict) -> tuple[dict[str, Any], ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is a required property", "messages")
    if not isinstance(msgs, list):
        raise bad("'messages' must be an array", "messages")
    if not msgs:
        raise bad("'messages' must contain at least one message", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                       f"messages[{i}].role")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"messages[{i}].name must be a string", f"messages[{i}].name")
        norm = dict(m)
        norm["role"] = role
        norm["content"] = _message_content(m, i, role)
        out.append(norm)
    return tuple(out)


def _prompt(body: dict) -> tuple[str | tuple[int, ...], ...]:
    """Every prompt: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    p = body.get("prompt")
    if p is None:
        raise bad("'prompt' is a required property", "prompt")
    if isinstance(p, str):
        return (p,)
    if isinstance(p, list):
        if not p:
            raise bad("'prompt' must not be empty", "prompt")
        if all(is_int(t) for t in p):
            if any(t < 0 for t in p):
                raise bad("'prompt' token ids must be non-negative", "prompt")
            return (tuple(p),)
        if all(isinstance(x, str) for x in p):
            return tuple(p)
        if all(isinstance(x, list) for x in p):
            for i, x in enumerate(p):
                if not x or not all(is_int(t) and t >= 0 for t in x):
                    raise bad(f"'prompt[{i}]' must be a non-empty list of non-negative token ids", "prompt")
            return tuple(tuple(x) for x in p)
    raise bad("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
               "prompt")


def _chat_logprobs(body: dict) -> int | None:
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad("'logprobs' must be a boolean", "logprobs")
    if top is not None:
        if not is_int(top):
            raise bad(f"'top_logprobs' must be an integer, got {type(top).__name__}", "top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        if not lp:
            raise bad("'logprobs' must be set to true if 'top_logprobs' is used", "top_logprobs")
    return (top or 0) if lp else None


def _completion_logprobs(body: dict) -> int | None:
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not is_int(logprobs):
            raise bad(f"'logprobs' must be an integer, got {type(logprobs).__name__}", "logprobs")
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs}", "logprobs")
    return logprobs


def validate_chat(body: Any, max_n: int = MAX_N, max_choices: int = MAX_CHOICES) -> ValidatedRequest:
    """Validate a `/v1/chat/completions` body. Raises RequestError(400, ..., param=<field>)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", None)
    extras = check_fields(body, "chat")
    common = common_fields(body, max_n)
    messages = _messages(body)
    logprobs = _chat_logprobs(body)
    mct = opt_max_tokens(body, "max_completion_tokens")
    mt = opt_max_tokens(body, "max_tokens")
    # max_completion_tokens is the current OpenAI name; it wins when both are given (as in vLLM).
    max_tokens, max_param = (mct, "max_completion_tokens") if mct is not None else (mt, "max_tokens")
    tools = validate_tools(body, common.get("grammar"))  # tools, tool_choice, parallel_tool_calls, ...
    calls = tool_grammar(tools, common.get("grammar"))  # forced calls, or auto with parallel_tool_calls false
    if calls is not None:
        common = {**common, "grammar": calls}
    return ValidatedRequest(kind="chat", messages=messages, max_tokens=max_tokens, max_tokens_param=max_param,
                            tools=tools, extras=extras, logprobs=logprobs,
                            chat_template_kwargs=chat_template_kwargs(body), **common)


def validate_completion(body: Any, max_n: int = MAX_N, max_choices: int = MAX_CHOICES) -> ValidatedRequest:
    """Validate a `/v1/completions` body. Raises RequestError(400, ..., param=<field>)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", None)
    if "top_logprobs" in body:
        raise bad("Unrecognized request argument supplied to completions: 'top_logprobs' (use 'logprobs')",
                  "top_logprobs")
    extras = check_fields(body, "completions")
    common = common_fields(body, max_n)
    prompts = _prompt(body)
    if common["n"] * len(prompts) > max_choices:
        raise bad(f"n x number of prompts must be at most {max_choices} on this server, got "
                  f"{common['n'] * len(prompts)}", "prompt" if len(prompts) > 1 else "n")
    logprobs = _completion_logprobs(body)
    echo = opt_bool(body, "echo")
    if echo and logprobs is not None:
        raise bad("'echo' together with 'logprobs' is not supported (prompt logprobs are not computed)", "echo")
    max_tokens = opt_max_tokens(body, "max_tokens")
    return ValidatedRequest(kind="completion", prompt=prompts[0], prompts=prompts, max_tokens=max_tokens,
                            extras=extras, logprobs=logprobs, echo=echo, **common)


def validate_request(kind: str, body: Any, max_n: int = MAX_N, max_choices: int = MAX_CHOICES) -> ValidatedRequest:
    """Dispatch on `kind`: "chat" (chat completions) or "completion"/"completions"."""
    if kind == "chat":
        return validate_chat(body, max_n, max_choices)
    if kind in ("completion", "completions"):
        return validate_completion(body, max_n, max_choices)
    raise ValueError(f"unknown request kind {kind!r}")
