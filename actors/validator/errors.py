"""Request errors in the OpenAI error shape: ``RequestError`` is :class:`bus.errors.ServeError`.

OpenAI's API answers a bad request with an HTTP status and a body
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`; `param` names the offending
request field (e.g. `"messages[2].content"`, `"max_tokens"`) or is null. The validator raises these under
the name ``RequestError`` (an alias kept so its ~50 raise sites and the validation tests read as before);
the one error type of the request path is ``bus.errors.ServeError`` (docs/decisions/0040-typed-hand-offs.md).
"""

from __future__ import annotations

from bus.errors import ServeError

__all__ = ["RequestError"]

#: the validator's name for :class:`bus.errors.ServeError` (same class: ``RequestError is ServeError``)
RequestError = ServeError
