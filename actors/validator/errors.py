"""Request errors in the OpenAI error shape.

OpenAI's API answers a bad request with an HTTP status and a body
`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}`; `param` names the offending
request field (e.g. `"messages[2].content"`, `"max_tokens"`) or is null.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request the platform refuses, carrying its HTTP status and OpenAI error fields.

    `status`: HTTP status code (400 for invalid input). `message`: human-readable reason.
    `param`: the request field at fault, or None. `code`: machine-readable code such as
    `"context_length_exceeded"`, or None. `type`: OpenAI error type (default `"invalid_request_error"`).
    `extra`: further fields of a scheduler's refusal passed on in the error chunk (the refusal hint of
    gateway/shed.py: `queue_clear_at`, `decode_step_s`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.extra = dict(extra or {})

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_dict(cls, status: int, body: dict[str, Any]) -> RequestError:
        """Rebuild from a status and an OpenAI error body (e.g. one that crossed the bus)."""
        err = body.get("error", body) if isinstance(body, dict) else {}
        return cls(
            status,
            str(err.get("message", "")),
            err.get("param"),
            err.get("code"),
            err.get("type") or "invalid_request_error",
        )

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"
