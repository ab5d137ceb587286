"""Structured outputs: a request's output-format fields -> one llguidance grammar (pure: no I/O, no nats).

:func:`structured_grammar` reads the structured-output fields of a chat or completions body and returns
the llguidance "TopLevelGrammar" JSON text the engine constrains decoding with (``SamplingParams.grammar``),
or None for unconstrained output. Accepted spellings, one per request:

* OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
  ``strict: false`` compiles the schema leniently (keywords llguidance does not implement are ignored),
  otherwise such a keyword is a 400;
* vLLM's ``structured_outputs`` object: one of ``json`` (schema object or its JSON text), ``regex``,
  ``choice`` (list of strings), ``grammar`` (Lark, or GBNF / EBNF as llama.cpp writes it), ``json_object``
  (true), plus ``disable_any_whitespace`` / ``whitespace_pattern`` (JSON formats) and ``disable_fallback``
  (no effect: llguidance is the only backend, there is nothing to fall back to);
* vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` with
  ``guided_whitespace_pattern``; ``guided_decoding_backend`` is advisory (llguidance is always used).

Free whitespace inside JSON is bounded by default (``DEFAULT_WHITESPACE_PATTERN``: a small model left free
emits whitespace without end until max_tokens) and forbidden with ``disable_any_whitespace``; the client's
``whitespace_pattern`` (or a schema's own ``x-guidance`` options) replaces the bound. Every grammar is
compiled by ``llguidance.LLMatcher.validate_grammar`` (no tokenizer needed) before it is accepted.
Errors are :class:`~actors.validator.errors.RequestError` 400 naming the field (llguidance's message
included); never a 5xx. Semantics follow vLLM's OpenAI server (``StructuredOutputsParams``) and OpenAI's
structured-outputs reference.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from .closed_schema import close_schema
from .errors import RequestError

# Top-level fields that each select an output format (at most one per request).
FORMAT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")
# Top-level fields that only modify a format.
MODIFIER_FIELDS = ("guided_whitespace_pattern", "guided_decoding_backend")
# The keys of vLLM's structured_outputs object: formats, then options.
_SO_FORMATS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace", "whitespace_pattern", "disable_fallback", "disable_additional_properties")
_RF_TYPES = ("text", "json_object", "json_schema")
# Whitespace allowed between JSON tokens unless the client says otherwise: room for pretty-printing a few
# levels deep, but bounded (llguidance's default, [\x20\x0A\x0D\x09]+, is unbounded).
DEFAULT_WHITESPACE_PATTERN = r"[\x20\x0A\x0D\x09]{0,16}"
MAX_CHOICES = 1024  # entries of a `choice` list


def structured_grammar(body: dict) -> str | None:
    """The llguidance grammar text the body's structured-output fields ask for; None = unconstrained.

    Raises RequestError 400: ``param`` = the second format field when more than one is given, the field
    whose value is malformed or whose schema / grammar / regex llguidance refuses, ``ignore_eos`` when it
    is true together with a format (the output must end where the format ends).
    """
    spec = _spec(body)
    ws = _whitespace(body, spec)
    if spec is None:
        return None
    kind, value, param, lenient = spec
    if kind == "json":
        grammar = _json_grammar(value if _letter_of_schema(body) else close_schema(value), ws, lenient, param)
    elif kind == "json_object":
        grammar = _json_grammar({"type": "object"}, ws, lenient, param)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        grammar = _lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:
        grammar = _lark(_grammar_text(value, param))
    _validate(grammar, param)
    if body.get("ignore_eos") is True:
        raise bad(f"'ignore_eos' cannot be combined with a structured output format ('{param}'): the output "
                  "must end where the format ends", "ignore_eos")
    return grammar


def bad(message: str, param: str) -> RequestError:
    """The 400 RequestError of a refused structured-output field."""
    return RequestError(400, message, param=param)


def _lark(text: str) -> str:
    return json.dumps({"grammars": [{"lark_grammar": text}]})


def _spec(body: dict) -> tuple[str, Any, str, bool] | None:
    """``(kind, value, param, lenient)`` of the one format the body asks for, None for none."""
    found: list[tuple[str, Any, str, bool]] = []
    for key in body:
        if key not in FORMAT_FIELDS or body[key] is None:
            continue
        spec = _parse_field(key, body[key])
        if spec is None:
            continue
        if found:
            raise bad(f"only one structured output format may be given: '{found[0][2]}' and '{spec[2]}' both are",
                      key)
        found.append(spec)
    return found[0] if found else None


def _parse_field(key: str, value: Any) -> tuple[str, Any, str, bool] | None:
    if key == "response_format":
        return _response_format(value)
    if key == "structured_outputs":
        return _structured_outputs(value)
    kind = key.removeprefix("guided_")
    return kind, _format_value(kind, value, key), key, False


def _response_format(rf: Any) -> tuple[str, Any, str, bool] | None:
    param = "response_format"
    if not isinstance(rf, dict):
        raise bad("'response_format' must be an object with a 'type'", param)
    rtype = rf.get("type")
    if rtype not in _RF_TYPES:
        raise bad(f"'response_format.type' must be one of {', '.join(_RF_TYPES)}, got {rtype!r}", param)
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra or (rtype != "json_schema" and "json_schema" in rf):
        raise bad(f"unexpected key in 'response_format': {(extra or ['json_schema'])[0]!r}", param)
    if rtype == "text":
        return None
    if rtype == "json_object":
        return "json_object", None, param, False
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("'response_format.json_schema' must be an object with 'name' and 'schema'", param)
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad(f"unexpected key in 'response_format.json_schema': {unknown[0]!r}", param)
    name = js.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise bad("'response_format.json_schema.name' must be a string of 1 to 64 characters", param)
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad("'response_format.json_schema.strict' must be a boolean", param)
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise bad("'response_format.json_schema.description' must be a string", param)
    if not isinstance(js.get("schema"), dict):
        raise bad("'response_format.json_schema.schema' must be a JSON schema object", param)
    return "json", js["schema"], param, js.get("strict") is False


def _structured_outputs(so: Any) -> tuple[str, Any, str, bool] | None:
    if not isinstance(so, dict):
        raise bad("'structured_outputs' must be an object", "structured_outputs")
    found = None
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if key in _SO_OPTIONS:
            continue
        if key not in _SO_FORMATS:
            raise bad(f"unknown key in 'structured_outputs': {key!r} (formats: {', '.join(_SO_FORMATS)}; options: "
                      f"{', '.join(_SO_OPTIONS)})", param)
        if value is None or (key == "json_object" and value is False):
            continue
        if found is not None:
            raise bad(f"only one structured output format may be given: '{found[2]}' and '{param}' both are", param)
        found = (key, _format_value(key, value, param), param, False)
    for key in ("disable_fallback", "disable_additional_properties"):
        if so.get(key) is not None and not isinstance(so[key], bool):
            raise bad(f"'structured_outputs.{key}' must be a boolean", f"structured_outputs.{key}")
    return found


def _letter_of_schema(body: dict) -> bool:
    """True when the client asked for JSON Schema's letter (``structured_outputs.disable_additional_properties:
    false``): objects then admit unnamed properties unless the schema says otherwise. By default (and with
    ``true``) schemas are closed (actors/validator/closed_schema.py)."""
    so = body.get("structured_outputs")
    return isinstance(so, dict) and so.get("disable_additional_properties") is False


def _format_value(kind: str, value: Any, param: str) -> Any:
    """Check the value of one format (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad(f"'{param}' is not valid JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise bad(f"'{param}' must be a JSON schema object (or its JSON text)", param)
        return value
    if kind == "json_object":
        if value is not True:
            raise bad(f"'{param}' must be true", param)
        return None
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) for c in value)):
            raise bad(f"'{param}' must be a list of 1 to {MAX_CHOICES} strings", param)
        return value
    if not isinstance(value, str) or not value.strip():  # regex, grammar
        raise bad(f"'{param}' must be a non-empty string", param)
    return value


