"""The validated request record and the field checks both endpoints share (pure: no I/O, no nats).

Each check reads one field of a JSON body and returns its normalized value, or raises
:class:`~actors.validator.errors.RequestError` (HTTP 400, ``param`` naming the field, as OpenAI does).
:func:`common_fields` runs the checks both endpoints share and returns ``ValidatedRequest`` keyword
arguments, including ``given``: the sampling fields the client set (not null), so that a model's
manifest defaults fill only the others (actors/validator/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bus.messages import MANIFEST_DEFAULTABLE, SamplingParams, check_sampling_field

from control.policy.limits import MAX_STOP_SEQUENCES, RESERVED_TEMPLATE_VARIABLES
from control.policy.numbers import is_int, is_number

from .errors import RequestError
from .structured import structured_grammar

PRIORITIES = ("interactive", "batch")
MAX_N = 8  # default server cap on `n`
STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation", "continuous_usage_stats"})
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
# Sampling fields a request body names as the SamplingParams field (max_tokens has two names and its own
# length policy: prepare_prompt).
REQUEST_SAMPLING_FIELDS = tuple(k for k in MANIFEST_DEFAULTABLE if k != "max_tokens")


@dataclass(frozen=True)
class ValidatedRequest:
    """A request body that passed validation. Units: tokens for lengths, ms for `deadline_ms`.

    `messages` (chat) are normalized copies: role "developer" becomes "system", `content` is always a
    string (text parts joined with "\\n", null content of an assistant tool-call message becomes "").
    `prompt` (completions) is a string or a tuple of token ids. `max_tokens` is the client's value
    (None = not given); `max_tokens_param` names the field it came from, for error messages.
    `extras` holds the accepted fields this record does not translate: the tool-calling fields other than
    `tools` and the advisory fields (actors/validator/validation.py ``check_fields``).
    Sampling fields the client left out hold the server defaults here; `given` names those it set.
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
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id; ids checked against the vocab later
    grammar: str | None = None  # llguidance grammar text (actors/validator/structured.py); None = unconstrained
    user: str | None = None
    logprobs: int | None = None  # None: off; k: sampled token's logprob plus the k most likely
    echo: bool = False  # completions: prepend the prompt to the output
    tools: Any = None  # chat: actors.validator.tools.ToolRequest (tools, tool_choice, parallel_tool_calls)
    chat_template_kwargs: dict[str, Any] | None = None  # chat: extra chat-template variables (vLLM's field)
    extras: dict[str, Any] = field(default_factory=dict)
    given: frozenset[str] = frozenset()  # sampling fields the client set (not null): manifest defaults fill the rest

    @property
    def num_choices(self) -> int:
        """Engine requests this request fans out into: n per prompt."""
        return self.n * max(1, len(self.prompts))

    @property
    def prompt_param(self) -> str:
        """The request field holding the input: "messages" (chat) or "prompt" (completions)."""
        return "messages" if self.kind == "chat" else "prompt"


def bad(message: str, param: str | None) -> RequestError:
    """The 400 RequestError of a refused field."""
    return RequestError(400, message, param=param)


