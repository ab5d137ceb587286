"""Opt-in logging of request content (prompts, messages, token ids, generated text).

Prompts and outputs are never logged by default, at any log level (issue #8 item 8; docs/observability.md
"Request content in logs"). Setting ``ACTORSERVE_LOG_PROMPTS=1`` in an actor's environment (``actorserve up``
passes its environment on to every actor) turns on these lines, at INFO on the logger
``actorserve.content``:

* gateway: ``request body of <request id>: <JSON body>`` (every HTTP / NATS API / jobs request);
* validator: ``prompt token ids of <request id>: [...]``;
* worker: ``output of <request id>: <text>`` (one line per streamed chunk with text).

Everything else that logs about a request names it by id, tenant, model and status only. Error messages
that are logged must not quote request bodies; use :func:`describe` to log a value's type and size instead.
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV_LOG_PROMPTS = "ACTORSERVE_LOG_PROMPTS"

log = logging.getLogger("actorserve.content")


def enabled() -> bool:
    """True when ``ACTORSERVE_LOG_PROMPTS`` is ``1`` / ``true`` / ``yes`` / ``on`` (read on every call, cheap)."""
    return os.environ.get(ENV_LOG_PROMPTS, "").strip().lower() in ("1", "true", "yes", "on")


def log_content(what: str, request_id: str, value: Any) -> None:
    """Log ``value`` (request content) as ``<what> of <request_id>: <value>`` at INFO, only when
    :func:`enabled`; otherwise do nothing (the value is not even formatted)."""
    if not enabled():
        return
    if isinstance(value, (dict, list)):
        try:
            import orjson
            value = orjson.dumps(value).decode()
        except TypeError:
            pass
    log.info("%s of %s: %s", what, request_id, value)


def describe(value: Any) -> str:
    """A content-free description of ``value`` for logs: its type and length (``str of 123 chars``)."""
    try:
        return f"{type(value).__name__} of {len(value)} {'chars' if isinstance(value, str) else 'bytes/items'}"
    except TypeError:
        return type(value).__name__
