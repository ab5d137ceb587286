"""Server-sent event framing for the OpenAI-style streams of the gateway.

SSE (WHATWG HTML, "Server-sent events", §9.2.6) ends a line only at CR, LF or CRLF. Widely used
clients split on more: httpx's ``Response.aiter_lines`` follows :meth:`str.splitlines`, which also
breaks at U+0085 (NEL), U+2028 and U+2029, and orjson writes those three raw inside JSON strings. A
sampled token that decodes to one of them cut a chunk in two for such a client (the chaos suite's
baseline phase, CI of stop 11). JSON (RFC 8259 §7) lets any character be written as a ``\\uXXXX``
escape, so escaping these three keeps every value and keeps each ``data:`` line one line for every
client. The other characters ``splitlines`` breaks at (U+000B, U+000C, U+001C..U+001E) are control
characters that orjson already escapes.
"""

from __future__ import annotations

import orjson

# UTF-8 bytes of U+0085, U+2028, U+2029 and their JSON escapes. In valid UTF-8 these byte sequences
# only ever encode those characters (their first byte is a lead byte), so a byte replace is exact.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))

DONE = b"data: [DONE]\n\n"
"""The OpenAI end-of-stream event."""


def escape_line_breaks(payload: bytes) -> bytes:
    """UTF-8 JSON ``payload`` with U+0085, U+2028 and U+2029 written as JSON escapes (same value)."""
    for raw, escaped in _LINE_BREAKS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return payload


def json_payload(obj) -> bytes:
    """``obj`` as compact JSON (UTF-8 bytes) with no character any common client reads as a line end.

    Raises ``orjson.JSONEncodeError`` (a TypeError) if ``obj`` is not JSON-serialisable."""
    return escape_line_breaks(orjson.dumps(obj))


def data_event(payload: bytes) -> bytes:
    """One SSE ``data:`` event (bytes) carrying ``payload``, a :func:`json_payload` result."""
    return b"data: " + payload + b"\n\n"
