"""Tool-call text formats: how tools, calls and results are written into a prompt, and how a model's
output is parsed back into OpenAI ``tool_calls`` (pure: no I/O, no torch, no nats).

One format today, ``"hermes"`` (NousResearch Hermes-2-Pro / Qwen2.5 style, also what vLLM's
``hermes`` tool parser reads; docs/tools.md):

* the tools are listed in the system turn, one JSON object per line inside ``<tools></tools>``, with
  instructions (:data:`HERMES_INSTRUCTIONS`);
* a call is ``<tool_call>\\n{"name": <function name>, "arguments": <JSON object>}\\n</tool_call>``, several
  calls one after another;
* tool results go back as a user turn whose content is each result wrapped in
  ``<tool_response>\\n...\\n</tool_response>`` (consecutive results share one turn).

:func:`render_messages` rewrites OpenAI chat messages (assistant ``tool_calls``, ``tool`` results) into
plain-content messages any chat template renders. :class:`HermesParser` is the streaming parser the worker
runs on the generated text: :meth:`~HermesParser.feed` takes text deltas and returns the content to show
plus OpenAI streaming ``tool_calls`` deltas; :meth:`~HermesParser.finish` flushes at the end. A call is
emitted once its closing tag arrived and its JSON parsed (``{"name": str, "arguments": object}``); a
malformed or unterminated call stays in the content as the text the model wrote.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from bus.messages import TOOL_CALL_FORMATS as FORMATS

__all__ = ["FORMATS", "ParseDelta", "HermesParser", "make_parser", "parse_step", "new_call_id", "render_messages",
           "format_call", "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_ALNUM = string.ascii_letters + string.digits

HERMES_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 random letters and digits (``secrets``)."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# --------------------------------------------------------------------------- prompt side
def format_call(name: str, arguments: Any) -> str:
    """One call in Hermes form. ``arguments``: a JSON string (as OpenAI messages carry it; written as the
    object it encodes, or as a JSON string value when it is not valid JSON) or an already decoded value."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # keep the client's text, as a JSON string value
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def _tools_block(tools: Iterable[dict]) -> str:
    lines = [json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools]
    return HERMES_INSTRUCTIONS.format(tools="\n".join(lines))


def _calls_of(m: dict) -> list[tuple[str, Any]]:
    """(name, arguments) of an assistant message's ``tool_calls`` (or legacy ``function_call``)."""
    calls = [c.get("function") or {} for c in (m.get("tool_calls") or ()) if isinstance(c, dict)]
    if isinstance(m.get("function_call"), dict):
        calls.append(m["function_call"])
    return [(str(c.get("name", "")), c.get("arguments", "{}")) for c in calls]


