"""Server-sent event framing for the OpenAI-style streams of the gateway.

SSE (WHATWG HTML, "Server-sent events", §9.2.6) ends a line only at CR, LF or CRLF; clients that split on
more (U+0085, U+2028, U+2029, as :meth:`str.splitlines` does) are kept whole by :mod:`bus.jsonline`, whose
escaping every payload here goes through.
"""

from __future__ import annotations

from bus.jsonline import dumps as json_payload
from bus.jsonline import escape_line_breaks

__all__ = ["DONE", "data_event", "escape_line_breaks", "json_payload"]

DONE = b"data: [DONE]\n\n"
"""The OpenAI end-of-stream event."""


def data_event(payload: bytes) -> bytes:
    """One SSE ``data:`` event (bytes) carrying ``payload``, a :func:`json_payload` result."""
    return b"data: " + payload + b"\n\n"
