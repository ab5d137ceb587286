"""OpenAI tool calling on the validator side: the request fields, the model's format, the grammar (pure).

:func:`validate_tools` checks ``tools``, ``tool_choice``, ``parallel_tool_calls`` (and refuses the
deprecated ``functions`` / ``function_call``) plus the ``tool_calls`` / ``tool`` messages of the history,
returning a :class:`ToolRequest`; every refusal is a 400 naming the field, with OpenAI's rules.
:func:`check_format` refuses tools on a model whose manifest names no ``tool_call_format``.
:func:`tool_grammar` builds the llguidance grammar that enforces ``tool_choice: "required"``, a named
function (exactly one call) or ``parallel_tool_calls: false`` (at most one call, also under ``auto``): Hermes calls (``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``)
whose arguments match the function's ``parameters`` JSON schema (llguidance's Lark ``%json`` embedding,
https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md). docs/tools.md describes the whole path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from actors.text.tool_calls import CALL_CLOSE, CALL_OPEN

from .closed_schema import close_schema
from .structured import DEFAULT_WHITESPACE_PATTERN
from .errors import RequestError
from .fields import bad

__all__ = ["ToolRequest", "validate_tools", "check_format", "tool_grammar", "MAX_TOOLS", "TOOL_FIELDS"]

MAX_TOOLS = 128  # OpenAI's limit on `tools`
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function name rule
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolRequest:
    """The tool fields of one chat request, checked.

    ``tools``: function definitions ``{"name", "description"?, "parameters"?, "strict"?}`` in request order.
    ``choice``: "none" | "auto" | "required" | "function" (then ``name`` is the forced function).
    ``parallel``: ``parallel_tool_calls`` (default True). ``active``: tools are offered and may be called.
    """

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools offered and ``tool_choice`` not "none": the prompt lists them and the output is parsed."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """A call is required (``required`` or a named function): the grammar enforces it."""
        return self.active and self.choice in ("required", "function")


def _function(i: int, tool: Any) -> dict[str, Any]:
    param = "tools"
    if not isinstance(tool, dict):
        raise bad(f"tools[{i}] must be an object", param)
    if tool.get("type") != "function":
        raise bad(f"tools[{i}].type must be 'function', got {tool.get('type')!r}", param)
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"tools[{i}].function must be an object", param)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", param)
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(f"tools[{i}].function.description must be a string", param)
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"tools[{i}].function.parameters must be a JSON schema object", param)
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad(f"tools[{i}].function.strict must be a boolean", param)
    return {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}


def _tools(body: dict) -> tuple[dict[str, Any], ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad("'tools' must be an array", "tools")
    if not tools:
        raise bad("'tools' must not be empty (leave it out instead)", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad(f"'tools' may hold at most {MAX_TOOLS} functions, got {len(tools)}", "tools")
    out = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f["name"] for f in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad(f"'tools' names the function {dup!r} more than once", "tools")
    return out


def _choice(body: dict, tools: tuple[dict, ...]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad(f"'tool_choice' must be one of {', '.join(CHOICES)} or a function, got {choice!r}",
                      "tool_choice")
        if choice == "required" and not tools:
            raise bad("'tool_choice' 'required' is only allowed when 'tools' are given", "tool_choice")
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or "
                  '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if fn["name"] not in {t["name"] for t in tools}:
        raise bad(f"'tool_choice' names the function {fn['name']!r}, which is not in 'tools'", "tool_choice")
    return "function", fn["name"]


def _check_history(messages: Any) -> None:
    """Assistant ``tool_calls`` and ``tool`` messages have OpenAI's shape (400 naming the message field)."""
    if not isinstance(messages, list):
        return  # the messages checks answer that
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"messages[{i}].tool_call_id is required on a 'tool' message (a string)",
                          f"messages[{i}].tool_call_id")
        calls = m.get("tool_calls")
        if calls is None:
            continue
        param = f"messages[{i}].tool_calls"
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise bad(f"{param} must be an array on an assistant message", param)
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments"), str) or not isinstance(c.get("id"), str):
                raise bad(f"{param}[{j}] must be {{'id': str, 'type': 'function', 'function': "
                          "{'name': str, 'arguments': str}}", param)


def validate_tools(body: dict, grammar: str | None = None) -> ToolRequest:
    """Check the tool fields of a chat body (see the module docstring). ``grammar``: the structured-output
    grammar the request asks for (response_format, guided_*), which a forced call cannot be combined with.
    Raises RequestError 400."""
    for old, new in (("functions", "tools"), ("function_call", "tool_choice")):
        if body.get(old) is not None:
            raise bad(f"'{old}' is deprecated and not supported by this server; use '{new}'", old)
    tools = _tools(body)
    choice, name = _choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    _check_history(body.get("messages"))
    req = ToolRequest(tools, choice, name, True if parallel is None else parallel)
    if req.forced and grammar is not None:
        raise bad("a 'tool_choice' that forces a call cannot be combined with a structured output "
                  "('response_format', 'structured_outputs', 'guided_*'): both constrain the output", "tool_choice")
    if req.active:
        for i, t in enumerate(tools):
            if "parameters" in t:
                _schema_grammar(i, json.dumps(close_schema(t["parameters"]), sort_keys=True))
    return req


