"""Validation of OpenAI chat-completions / completions request bodies (pure: no I/O, no nats).

Two steps:

1. :func:`validate_chat` / :func:`validate_completion` (or :func:`validate_request`) check the JSON
   body field by field and return a frozen :class:`ValidatedRequest`; every refusal is a
   :class:`~actors.validator.errors.RequestError` (HTTP 400, `param` naming the field, as OpenAI does).
2. :func:`prepare_prompt` renders the chat template, tokenizes, checks the length against the
   model's context window and settles `max_tokens`.

Field rules follow OpenAI's API reference; where OpenAI is silent or a choice was needed, vLLM's
OpenAI-compatible server is the model (see docs/decisions/0003-tokenizer.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from actors.text.chat_template import ChatTemplateError, render_chat

from .errors import RequestError

__all__ = [
    "ValidatedRequest",
    "validate_request",
    "validate_chat",
    "validate_completion",
    "prepare_prompt",
    "default_stop_token_ids",
    "sampling_fields",
    "ROLES",
    "PRIORITIES",
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "choice_count",
    "MAX_N",
    "MAX_CHOICES",
]

ROLES = ("system", "user", "assistant", "tool")
PRIORITIES = ("interactive", "batch")
MAX_STOP_SEQUENCES = 4
MAX_N = 8  # default server cap on `n`
MAX_CHOICES = 32  # default server cap on n x number of prompts (engine requests of one API request)
MAX_TOP_LOGPROBS = 20  # chat `top_logprobs` upper bound (OpenAI)
MAX_COMPLETION_LOGPROBS = 5  # completions `logprobs` upper bound (OpenAI)
# OpenAI's legacy completions endpoint defaults `max_tokens` to 16 (vLLM copies this); callers that
# want that parity pass it as `default_max_tokens` for completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1

# Fields we interpret, per endpoint.
_COMMON = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
        "stream_options", "priority", "deadline_ms", "frequency_penalty", "presence_penalty", "user",
        "logprobs", "top_logprobs", "ignore_eos", "stop_token_ids",
    }
)
_CHAT = _COMMON | {"messages", "max_completion_tokens"}
_COMPLETION = _COMMON | {"prompt", "echo"}

# Fields OpenAI accepts that we accept and carry along without acting on them (yet).
_CHAT_PASSTHROUGH = frozenset(
    {
        "tools", "tool_choice", "response_format", "logit_bias", "parallel_tool_calls", "metadata", "store",
        "service_tier", "function_call", "functions", "modalities", "reasoning_effort", "prediction", "audio",
        "web_search_options", "verbosity", "safety_identifier", "prompt_cache_key",
    }
)
_COMPLETION_PASSTHROUGH = frozenset({"logit_bias", "suffix", "best_of", "metadata", "store", "service_tier"})

_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"})


@dataclass(frozen=True)
class ValidatedRequest:
    """A request body that passed validation. Units: tokens for lengths, ms for `deadline_ms`.

    `messages` (chat) are normalized copies: role "developer" becomes "system", `content` is always a
    string (text parts joined with "\\n", null content of an assistant tool-call message becomes "").
    `prompt` (completions) is a string or a tuple of token ids. `max_tokens` is the client's value
    (None = not given); `max_tokens_param` names the field it came from, for error messages.
    `extras` holds the accepted-but-not-acted-on OpenAI fields (tools, response_format, ...).
    """

    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | tuple[int, ...] | None = None
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completions: every prompt (``prompt`` is the first)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stream_options: dict[str, Any] | None = None
    priority: str | None = None
    deadline_ms: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    logprobs: int | None = None  # None: off; k: sampled token's logprob plus the k most likely
    echo: bool = False  # completions: prepend the prompt to the output
    tools: list[Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        """Engine requests this request fans out into: n per prompt."""
        return self.n * max(1, len(self.prompts))

    @property
    def prompt_param(self) -> str:
        """The request field holding the input: "messages" (chat) or "prompt" (completions)."""
        return "messages" if self.kind == "chat" else "prompt"


class _Tokenizer(Protocol):
    bos_token: str | None
    eos_token: str | None
    eos_token_id: int | None
    vocab_size: int
    chat_template: str | None
    special_tokens: dict[str, int]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


# --------------------------------------------------------------------------- field checks
def _bad(message: str, param: str | None) -> RequestError:
    return RequestError(400, message, param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _opt_number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise _bad(f"'{name}' must be a number, got {type(v).__name__}", name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        lo_s = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise _bad(f"'{name}' must be {lo_s} and at most {hi}, got {v}", name)
    return float(v)


def _opt_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def _opt_max_tokens(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if v < 1:
        raise _bad(f"'{name}' must be at least 1, got {v}", name)
    return v


def _check_unknown(body: dict, known: frozenset, passthrough: frozenset, endpoint: str) -> None:
    unknown = sorted(k for k in body if k not in known and k not in passthrough)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise _bad(f"Unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied to {endpoint}: {names}",
                   unknown[0])


def choice_count(endpoint: str, body: Any) -> int:
    """How many choices (engine requests) a body asks for: ``n`` x number of prompts.

    Pure and cheap (no validation): for a body that passes validation it equals
    ``ValidatedRequest.num_choices``; the gateway uses it to know how many final chunks to expect.
    Capped at ``MAX_CHOICES`` + 1: an absurd ``n`` (the validator refuses it) must not make the gateway
    build billions of per-choice entries (found by the schemathesis run: ``n = 10000000001``).
    """
    if not isinstance(body, dict):
        return 1
    n = body.get("n")
    n = n if _is_int(n) and n >= 1 else 1
    prompts = 1
    p = body.get("prompt")
    if endpoint in ("completion", "completions") and isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            prompts = len(p)
    return min(n * prompts, MAX_CHOICES + 1)


def _common(body: dict, max_n: int = MAX_N) -> dict[str, Any]:
    """Checks shared by both endpoints; returns ValidatedRequest keyword arguments."""
    model = body.get("model")
    if model is None:
        raise _bad("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model.strip():
        raise _bad("'model' must be a non-empty string", "model")

    temperature = _opt_number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _opt_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    frequency_penalty = _opt_number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    presence_penalty = _opt_number(body, "presence_penalty", -2.0, 2.0, 0.0)

    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k):
        raise _bad(f"'top_k' must be an integer, got {type(top_k).__name__}", "top_k")
    elif top_k == -1:  # vLLM spells "disabled" as -1
        top_k = 0
    elif top_k < 0:
        raise _bad(f"'top_k' must be >= 0 (0 disables it), got {top_k}", "top_k")

    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise _bad(f"'seed' must be an integer, got {type(seed).__name__}", "seed")
        if not _INT64_MIN <= seed <= _UINT64_MAX:
            raise _bad("'seed' must fit in 64 bits", "seed")

    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list):
        if len(stop) > MAX_STOP_SEQUENCES:
            raise _bad(f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", "stop")
        for s in stop:
            if not isinstance(s, str):
                raise _bad("'stop' must be a string or a list of strings", "stop")
        stops = tuple(s for s in stop if s)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")

    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_ids: tuple[int, ...] = ()
    elif isinstance(stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in stop_token_ids):
        stop_ids = tuple(stop_token_ids)
    else:
        raise _bad("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids")

    n = body.get("n")
    if n is None:
        n = 1
    elif not _is_int(n):
        raise _bad(f"'n' must be an integer, got {type(n).__name__}", "n")
    elif n < 1:
        raise _bad(f"'n' must be at least 1, got {n}", "n")
    elif n > max_n:
        raise _bad(f"'n' must be at most {max_n} on this server, got {n}", "n")

    stream = _opt_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        for k in stream_options:
            if k not in _STREAM_OPTIONS:
                raise _bad(f"Unrecognized stream_options field: {k!r}", f"stream_options.{k}")
        for k in _STREAM_OPTIONS:
            if stream_options.get(k) is not None and not isinstance(stream_options[k], bool):
                raise _bad(f"'stream_options.{k}' must be a boolean", f"stream_options.{k}")
        include_usage = bool(stream_options.get("include_usage"))

    priority = body.get("priority")
    if priority is not None and priority not in PRIORITIES:
        raise _bad(f"'priority' must be one of {', '.join(PRIORITIES)}, got {priority!r}", "priority")

    deadline_ms = body.get("deadline_ms")
    if deadline_ms is not None and (not _is_int(deadline_ms) or deadline_ms <= 0):
        raise _bad(f"'deadline_ms' must be a positive integer (milliseconds), got {deadline_ms!r}", "deadline_ms")

    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")

    ignore_eos = _opt_bool(body, "ignore_eos")

    return dict(
        model=model, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stops,
        stop_token_ids=stop_ids, ignore_eos=ignore_eos, n=n, stream=stream, include_usage=include_usage,
        stream_options=dict(stream_options) if stream_options is not None else None, priority=priority,
        deadline_ms=deadline_ms, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        user=user,
    )


def _message_content(m: dict, i: int, role: str) -> str:
    param = f"messages[{i}].content"
    if "content" not in m or m["content"] is None:
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            return ""
        raise _bad(f"messages[{i}] ({role}) must have a 'content'", param)
    content = m["content"]
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise _bad(f"messages[{i}].content[{j}] must be an object", param)
            ptype = part.get("type")
            if ptype != "text":
                raise _bad(
                    f"messages[{i}].content[{j}] has type {ptype!r}; only 'text' content parts are supported",
                    param,
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _bad(f"messages[{i}].content[{j}].text must be a string", param)
            texts.append(text)
        return "\n".join(texts)
    raise _bad(f"messages[{i}].content must be a string or a list of content parts", param)


def _messages(body: dict) -> tuple[dict[str, Any], ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("'messages' is a required property", "messages")
    if not isinstance(msgs, list):
        raise _bad("'messages' must be an array", "messages")
    if not msgs:
        raise _bad("'messages' must contain at least one message", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                       f"messages[{i}].role")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"messages[{i}].name must be a string", f"messages[{i}].name")
        norm = dict(m)
        norm["role"] = role
        norm["content"] = _message_content(m, i, role)
        out.append(norm)
    return tuple(out)


def _prompt(body: dict) -> tuple[str | tuple[int, ...], ...]:
    """Every prompt: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    p = body.get("prompt")
    if p is None:
        raise _bad("'prompt' is a required property", "prompt")
    if isinstance(p, str):
        return (p,)
    if isinstance(p, list):
        if not p:
            raise _bad("'prompt' must not be empty", "prompt")
        if all(_is_int(t) for t in p):
            if any(t < 0 for t in p):
                raise _bad("'prompt' token ids must be non-negative", "prompt")
            return (tuple(p),)
        if all(isinstance(x, str) for x in p):
            return tuple(p)
        if all(isinstance(x, list) for x in p):
            for i, x in enumerate(p):
                if not x or not all(_is_int(t) and t >= 0 for t in x):
                    raise _bad(f"'prompt[{i}]' must be a non-empty list of non-negative token ids", "prompt")
            return tuple(tuple(x) for x in p)
    raise _bad("'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists",
               "prompt")


