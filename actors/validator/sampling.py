"""Sampling parameters of one request: request > model manifest default > server default (pure).

:func:`layered` is the precedence rule itself. :func:`default_max_tokens` applies it to ``max_tokens``
below the request level (a client's ``max_tokens`` goes through prepare_prompt's length policy: refused
when it cannot fit, where a default is clamped); :func:`sampling_params` builds the wire
:class:`~bus.messages.SamplingParams` of one prompt from the validated request and the version's
manifest defaults (checked by ``bus.messages.sampling_defaults`` when the version's assets load).
Server defaults are the ``SamplingParams`` field defaults, and for ``max_tokens`` 16 on completions
(OpenAI's legacy default) or, on chat, whatever room the context leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from bus.messages import SamplingParams

from control.policy.limits import COMPLETIONS_DEFAULT_MAX_TOKENS, default_max_tokens  # noqa: F401 (re-exported)

from .fields import REQUEST_SAMPLING_FIELDS, ValidatedRequest

SERVER_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                                   if f.name in REQUEST_SAMPLING_FIELDS}


def layered(request: Mapping[str, Any], manifest: Mapping[str, Any], server: Mapping[str, Any]) -> dict[str, Any]:
    """For every key of ``server``: the request's value if it set one, else the manifest's, else the server's."""
    return {k: request[k] if k in request else manifest[k] if k in manifest else v for k, v in server.items()}


def stop_token_ids(validated: ValidatedRequest, default_stop_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The client's ``stop_token_ids`` plus ``default_stop_ids`` (EOS / end of turn), the latter left out
    when the client set ``ignore_eos`` (benchmarks generating exactly ``max_tokens``)."""
    ids = list(validated.stop_token_ids)
    if not validated.ignore_eos:
        ids += [i for i in default_stop_ids if i not in ids]
    return tuple(ids)


def sampling_params(validated: ValidatedRequest, max_tokens: int, default_stop_ids: tuple[int, ...] = (),
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The SamplingParams of one prompt: fields the client set (``validated.given``) win over the manifest's
    ``defaults``, which win over ``SERVER_DEFAULTS`` (``min_p`` and ``repetition_penalty`` included);
    ``max_tokens`` as settled by prepare_prompt; ``logit_bias`` and ``grammar`` (structured outputs) are
    the request's only (no manifest default).
    Raises ValueError if a default is out of range (checked at registration, so only for a hand-edited record)."""
    requested = {k: getattr(validated, k) for k in validated.given}
    chosen = layered(requested, defaults or {}, SERVER_DEFAULTS)
    return SamplingParams(**chosen, max_tokens=max_tokens, stop_token_ids=stop_token_ids(validated, default_stop_ids),
                          ignore_eos=validated.ignore_eos, logprobs=validated.logprobs,
                          logit_bias=validated.logit_bias, grammar=validated.grammar)
