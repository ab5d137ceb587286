"""The request limits the gateway and the validator share (issue 19 item 2): pure, no I/O.

The validator refuses what passes them (actors/validator/); the gateway sizes its per-request tables and
documents them in the OpenAPI schema with the same figures (gateway/frontend.py, budgets.py, openapi.py).
"""

from __future__ import annotations

from typing import Any, Mapping

from control.policy.numbers import is_int

__all__ = ["MAX_CHOICES", "MAX_TOP_LOGPROBS", "MAX_COMPLETION_LOGPROBS", "MAX_STOP_SEQUENCES", "choice_count",
           "COMPLETIONS_DEFAULT_MAX_TOKENS", "default_max_tokens"]

MAX_CHOICES = 32  # default server cap on n x number of prompts (engine requests of one API request)
MAX_TOP_LOGPROBS = 20  # chat `top_logprobs` upper bound (OpenAI)
MAX_COMPLETION_LOGPROBS = 5  # completions `logprobs` upper bound (OpenAI)
MAX_STOP_SEQUENCES = 4
# OpenAI's legacy completions endpoint defaults `max_tokens` to 16 (vLLM copies this).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


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
    n = n if is_int(n) and n >= 1 else 1
    prompts = 1
    p = body.get("prompt")
    if endpoint in ("completion", "completions") and isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            prompts = len(p)
    return min(n * prompts, MAX_CHOICES + 1)


def default_max_tokens(endpoint: str, defaults: Mapping[str, Any]) -> int | None:
    """``max_tokens`` (tokens) when the client sets none: the manifest's default, else the server's
    (16 for "completions"; None for chat: the room left in the context, capped by the operator)."""
    server = COMPLETIONS_DEFAULT_MAX_TOKENS if endpoint in ("completion", "completions") else None
    return defaults["max_tokens"] if "max_tokens" in defaults else server


# Template variables the server sets itself (actors/validator/prompts.py render_prompt) or that name
# transformers' apply_chat_template arguments: a request's ``chat_template_kwargs`` may not set them (the
# validator refuses such a key, 400 naming ``chat_template_kwargs.<key>``; docs/api.md).
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
    "unk_token", "pad_token", "raise_exception", "strftime_now", "chat_template", "tokenize",
})