def render_messages(fmt: str, messages: Iterable[dict], tools: Iterable[dict] | None = None) -> list[dict]:
    """Rewrite OpenAI chat messages into plain ``{"role", "content"}`` messages in format ``fmt``.

    ``tools``: function definitions (``{"name", "description"?, "parameters"?}``) to list in the system
    turn (appended to a leading system message, or a new one first); None or empty lists none. Assistant
    ``tool_calls`` become Hermes call blocks after the message's content; each run of ``tool`` messages
    becomes one user turn of ``<tool_response>`` blocks. Other messages keep their fields. ValueError for an
    unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r} (known: {', '.join(FORMATS)})")
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{m.get('content') or ''}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_turn"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
        elif role == "assistant" and _calls_of(m):
            parts = [m.get("content") or ""] + [format_call(n, a) for n, a in _calls_of(m)]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "function_call")})
    for m in out:
        m.pop("_tool_turn", None)
    tools = list(tools or ())
    if tools:
        block = _tools_block(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# --------------------------------------------------------------------------- output side
@dataclass
class ParseDelta:
    """What one step of parsing yields: ``text`` (content to show) and ``tool_calls`` (OpenAI streaming
    deltas: ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`` opening a call,
    then ``{"index", "function": {"arguments": <piece>}}``)."""

    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __iadd__(self, other: "ParseDelta") -> "ParseDelta":
        self.text += other.text
        self.tool_calls.extend(other.tool_calls)
        return self


def _hold_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (may still become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _parse_call(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` of a call body, or None when it is not ``{"name": str, "arguments":
    object}`` (``arguments`` missing counts as ``{}``; a JSON string holding an object is accepted)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


# A call's JSON up to its arguments value: {"name": "<name>", "arguments": <first character of the value>
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')


@dataclass
class _ArgScan:
    """Where the streamed arguments of call ``index`` stand in the open call's body: ``pos`` the next
    character to scan; JSON nesting ``depth``, string and escape state; ``done`` once the value closed."""

    index: int
    pos: int
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    done: bool = False

    def scan(self, body: str) -> str:
        """The arguments text in ``body[pos:]`` up to the end of the value (a JSON object or array)."""
        start = self.pos
        while self.pos < len(body) and not self.done:
            ch = body[self.pos]
            self.pos += 1
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif self.depth == 0 and ch in ",}]":  # a scalar value ended (the tool grammar writes objects)
                self.pos -= 1
                self.done = True
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        return body[start:self.pos]


class HermesParser:
    """Streaming parser of Hermes tool calls in generated text (see the module docstring).

    ``max_calls``: calls to emit at most (0 = any number; 1 for ``parallel_tool_calls: false``); later
    well-formed calls are dropped, as vLLM does. Whitespace between content and a call, between calls and
    after the last call is dropped, so an answer of only calls has empty content (trailing whitespace is
    held back until the next text shows whether a call follows). ``call_id`` makes the
    ids (tests pass a deterministic one). Feeding the same text in any split yields the same joined
    content and the same calls.

    ``stream_arguments`` (set when a grammar forces well-formed calls: ``tool_choice`` required or named):
    a call opens as soon as ``{"name": "...", "arguments": `` arrived and its arguments stream in pieces
    as the model writes them (their text as written), instead of all at once when the call closed (their
    JSON re-serialized): without a grammar a call may still turn out malformed and must then stay text.
    """

    def __init__(self, max_calls: int = 0, call_id: Callable[[], str] = new_call_id,
                 stream_arguments: bool = False) -> None:
        if max_calls < 0:
            raise ValueError("max_calls must be >= 0")
        self.max_calls, self._call_id, self.stream_arguments = max_calls, call_id, stream_arguments
        self._live: _ArgScan | None = None  # the call whose arguments are streaming (stream_arguments)
        self._buf = ""  # text not yet emitted (held back: whitespace, a partial tag, an open call's body)
        self._in_call = False
        self._gap = ""  # whitespace dropped before the open call
        self.num_calls = 0  # calls emitted

    def feed(self, text: str) -> ParseDelta:
        """Take the next text delta; return what can be emitted now."""
        self._buf += text
        out = ParseDelta()
        while True:
            if self._in_call:
                if self.stream_arguments:
                    out += self._stream()
                end = self._buf.find(CALL_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CALL_CLOSE):]
                self._in_call = False
                if self._live is None:
                    out += self._close(body)
                self._live = None
            else:
                start = self._buf.find(CALL_OPEN)
                if start < 0:
                    out.text += self._emit_text(len(self._buf) - _hold_back(self._buf, CALL_OPEN))
                    return out
                before = self._buf[:start]
                keep = before.rstrip()
                out.text += keep
                self._gap = before[len(keep):]  # given back if the call turns out malformed
                self._buf = self._buf[start + len(CALL_OPEN):]
                self._in_call = True

    def finish(self) -> ParseDelta:
        """End of generation: an unterminated call and any held-back text become content."""
        out = ParseDelta()
        if self._in_call:  # a streamed call cut short (max_tokens) ends as far as it came
            out.text = self._gap + CALL_OPEN + self._buf if self._live is None else ""
        elif self._buf.strip() or not self.num_calls:  # whitespace after the last call is dropped
            out.text = self._buf
        self._buf, self._in_call, self._live = "", False, None
        return out

    def _emit_text(self, n: int) -> str:
        """Emit ``self._buf[:n]`` minus trailing whitespace (held until we know whether a call follows)."""
        head = self._buf[:n]
        keep = head.rstrip()
        self._buf = head[len(keep):] + self._buf[n:]
        return keep

    def _stream(self) -> ParseDelta:
        """``stream_arguments``: open the call once its name is known, then emit the arguments text as it
        arrives (the open call's body stays in the buffer until its closing tag)."""
        if self._live is None:
            m = _HEADER.match(self._buf)
            if m is None or (self.max_calls and self.num_calls >= self.max_calls):
                return ParseDelta()
            self._live = _ArgScan(self.num_calls, m.end())
            self.num_calls += 1
            head = {"index": self._live.index, "id": self._call_id(), "type": "function",
                    "function": {"name": json.loads(m.group(1)), "arguments": ""}}
            out = ParseDelta(tool_calls=[head])
        else:
            out = ParseDelta()
        piece = self._live.scan(self._buf)
        if piece:
            out.tool_calls.append({"index": self._live.index, "function": {"arguments": piece}})
        return out

    def _close(self, body: str) -> ParseDelta:
        parsed = _parse_call(body)
        if parsed is None:  # malformed: the model's text stays content (after any whitespace held)
            raw = self._gap + CALL_OPEN + body + CALL_CLOSE
            self._buf = raw + self._buf
            return ParseDelta(text=self._emit_text(len(raw)))
        if self.max_calls and self.num_calls >= self.max_calls:
            return ParseDelta()
        name, arguments = parsed
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return ParseDelta(tool_calls=[
            {"index": index, "id": self._call_id(), "type": "function", "function": {"name": name, "arguments": ""}},
            {"index": index, "function": {"arguments": arguments}},
        ])


def parse_step(parser: HermesParser | None, text: str, finished: bool) -> tuple[str, tuple[dict, ...]]:
    """One engine step's ``(content text, tool_call deltas)``: ``text`` through ``parser`` (flushed when
    ``finished``); no parser: the text as is and no calls."""
    if parser is None:
        return text, ()
    out = parser.feed(text)
    if finished:
        out += parser.finish()
    return out.text, tuple(out.tool_calls)


def make_parser(fmt: str | None, parallel: bool = True, stream_arguments: bool = False) -> HermesParser | None:
    """The streaming parser of tool-call format ``fmt`` (None -> None: no parsing); ``parallel`` False
    keeps at most one call; ``stream_arguments`` when a grammar guarantees well-formed calls (see
    :class:`HermesParser`). ValueError for an unknown format."""
    if fmt is None:
        return None
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r} (known: {', '.join(FORMATS)})")
    return HermesParser(max_calls=0 if parallel else 1, stream_arguments=stream_arguments)
