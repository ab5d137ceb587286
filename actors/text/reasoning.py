"""Reasoning output: a model's thinking split from its answer (pure: no I/O, no torch, no nats).

One format today, ``"think_tags"``: the model writes its thinking between ``<think>`` and ``</think>``
before the answer (Qwen3, QwQ, DeepSeek-R1 and its distills; what vLLM's ``qwen3`` / ``deepseek_r1``
reasoning parsers read). Where the thinking starts depends on the rendered prompt (:func:`prompt_state`):

* ``"start"``: the prompt leaves the choice to the model (Qwen3's hybrid template): an output that opens
  with ``<think>`` (after optional whitespace) reasons until ``</think>``; any other output is all answer;
* ``"reasoning"``: the prompt's generation preamble already opened ``<think>`` (DeepSeek-R1,
  Qwen3-Thinking-2507): the output is thinking until ``</think>``, with no opening tag of its own;
* ``"answer"``: the prompt closed the block itself (Qwen3 with ``enable_thinking=false`` renders
  ``<think>\\n\\n</think>\\n\\n``): the output is all answer and tags in it are text.

:class:`ThinkTagsParser` is the streaming parser the worker runs on the generated text before the
tool-call parser (actors/text/tool_calls.py): :meth:`~ThinkTagsParser.feed` takes a text delta (a tag may be
split across deltas at any character) and returns ``(reasoning, answer)`` text; :meth:`~ThinkTagsParser.finish`
flushes. Whitespace right after ``<think>``, right before ``</think>`` and right after ``</think>`` is dropped
(Qwen3's template strips the newlines there when it renders a reasoning turn back). The joined
stream equals the whole text parsed at once, whatever the split. A thinking block cut short by
``max_tokens`` stays reasoning (its answer is empty).

:func:`think_grammar` wraps a structured-output or tool-call grammar (llguidance TopLevelGrammar JSON) so that
it applies after ``</think>`` only: free thinking text first where the prompt state allows it, then the
constrained answer. :func:`infer_format` reads the format off a chat template. Decision:
docs/decisions/0044-reasoning-output.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from bus.messages import REASONING_FORMATS as FORMATS, REASONING_STATES as STATES

__all__ = ["FORMATS", "STATES", "THINK_OPEN", "THINK_CLOSE", "ThinkTagsParser", "make_parser", "infer_format",
           "prompt_state", "think_grammar", "check_vocabulary", "resolve_format"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
NONE = "none"  # a manifest's explicit "this model does not reason" (inference off)
_WS = " \t\r\n"


def infer_format(template: str | None) -> str | None:
    """The reasoning format a chat template implies: ``"think_tags"`` when it writes both ``<think>`` and
    ``</think>`` (Qwen3, QwQ and DeepSeek-R1 templates do, to render or strip past thinking and to open or
    close the block in the generation prompt), else None."""
    if isinstance(template, str) and THINK_OPEN in template and THINK_CLOSE in template:
        return "think_tags"
    return None


def resolve_format(manifest_value: str | None, template: str | None) -> str | None:
    """The reasoning format a model version runs: the manifest's ``reasoning_format`` (``"none"``: no
    parsing), or inferred from ``template`` (:func:`infer_format`) when the manifest names none. ValueError
    naming ``reasoning_format`` for an unknown format."""
    if manifest_value is None:
        return infer_format(template)
    if manifest_value == NONE:
        return None
    if manifest_value not in FORMATS:
        raise ValueError(f"reasoning_format {manifest_value!r} is not supported (supported: "
                         f"{', '.join(FORMATS)}, or {NONE!r})")
    return manifest_value


def check_vocabulary(fmt: str | None, special_tokens: dict[str, int]) -> None:
    """ValueError when format ``fmt``'s tags are control (special) tokens of the vocabulary: the detokenizer
    drops those from the text, so the parser would never see the thinking end and the answer would be
    served as reasoning in silence. (Qwen3's and DeepSeek-R1's ``<think>`` are added, non-special tokens.)"""
    if fmt is None:
        return
    hidden = [t for t in (THINK_OPEN, THINK_CLOSE) if t in special_tokens]
    if hidden:
        what = "is a special token" if len(hidden) == 1 else "are special tokens"
        raise ValueError(f"reasoning_format {fmt}: {' and '.join(hidden)} {what} of this vocabulary (decoded to no "
                         "text), so the thinking cannot be told from the answer")


def prompt_state(prompt_tail: str) -> str:
    """Where the output starts (``STATES``), from the end of the rendered prompt text: ``"reasoning"`` when it
    ends (trailing whitespace aside) with ``<think>``, ``"answer"`` when it ends with ``</think>``, else
    ``"start"`` (see the module docstring)."""
    tail = prompt_tail.rstrip(_WS)
    if tail.endswith(THINK_OPEN):
        return "reasoning"
    if tail.endswith(THINK_CLOSE):
        return "answer"
    return "start"


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (may still become it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ThinkTagsParser:
    """Streaming parser of ``think_tags`` output (module docstring). ``state``: where the output starts
    (``STATES``); it moves ``start`` -> ``reasoning`` -> ``answer`` (or ``start`` -> ``answer``).

    ``tokens``: completion tokens counted as reasoning so far (:meth:`step`): every token up to and including
    the one whose text closed the block (the tags' tokens count as reasoning, as thinking tokens do at OpenAI).
    """

    state: str = "start"
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"reasoning state must be one of {', '.join(STATES)}, got {self.state!r}")
        self._buf = ""  # text held back: leading whitespace / a partial tag / whitespace before a partial tag
        self._lead = self.state == "reasoning"  # drop the whitespace that opens the thinking
        self._after = False  # drop the whitespace right after </think>
        self._undecided = 0  # tokens seen while the state was still "start" (decided later)
        self._opened = False  # the last feed opened the block

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next text delta; return ``(reasoning, answer)`` text that can be emitted now."""
        self._buf += text
        reasoning = answer = ""
        if self.state == "start":
            head = self._buf.lstrip(_WS)
            if head.startswith(THINK_OPEN):
                self._buf, self.state, self._lead = head[len(THINK_OPEN):], "reasoning", True
                self._opened = True
            elif not head or THINK_OPEN.startswith(head):
                return "", ""  # whitespace or a partial tag so far: wait
            else:
                self.state = "answer"
        if self.state == "reasoning":
            if self._lead:
                self._buf = self._buf.lstrip(_WS)
                self._lead = not self._buf
            end = self._buf.find(THINK_CLOSE)
            if end < 0:
                keep = len(self._buf) - _held(self._buf, THINK_CLOSE)
                head = self._buf[:keep]
                out = head.rstrip(_WS)  # whitespace before a possible </think> waits
                self._buf = head[len(out):] + self._buf[keep:]
                return out, ""
            reasoning = self._buf[:end].rstrip(_WS)
            self._buf, self.state, self._after = self._buf[end + len(THINK_CLOSE):], "answer", True
        if self._after:
            self._buf = self._buf.lstrip(_WS)
            self._after = not self._buf
        answer, self._buf = self._buf, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """End of generation: text still held back. An unclosed thinking block stays reasoning (trailing
        whitespace dropped); an output that was only whitespace is answer."""
        buf, self._buf = self._buf, ""
        if self.state == "reasoning":
            return ("" if self._lead else buf.rstrip(_WS)), ""
        if self.state == "start":
            self.state = "answer"
            self._undecided = 0
            return "", buf
        return "", ("" if self._after else buf)

    def step(self, text: str, num_tokens: int = 0, finished: bool = False) -> tuple[str, str]:
        """One engine step: feed ``text`` (the text of ``num_tokens`` new tokens; flushed when ``finished``) and
        count its tokens; returns ``(reasoning, answer)``. A step's tokens count as reasoning when the block was
        open before them or they opened it (all of them, in the rare step of several tokens that also closes
        it); tokens of a still undecided ``start`` count once the output turns out to reason."""
        before = self.state
        reasoning, answer = self.feed(text)
        if self.state == "start":
            self._undecided += num_tokens
        elif before == "reasoning" or (before == "start" and self._opened):
            self.tokens += self._undecided + num_tokens
        self._opened = False
        if self.state != "start":
            self._undecided = 0
        if finished:
            r, a = self.finish()
            reasoning, answer = reasoning + r, answer + a
        return reasoning, answer


def make_parser(fmt: str | None, state: str = "start") -> ThinkTagsParser | None:
    """The streaming parser of reasoning format ``fmt`` starting in ``state`` (None -> None: no parsing).
    ValueError for an unknown format or state."""
    if fmt is None:
        return None
    if fmt not in FORMATS:
        raise ValueError(f"unknown reasoning format {fmt!r} (known: {', '.join(FORMATS)})")
    return ThinkTagsParser(state)


# --------------------------------------------------------------------------- grammar
_ANY = "(.|\\n)*"
_CLOSE_RE = re.escape(THINK_CLOSE).replace("/", "\\/")
_OPEN_RE = re.escape(THINK_OPEN)
# whitespace around the tags the grammar lets the model write (bounded: a small model left free writes
# whitespace until max_tokens; Qwen3 writes one or two newlines)
_LEAD, _TRAIL = "[\\x20\\x0A\\x0D\\x09]{0,4}", "[\\x20\\x0A\\x0D\\x09]{0,8}"
ANSWER = "reasoning_answer"  # the name the wrapped grammar gets in the TopLevelGrammar


def think_grammar(grammar: str | None, state: str) -> str | None:
    """``grammar`` (llguidance TopLevelGrammar JSON text of one grammar, as actors/validator/structured.py and
    tools.py build) applied after the thinking: in state ``"start"`` an optional ``<think>...</think>`` block
    first, in ``"reasoning"`` the rest of the open block and ``</think>`` first, then ``grammar`` (referenced as
    ``@reasoning_answer``, a nested grammar: its lexer and whitespace rules are its own). ``"answer"`` or no
    grammar: ``grammar`` unchanged. The thinking text is one lexeme that ends at the first ``</think>`` (TEXT
    and tag cannot be two lexemes: llguidance's lexemes are greedy; ``&`` / ``~`` are its lexeme
    intersection and negation, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md).
    ValueError for a grammar of several grammars (none is built here) or an unknown state."""
    if state not in STATES:
        raise ValueError(f"reasoning state must be one of {', '.join(STATES)}, got {state!r}")
    if grammar is None or state == "answer":
        return grammar
    top = json.loads(grammar)
    inner = top.get("grammars") or []
    if len(inner) != 1:
        raise ValueError(f"think_grammar wraps a grammar of exactly one grammar, got {len(inner)}")
    body = f"{_ANY}{_CLOSE_RE}{_TRAIL}"
    once = f"~/{_ANY}{_CLOSE_RE}{_ANY}{_CLOSE_RE}{_ANY}/"  # no second </think> inside the lexeme
    if state == "start":
        lark = f"start: THINK? @{ANSWER}\nTHINK: /{_LEAD}{_OPEN_RE}{body}/ & {once}\n"
    else:
        lark = f"start: THINK @{ANSWER}\nTHINK: /{body}/ & {once}\n"
    top["grammars"] = [{"lark_grammar": lark}, {**inner[0], "name": ANSWER}]
    return json.dumps(top)
