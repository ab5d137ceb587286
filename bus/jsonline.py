"""JSON that stays on one line for every common client: SSE ``data:`` payloads and JSONL files.

JSON Lines (jsonlines.org) and SSE (WHATWG HTML §9.2.6) end a line only at LF (SSE: also CR, CRLF). Widely
used clients split on more: Python's :meth:`str.splitlines` (so httpx's ``Response.aiter_lines`` and the
``openai`` SDK's ``files.content(...).text.splitlines()``) also breaks at U+0085 (NEL), U+2028 and U+2029, and
orjson writes those three raw inside JSON strings. A sampled token that decodes to one of them cut a stream chunk
in two (the chaos suite, CI of stop 11) and a batch output line in two (the chaos suite's batch test, CI of stop
45). JSON (RFC 8259 §7) lets any character be written as a ``\\uXXXX`` escape, so escaping these three keeps every
value and keeps each record one line. The other characters ``splitlines`` breaks at (U+000B, U+000C,
U+001C..U+001E) are control characters that orjson already escapes.
"""

from __future__ import annotations

import orjson

# UTF-8 bytes of U+0085, U+2028, U+2029 and their JSON escapes. In valid UTF-8 these byte sequences
# only ever encode those characters (their first byte is a lead byte), so a byte replace is exact.
_LINE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def escape_line_breaks(payload: bytes) -> bytes:
    """UTF-8 JSON ``payload`` with U+0085, U+2028 and U+2029 written as JSON escapes (same value)."""
    for raw, escaped in _LINE_BREAKS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return payload


def dumps(obj, default=None) -> bytes:
    """``obj`` as compact JSON (UTF-8 bytes) with no character any common client reads as a line end.

    ``default`` is orjson's hook for types it cannot write (e.g. ``str``). Raises ``orjson.JSONEncodeError``
    (a TypeError) if ``obj`` is not JSON-serialisable."""
    return escape_line_breaks(orjson.dumps(obj, default=default))


def line(obj, default=None) -> bytes:
    """One JSON Lines record: :func:`dumps` of ``obj`` followed by ``b"\\n"``."""
    return dumps(obj, default) + b"\n"
