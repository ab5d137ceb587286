"""The client's body as the gateway reads it: once, into an :class:`ApiBody`.

The gateway acts on a few fields of a chat / completions body before the validator sees it: the model
reference (resolution), the priority class, ``max_tokens`` and ``ignore_eos`` (refusal hints,
gateway/shed.py), how many choices it fans out into (``n`` x prompts: how many final chunks to wait for), and
what the merged answer shows (``n``, ``logprobs``, ``stream``, ``stream_options.include_usage``). These are
read once, by :meth:`ApiBody.parse` (the pipeline does it after admission, which may set a batch tenant's
priority), and the submit, the refusal hints, the in-flight entry and the choice merger take them from the
ApiBody. Nothing here validates: the validator checks the whole body (``raw``, forwarded unchanged) and
answers a bad field with its 400; values here that are not what they should be read as their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from control.policy.limits import choice_count
from control.policy.numbers import is_int

__all__ = ["ApiBody"]


@dataclass(frozen=True)
class ApiBody:
    """The gateway's fields of one request body, read once (module docstring).

    ``endpoint``: ``"chat"`` | ``"completions"`` (how ``logprobs`` and the choice count are read).
    ``raw``: the client's JSON object as received (handed to the validator in ``ApiRequest.body``).
    ``model``: the ``model`` value as sent (any JSON value; ``Frontend.submit`` answers 400 unless a non-empty
    string). ``priority``: the ``priority`` value as sent (default ``"interactive"``; checked by the submit).
    ``max_tokens``: ``max_tokens`` or else ``max_completion_tokens`` when a positive integer, else 0 (tokens).
    ``ignore_eos``: ``ignore_eos`` is ``true``. ``num_choices``: engine requests it fans out into
    (``control.policy.limits.choice_count``: ``n`` x prompts, capped at MAX_CHOICES + 1). ``n``: choices per
    prompt (>= 1). ``logprobs``: the answer carries logprobs (chat: ``logprobs: true``; completions:
    ``logprobs`` set). ``stream``: ``stream`` is ``true``. ``include_usage``: ``stream_options.include_usage``
    is ``true``."""

    endpoint: str
    raw: dict
    model: Any = None
    priority: Any = "interactive"
    max_tokens: int = 0
    ignore_eos: bool = False
    num_choices: int = 1
    n: int = 1
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False

    @classmethod
    def parse(cls, endpoint: str, body: Any) -> "ApiBody":
        """Read ``body`` (the client's JSON value; anything but an object reads as ``{}``) once."""
        raw = body if isinstance(body, dict) else {}
        mt = raw.get("max_tokens", raw.get("max_completion_tokens"))
        n = raw.get("n")
        opts = raw.get("stream_options")
        chat = endpoint == "chat"
        return cls(endpoint, raw, raw.get("model"), raw.get("priority", "interactive"),
                   mt if is_int(mt) and mt > 0 else 0, raw.get("ignore_eos") is True,
                   choice_count(endpoint, raw), n if is_int(n) and n >= 1 else 1,
                   (raw.get("logprobs") is True) if chat else (raw.get("logprobs") is not None),
                   raw.get("stream") is True, isinstance(opts, dict) and opts.get("include_usage") is True)