def opt_number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    """``body[name]`` as a float in [lo, hi] (``(lo, hi]`` when ``lo_open``); ``default`` when absent/null."""
    v = body.get(name)
    if v is None:
        return default
    if not is_number(v):
        raise bad(f"'{name}' must be a number, got {type(v).__name__}", name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        lo_s = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise bad(f"'{name}' must be {lo_s} and at most {hi}, got {v}", name)
    return float(v)


def opt_bool(body: dict, name: str, default: bool = False) -> bool:
    """``body[name]`` as a bool; ``default`` when absent/null."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean, got {type(v).__name__}", name)
    return v


def opt_max_tokens(body: dict, name: str) -> int | None:
    """``body[name]`` as a token count >= 1; None when absent/null."""
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    if v < 1:
        raise bad(f"'{name}' must be at least 1, got {v}", name)
    return v


def chat_template_kwargs(body: dict) -> dict[str, Any] | None:
    """``body["chat_template_kwargs"]``: a JSON object of extra chat-template variables (vLLM's field, e.g.
    ``{"enable_thinking": false}`` for Qwen3); None when absent/null. 400 naming
    ``chat_template_kwargs`` when it is not an object, ``chat_template_kwargs.<key>`` for a key that is not a
    string or that would override a variable the server sets (RESERVED_TEMPLATE_VARIABLES)."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad(f"'chat_template_kwargs' must be an object, got {type(v).__name__}", "chat_template_kwargs")
    for k in v:
        if not isinstance(k, str) or not k:
            raise bad("'chat_template_kwargs' keys must be non-empty strings", "chat_template_kwargs")
        if k in RESERVED_TEMPLATE_VARIABLES:
            raise bad(f"'chat_template_kwargs.{k}' is set by the server and cannot be overridden (reserved: "
                      f"{', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})", f"chat_template_kwargs.{k}")
    return dict(v)


def check_unknown(body: dict, known: frozenset, passthrough: frozenset, endpoint: str) -> None:
    """Refuse fields neither interpreted (``known``) nor carried along (``passthrough``)."""
    unknown = sorted(k for k in body if k not in known and k not in passthrough)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise bad(f"Unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied to {endpoint}: {names}",
                  unknown[0])


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        raise bad("you must provide a model parameter", "model")
    if not isinstance(model, str) or not model.strip():
        raise bad("'model' must be a non-empty string", "model")
    return model


def _top_k(body: dict) -> int:
    top_k = body.get("top_k")
    if top_k is None:
        return 0
    if not is_int(top_k):
        raise bad(f"'top_k' must be an integer, got {type(top_k).__name__}", "top_k")
    if top_k == -1:  # vLLM spells "disabled" as -1
        return 0
    if top_k < 0:
        raise bad(f"'top_k' must be >= 0 (0 disables it), got {top_k}", "top_k")
    return top_k


def _seed(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise bad(f"'seed' must be an integer, got {type(seed).__name__}", "seed")
        if not _INT64_MIN <= seed <= _UINT64_MAX:
            raise bad("'seed' must fit in 64 bits", "seed")
    return seed


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if not isinstance(stop, list):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise bad(f"'stop' accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", "stop")
    if not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings", "stop")
    return tuple(s for s in stop if s)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids):
        return tuple(ids)
    raise bad("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids")


def _n(body: dict, max_n: int) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if not is_int(n):
        raise bad(f"'n' must be an integer, got {type(n).__name__}", "n")
    if n < 1:
        raise bad(f"'n' must be at least 1, got {n}", "n")
    if n > max_n:
        raise bad(f"'n' must be at most {max_n} on this server, got {n}", "n")
    return n


def _stream_options(body: dict, stream: bool) -> tuple[dict[str, Any] | None, bool]:
    """``(stream_options copy or None, include_usage)``."""
    opts = body.get("stream_options")
    if opts is None:
        return None, False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    for k in opts:
        if k not in STREAM_OPTIONS:
            raise bad(f"Unrecognized stream_options field: {k!r}", f"stream_options.{k}")
    for k in STREAM_OPTIONS:
        if opts.get(k) is not None and not isinstance(opts[k], bool):
            raise bad(f"'stream_options.{k}' must be a boolean", f"stream_options.{k}")
    return dict(opts), bool(opts.get("include_usage"))


def _scheduling(body: dict) -> dict[str, Any]:
    """``priority``, ``deadline_ms`` and ``user``."""
    priority = body.get("priority")
    if priority is not None and priority not in PRIORITIES:
        raise bad(f"'priority' must be one of {', '.join(PRIORITIES)}, got {priority!r}", "priority")
    deadline_ms = body.get("deadline_ms")
    if deadline_ms is not None and (not is_int(deadline_ms) or deadline_ms <= 0):
        raise bad(f"'deadline_ms' must be a positive integer (milliseconds), got {deadline_ms!r}", "deadline_ms")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user")
    return dict(priority=priority, deadline_ms=deadline_ms, user=user)


_SAMPLING_DEFAULTS = SamplingParams()


def _sampling_field(body: dict, name: str) -> Any:
    """``body[name]`` checked by the SamplingParams check of that field; its default when absent/null."""
    v = body.get(name)
    if v is None:
        return getattr(_SAMPLING_DEFAULTS, name)
    try:
        return check_sampling_field(name, v)
    except ValueError as exc:
        raise bad(f"'{name}' {str(exc).removeprefix(name).strip()}", name) from None


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI ``logit_bias``: an object token id -> bias in [-100, 100], at most 300 entries."""
    v = body.get("logit_bias")
    if v is not None and not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases in [-100, 100]", "logit_bias")
    return _sampling_field(body, "logit_bias")


def _sampling(body: dict) -> dict[str, Any]:
    """The sampling fields both endpoints share (``max_tokens`` and ``logprobs`` are per endpoint)."""
    return dict(
        temperature=opt_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=opt_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        frequency_penalty=opt_number(body, "frequency_penalty", -2.0, 2.0, 0.0),
        presence_penalty=opt_number(body, "presence_penalty", -2.0, 2.0, 0.0),
        top_k=_top_k(body), seed=_seed(body), stop=_stop(body), stop_token_ids=_stop_token_ids(body),
        ignore_eos=opt_bool(body, "ignore_eos"),
        min_p=_sampling_field(body, "min_p"), repetition_penalty=_sampling_field(body, "repetition_penalty"),
        logit_bias=_logit_bias(body), grammar=structured_grammar(body),
        given=frozenset(k for k in REQUEST_SAMPLING_FIELDS if body.get(k) is not None),
    )


def common_fields(body: dict, max_n: int = MAX_N) -> dict[str, Any]:
    """Checks shared by both endpoints; returns ValidatedRequest keyword arguments. Raises RequestError."""
    model = _model(body)
    sampling = _sampling(body)
    n = _n(body, max_n)
    stream = opt_bool(body, "stream")
    stream_options, include_usage = _stream_options(body, stream)
    return dict(model=model, **sampling, n=n, stream=stream, include_usage=include_usage,
                stream_options=stream_options, **_scheduling(body))
