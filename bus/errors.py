"""The one error of the request path: :class:`ServeError`, from the hop that detects it to the API's answer.

A request that fails anywhere (the gateway's checks, the validator's validation, a scheduler's refusal, a
lost worker, a broken stream) fails with a ServeError. It is raised inside a process, crosses the bus as its
wire dict (:meth:`ServeError.to_wire`, in ``Chunk.error`` and ``HopAck.error``), is read back with
:meth:`ServeError.from_wire`, and is answered to the client as the OpenAI error body (:meth:`ServeError.body`,
HTTP status and ``Retry-After`` from :meth:`ServeError.http_headers`). The names of the older types stay as
aliases of this class (``actors.validator.errors.RequestError``, ``gateway.openai_format.ApiError``).

Wire dict (JSON): ``{"status": int, "message": str, "type": str, "param": str|null, "code": str|null,
"retryable": bool, "retry_after": float|null}`` plus the ``extra`` keys (a scheduler's refusal hints:
``queue_clear_at`` epoch s, ``decode_step_s`` s; gateway/shed.py). Decoding keeps unknown keys in ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["ServeError", "WIRE_KEYS"]

WIRE_KEYS = ("status", "message", "type", "param", "code", "retryable", "retry_after")  # the fields on the wire


@dataclass(eq=False)
class ServeError(Exception):
    """A request the platform refuses or could not finish.

    ``status``: HTTP status (400 bad input, 404, 413, 429 quota / tenant queue full, 499 cancelled (answered
    408 over HTTP, :meth:`for_client`), 500, 502 stream broken, 503 overload / unavailable / timeouts).
    ``message``: human-readable reason. ``param``: the request field at fault (``"messages[2].content"``,
    ``"max_tokens"``) or None. ``code``: machine-readable code (``"context_length_exceeded"``,
    ``"queue_full"``, ...) or None. ``type``: the OpenAI error type (``"invalid_request_error"``,
    ``"rate_limit"``, ``"overloaded"``, ``"unavailable"``, ``"timeout"``, ``"server_error"``, ...).
    ``retry_after``: seconds a client should wait before retrying (sent as ``Retry-After``), or None.
    ``headers``: further HTTP headers of the answer (e.g. ``x-ratelimit-*`` of a quota refusal).
    ``retryable``: the request may succeed if sent again (the in-band SSE error and the NATS API say so).
    ``extra``: further wire fields passed along unchanged (a scheduler's refusal hints).
    Identity equality (an exception, hashable)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    retry_after: float | None = None
    headers: dict[str, str] = field(default_factory=dict)
    retryable: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.status = int(self.status)
        self.extra = dict(self.extra or {})
        Exception.__init__(self, self.message)

    # ------------------------------------------------------------------ the bus
    def to_wire(self) -> dict[str, Any]:
        """The wire dict (module docstring): what ``Chunk.error`` and ``HopAck.error`` carry."""
        return {"status": self.status, "message": self.message, "type": self.type, "param": self.param,
                "code": self.code, "retryable": self.retryable, "retry_after": self.retry_after, **self.extra}

    @classmethod
    def from_wire(cls, err: dict[str, Any]) -> "ServeError":
        """Read a wire dict back (missing status: 500, missing type: ``server_error``; keys beyond
        WIRE_KEYS go to ``extra``). Not a dict: a 500 saying so."""
        if not isinstance(err, dict):
            return cls(500, f"malformed error: {err!r:.100}", type="server_error")
        return cls(int(err.get("status") or 500), str(err.get("message", "error")), err.get("param"),
                   err.get("code"), str(err.get("type") or "server_error"), err.get("retry_after"),
                   retryable=bool(err.get("retryable")),
                   extra={k: v for k, v in err.items() if k not in WIRE_KEYS})

    # ------------------------------------------------------------------ the API
    def for_client(self) -> "ServeError":
        """The error as answered over HTTP: a 499 (cancelled) becomes 408; otherwise self."""
        return replace(self, status=408) if self.status == 499 else self

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body (:meth:`body`; the name ``RequestError`` callers use)."""
        return self.body()

    def http_headers(self) -> dict[str, str]:
        """``headers`` plus Retry-After (whole seconds, >= 1) when ``retry_after`` is set."""
        h = dict(self.headers)
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, int(round(self.retry_after))))
        return h

    @classmethod
    def from_dict(cls, status: int, body: dict[str, Any]) -> "ServeError":
        """Rebuild from an HTTP status and an OpenAI error body (``{"error": {...}}`` or the inner object);
        missing type: ``invalid_request_error``."""
        err = body.get("error", body) if isinstance(body, dict) else {}
        return cls(status, str(err.get("message", "")), err.get("param"), err.get("code"),
                   err.get("type") or "invalid_request_error")

    @classmethod
    def from_chunk_error(cls, err: dict[str, Any]) -> "ServeError":
        """The client-facing error of a wire dict: ``from_wire(err).for_client()``."""
        return cls.from_wire(err).for_client()

    def __repr__(self) -> str:
        return f"ServeError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"