def _whitespace(body: dict, spec: tuple[str, Any, str, bool] | None) -> dict[str, Any]:
    """JSON compile options for whitespace (``defaults`` / ``overrides`` of grammar_from_json_schema)."""
    so = body.get("structured_outputs") if isinstance(body.get("structured_outputs"), dict) else {}
    given: list[tuple[str, Any]] = []
    for param, value in (("structured_outputs.whitespace_pattern", so.get("whitespace_pattern")),
                         ("guided_whitespace_pattern", body.get("guided_whitespace_pattern"))):
        if value is not None:
            if not isinstance(value, str) or not value:
                raise bad(f"'{param}' must be a non-empty string (a regular expression)", param)
            _validate(llguidance.LLMatcher.grammar_from_regex(value), param)
            given.append((param, value))
    disable = so.get("disable_any_whitespace")
    if disable is not None and not isinstance(disable, bool):
        raise bad("'structured_outputs.disable_any_whitespace' must be a boolean",
                  "structured_outputs.disable_any_whitespace")
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise bad("'guided_decoding_backend' must be a string", "guided_decoding_backend")
    if disable:
        given.insert(0, ("structured_outputs.disable_any_whitespace", True))
    if len(given) > 1:
        raise bad(f"'{given[0][0]}' and '{given[1][0]}' contradict each other: give one", given[1][0])
    if given and (spec is None or spec[0] not in ("json", "json_object")):
        raise bad(f"'{given[0][0]}' applies to JSON formats only (json, json_object, json_schema)", given[0][0])
    if disable:
        return {"overrides": {"whitespace_flexible": False, "whitespace_pattern": None}}
    if given:
        return {"overrides": {"whitespace_pattern": given[0][1]}}
    return {"defaults": {"whitespace_pattern": DEFAULT_WHITESPACE_PATTERN}}


def _json_grammar(schema: dict, ws: dict[str, Any], lenient: bool, param: str) -> str:
    defaults = dict(ws.get("defaults", {}))
    own = schema.get("x-guidance")
    if isinstance(own, dict) and {"whitespace_pattern", "whitespace_flexible"} & set(own):
        defaults.pop("whitespace_pattern", None)  # the schema's own whitespace options replace the bound
    if lenient:
        defaults["lenient"] = True
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults or None,
                                                           overrides=ws.get("overrides"))
    except Exception as exc:  # noqa: BLE001 - any failure to compile a client's schema is the client's 400
        raise bad(f"invalid JSON schema in '{param}': {exc}", param) from None


def _grammar_text(text: str, param: str) -> str:
    """Lark text of a Lark or GBNF / EBNF grammar (llguidance's converter)."""
    try:
        return llguidance.grammar_from("grammar", text)
    except Exception as exc:  # noqa: BLE001 - a grammar the converter refuses is the client's 400
        raise bad(f"invalid grammar in '{param}': {exc}", param) from None


def _validate(grammar: str, param: str) -> None:
    """Compile ``grammar`` with llguidance; RequestError 400 naming ``param`` with its message if it fails."""
    try:
        err = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - never a 5xx for a client's grammar
        err = str(exc) or type(exc).__name__
    if err:
        raise RequestError(400, f"'{param}' cannot be compiled: {err.strip()}", param=param)