def check_format(req: ToolRequest | None, tool_call_format: str | None, model: str) -> str | None:
    """The parser name to run on the output (``tool_call_format`` when tools are active, else None).
    RequestError 400 naming ``tools`` when tools are active and the model has no format."""
    if req is None or not req.active:
        return None
    if tool_call_format is None:
        raise bad(f"model {model} does not support tool calling (its manifest names no tool_call_format); "
                  "leave out 'tools' or set 'tool_choice' to 'none'", "tools")
    return tool_call_format


@lru_cache(maxsize=256)
def _schema_grammar(i: int, schema: str) -> None:
    """RequestError 400 naming ``tools`` if llguidance cannot compile ``schema`` (JSON text)."""
    import llguidance
    err = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
    if err:
        raise RequestError(400, f"tools[{i}].function.parameters is not a JSON schema this server supports: "
                                f"{err.strip()}", param="tools")


def _call_schema(tool: dict) -> dict:
    args = close_schema(tool.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark_call(tools: list[dict]) -> str:
    """Lark rules ``call`` (one whole Hermes call of one of ``tools``) and ``body`` (its JSON). Whitespace inside
    the JSON is bounded as for ``response_format`` (``DEFAULT_WHITESPACE_PATTERN``): left free, a small model
    filled a forced call with tabs and carriage returns until ``max_tokens`` (a tiny Qwen3, issue [20] e2e)."""
    schema = _call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(t) for t in tools]}
    schema = {**schema, "x-guidance": {"whitespace_pattern": DEFAULT_WHITESPACE_PATTERN}}
    return (f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")


# ``auto`` with ``parallel_tool_calls: false``: free text, or free text then exactly one call and the end. TEXT
# never contains the call tag; OPEN is the text before the call together with the tag, as one lexeme, ending at
# the tag's first occurrence (llguidance's lexemes are greedy, so text and tag cannot be two lexemes: the text
# would swallow the tag's prefix). ``&`` and ``~`` are llguidance's lexeme intersection and negation
# (https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md).
_ANY = "(.|\\n)*"


def _lark_at_most_one(tools: list[dict]) -> str:
    tag = re.escape(CALL_OPEN).replace("/", "\\/")
    return (f"start: TEXT | OPEN body {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"TEXT: /{_ANY}/ & ~/{_ANY}{tag}{_ANY}/\n"
            f"OPEN: /{_ANY}{tag}\\n/ & ~/{_ANY}{tag}{_ANY}{tag}{_ANY}/\n"
            + _lark_call(tools).split("\n", 1)[1])


def tool_grammar(req: ToolRequest | None, other: str | None = None) -> str | None:
    """llguidance grammar (its JSON TopLevelGrammar text) of the calls ``req`` allows, or None for no constraint.

    A named function: exactly one call of it, whatever ``parallel_tool_calls`` says (as OpenAI and vLLM answer a
    named choice). ``required``: one call of any offered function, and with ``parallel`` more may follow, one per
    line. ``auto`` with ``parallel_tool_calls: false``: text, or text and then at most one call (the call's
    arguments still complete and match the schema: the grammar ends the output after it, instead of a parser
    cutting it). ``auto`` with ``parallel`` true, or ``none``: None. ``other``: the request's own structured
    output grammar; ``auto`` leaves it in force (None here), a forced call cannot join it (validate_tools refuses
    that). Every ``parameters`` schema is closed first (actors/validator/closed_schema.py). Raises RequestError
    400 naming ``tools`` when llguidance refuses the grammar (a ``parameters`` schema it does not support).
    """
    if req is None or not req.active or (not req.forced and (req.parallel or other is not None)):
        return None
    tools = [t for t in req.tools if req.choice != "function" or t["name"] == req.name]
    if not req.forced:
        lark = _lark_at_most_one(tools)
    else:
        many = req.choice == "required" and req.parallel
        lark = ('start: call ("\\n" call)*\n' if many else "start: call\n") + _lark_call(tools)
    grammar = json.dumps({"grammars": [{"lark_grammar": lark}]})
    _check_grammar(grammar)
    return grammar


@lru_cache(maxsize=256)
def _check_grammar(grammar: str) -> None:
    import llguidance
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise RequestError(400, f"the functions' parameters cannot be enforced: {err.strip()}", param="tools")