def _chat_logprobs(body: dict) -> int | None:
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    if top is not None:
        if not _is_int(top):
            raise _bad(f"'top_logprobs' must be an integer, got {type(top).__name__}", "top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _bad(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        if not lp:
            raise _bad("'logprobs' must be set to true if 'top_logprobs' is used", "top_logprobs")
    return (top or 0) if lp else None


def validate_chat(body: Any, max_n: int = MAX_N, max_choices: int = MAX_CHOICES) -> ValidatedRequest:
    """Validate a `/v1/chat/completions` body. Raises RequestError(400, ..., param=<field>)."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    _check_unknown(body, _CHAT, _CHAT_PASSTHROUGH, "chat.completions")
    common = _common(body, max_n)
    messages = _messages(body)
    logprobs = _chat_logprobs(body)
    mct = _opt_max_tokens(body, "max_completion_tokens")
    mt = _opt_max_tokens(body, "max_tokens")
    # max_completion_tokens is the current OpenAI name; it wins when both are given (as in vLLM).
    max_tokens, max_param = (mct, "max_completion_tokens") if mct is not None else (mt, "max_tokens")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    extras = {k: body[k] for k in _CHAT_PASSTHROUGH if k in body and k != "tools"}
    return ValidatedRequest(kind="chat", messages=messages, max_tokens=max_tokens, max_tokens_param=max_param,
                            tools=tools, extras=extras, logprobs=logprobs, **common)


def validate_completion(body: Any, max_n: int = MAX_N, max_choices: int = MAX_CHOICES) -> ValidatedRequest:
    """Validate a `/v1/completions` body. Raises RequestError(400, ..., param=<field>)."""
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None)
    _check_unknown(body, _COMPLETION, _COMPLETION_PASSTHROUGH, "completions")
    if "top_logprobs" in body:
        raise _bad("Unrecognized request argument supplied to completions: 'top_logprobs' (use 'logprobs')",
                   "top_logprobs")
    common = _common(body, max_n)
    prompts = _prompt(body)
    if common["n"] * len(prompts) > max_choices:
        raise _bad(f"n x number of prompts must be at most {max_choices} on this server, got "
                   f"{common['n'] * len(prompts)}", "prompt" if len(prompts) > 1 else "n")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs):
            raise _bad(f"'logprobs' must be an integer, got {type(logprobs).__name__}", "logprobs")
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise _bad(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs}", "logprobs")
    echo = _opt_bool(body, "echo")
    if echo and logprobs is not None:
        raise _bad("'echo' together with 'logprobs' is not supported (prompt logprobs are not computed)", "echo")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _bad(f"only best_of=1 is supported, got {best_of!r}", "best_of")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise _bad("'suffix' must be a string", "suffix")
    max_tokens = _opt_max_tokens(body, "max_tokens")
    extras = {k: body[k] for k in _COMPLETION_PASSTHROUGH if k in body}
    return ValidatedRequest(kind="completion", prompt=prompts[0], prompts=prompts, max_tokens=max_tokens,
                            extras=extras, logprobs=logprobs, echo=echo, **common)


def validate_request(kind: str, body: Any, max_n: int = MAX_N, max_choices: int = MAX_CHOICES) -> ValidatedRequest:
    """Dispatch on `kind`: "chat" (chat completions) or "completion"/"completions"."""
    if kind == "chat":
        return validate_chat(body, max_n, max_choices)
    if kind in ("completion", "completions"):
        return validate_completion(body, max_n, max_choices)
    raise ValueError(f"unknown request kind {kind!r}")


# --------------------------------------------------------------------------- prompt + lengths
def prepare_prompt(
    validated: ValidatedRequest,
    tokenizer: _Tokenizer,
    chat_template: str | None,
    max_model_len: int,
    default_max_tokens: int | None,
    max_tokens_cap: int | None,
) -> tuple[list[int], int]:
    """Render and tokenize the prompt; return `(prompt_token_ids, max_tokens)` (both in tokens).

    Chat: `chat_template` (or the tokenizer's own when None) is rendered with
    `add_generation_prompt=True` and the text tokenized without adding BOS/EOS (the template writes
    whatever markers it wants). Completions: a string prompt is tokenized with the tokenizer's own
    BOS policy; a token-id prompt is used as given (ids must lie in the vocabulary).

    Length policy (vLLM's, `OpenAIServing._validate_input` + `get_max_tokens`):

    * prompt length >= `max_model_len` -> RequestError 400, code `context_length_exceeded`, param
      "messages"/"prompt";
    * client `max_tokens` given and prompt + max_tokens > `max_model_len` -> the same 400 with param
      "max_tokens" (or "max_completion_tokens"): rejected, not clamped, like vLLM and OpenAI;
    * otherwise `max_tokens` = min(client value or `default_max_tokens`, `max_tokens_cap`,
      `max_model_len` - prompt length), None meaning "no limit from this source". The operator cap
      clamps silently (the answer then ends with finish_reason "length"), as vLLM does with a
      generation-config `max_new_tokens`.

    Raises RequestError(400) also for an empty prompt, out-of-vocabulary token ids, or a chat
    template that refuses the conversation.
    """
    if max_model_len < 2:
        raise ValueError("max_model_len must be >= 2")
    param = validated.prompt_param
    if validated.kind == "chat":
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if not template:
            raise _bad("this model has no chat template; use the completions endpoint", "messages")
        try:
            text = render_chat(
                template,
                [dict(m) for m in validated.messages or ()],
                add_generation_prompt=True,
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
                tools=validated.tools,
            )
        except ChatTemplateError as exc:
            raise _bad(str(exc), "messages") from exc
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(validated.prompt, tuple):
        ids = list(validated.prompt)
        vs = tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vs), None)
        if bad is not None:
            raise _bad(f"token id {bad} in 'prompt' is outside the vocabulary (0..{vs - 1})", "prompt")
    else:
        ids = tokenizer.encode(validated.prompt or "", add_special_tokens=True)
    if not ids:
        raise _bad(f"'{param}' must not be empty", param)

    n = len(ids)
    what = "messages" if param == "messages" else "prompt"
    if n >= max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your {what} resulted in "
            f"{n} tokens. Please reduce the length of the {what}.",
            param=param,
            code="context_length_exceeded",
        )
    room = max_model_len - n
    if validated.max_tokens is not None:
        if n + validated.max_tokens > max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{n + validated.max_tokens} tokens ({n} in the {what}, {validated.max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                param=validated.max_tokens_param,
                code="context_length_exceeded",
            )
        wanted = validated.max_tokens
    else:
        wanted = default_max_tokens
    limits = [room] + [v for v in (wanted, max_tokens_cap) if v is not None]
    return ids, max(1, min(limits))


def default_stop_token_ids(tokenizer: _Tokenizer, chat_template: str | None = None) -> tuple[int, ...]:
    """Token ids that end generation by default: EOS, then the chat template's end-of-turn marker.

    The end-of-turn marker is found by rendering a one-turn conversation whose assistant reply is a
    sentinel and tokenizing what the template writes right after it: if that starts with a special
    (control) token, that token is the marker ("<|im_end|>" for ChatML). Control tokens whose text
    is a well-known end-of-generation marker (the list llama.cpp also treats as end of generation:
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", ...) are added too.
    Returns the ids in that order, without duplicates.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    specials = dict(tokenizer.special_tokens)
    special_ids = set(specials.values())
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template:
        sentinel = "Zq7SentinelReply"
        try:
            text = render_chat(
                template,
                [{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}],
                add_generation_prompt=False,
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
            )
        except ChatTemplateError:
            text = ""
        pos = text.rfind(sentinel)
        if pos >= 0:
            after = tokenizer.encode(text[pos + len(sentinel):], add_special_tokens=False)
            if after and after[0] in special_ids:
                ids.append(after[0])
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                 "<|end_of_text|>", "</s>", "<|return|>", "<|call|>"):
        if name in specials:
            ids.append(specials[name])
    seen: set[int] = set()
    return tuple(i for i in ids if not (i in seen or seen.add(i)))


def sampling_fields(validated: ValidatedRequest, max_tokens: int,
                    default_stop_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """Keyword arguments for `actors.worker.engine.types.SamplingParams` (and `GenerateRequest.sampling`).

    `stop_token_ids` = the client's `stop_token_ids` plus `default_stop_ids` (EOS/end-of-turn;
    left out when the client set `ignore_eos`, so benchmarks generate exactly `max_tokens`).
    """
    stop_ids = list(validated.stop_token_ids)
    if not validated.ignore_eos:
        stop_ids += [i for i in default_stop_ids if i not in stop_ids]
    return {
        "temperature": validated.temperature,
        "top_p": validated.top_p,
        "top_k": validated.top_k,
        "seed": validated.seed,
        "max_tokens": max_tokens,
        "stop_token_ids": tuple(stop_ids),
        "stop": validated.stop,
        "ignore_eos": validated.ignore_eos,
        "logprobs": validated.logprobs,
        "frequency_penalty": validated.frequency_penalty,
        "presence_penalty": validated.presence_penalty,
    }
