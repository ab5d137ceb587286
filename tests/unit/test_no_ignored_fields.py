"""No request field is accepted and silently ignored.

Every field of every request schema in /openapi.json (gateway/openapi.py) is in exactly one class of
actors/validator/validation.py: ACTED (changes the validated request, checked here field by field),
REFUSED (any value but the accepted ones is a 400 naming it) or ADVISORY (accepted, documented in
docs/api.md with what it does here). The docs tables must equal the code tables.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from actors.validator.errors import RequestError
from actors.validator.validation import ACTED, ADVISORY, REFUSED, validate_request
from gateway.openapi import openapi_document

ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
BASE = {"chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        "completions": {"model": "m", "prompt": "hi"}}
_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _request_schemas() -> dict[str, dict]:
    """path -> request-body schema of every operation with one."""
    out = {}
    for path, ops in openapi_document(["m"])["paths"].items():
        for op in ops.values():
            body = op.get("requestBody")
            if body:
                out[path] = body["content"]["application/json"]["schema"]
    return out


def test_every_schema_field_is_classified_and_every_class_field_is_in_the_schema():
    # /v1/responses: its field classes live in gateway/responses_format.py (tests/unit/test_responses_format.py)
    schemas = {p: s for p, s in _request_schemas().items() if not p.startswith("/v1/responses")}
    assert set(ENDPOINTS) <= set(schemas)
    for path, schema in schemas.items():
        assert path in ENDPOINTS, f"{path} has a request body but no field classes in actors/validator/validation.py"
        ep = ENDPOINTS[path]
        assert schema.get("additionalProperties") is False, path  # other fields are refused (400)
        acted, refused, advisory = ACTED[ep], set(REFUSED[ep]), set(ADVISORY[ep])
        assert not (acted & refused or acted & advisory or refused & advisory), ep  # exactly one class each
        fields = set(schema["properties"])
        unclassified = fields - acted - refused - advisory
        assert not unclassified, f"{path}: fields in no class: {sorted(unclassified)}"
        undocumented = (acted | refused | advisory) - fields
        assert not undocumented, f"{path}: classified fields missing from /openapi.json: {sorted(undocumented)}"


def _docs_table(heading_words: str) -> dict[str, tuple[set[str], str]]:
    """Rows of the docs/api.md table after the paragraph starting with ``heading_words``: field -> (endpoints, 3rd)."""
    text = (ROOT / "docs/api.md").read_text()
    start = text.index(heading_words)
    rows: dict[str, tuple[set[str], str]] = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("field", "---") or set(cells[0]) <= {"-"}:
            continue
        name = cells[0].strip("`")
        assert name not in rows, f"{name} twice in the docs table"
        rows[name] = ({e.strip() for e in cells[1].split(",")}, cells[2])
    return rows


def _by_field(table: dict[str, dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for ep, fields in table.items():
        for f in fields:
            out.setdefault(f, set()).add(ep)
    return out


def test_docs_advisory_table_equals_the_code_table():
    docs = _docs_table("Advisory fields are accepted")
    assert {f: eps for f, (eps, _) in docs.items()} == _by_field(ADVISORY)
    assert all(what for _, what in docs.values())  # each says what it does here


def test_docs_refused_table_equals_the_code_table():
    docs = _docs_table("Refused fields are accepted only")
    assert {f: eps for f, (eps, _) in docs.items()} == _by_field(REFUSED)
    for f, (eps, accepted) in docs.items():
        shown = [None if a == "null" else json.loads(a.strip("`")) for a in re.split(r",\s*(?![^`]*`\])", accepted)]
        for ep in eps:
            assert list(REFUSED[ep][f][0]) == shown, f


_PROBES = [True, False, 0, 2, 1.5, "x", "", ["x"], ["text", "audio"], [], {}, {"x": 1}]


@pytest.mark.parametrize("ep,field", [(ep, f) for ep in REFUSED for f in REFUSED[ep]])
def test_refused_fields_get_a_400_naming_them(ep, field):
    accepted = REFUSED[ep][field][0]
    for value in accepted:
        validate_request(ep, {**BASE[ep], field: value})  # the values that ask for nothing pass
    probes = [v for v in _PROBES if not any(type(v) is type(a) and v == a for a in accepted)]
    assert probes
    for value in probes:
        with pytest.raises(RequestError) as e:
            validate_request(ep, {**BASE[ep], field: value})
        assert e.value.status == 400 and e.value.param == field and field in e.value.message


@pytest.mark.parametrize("ep,field", [(ep, f) for ep in ADVISORY for f in ADVISORY[ep]])
def test_advisory_fields_are_type_checked_and_carried(ep, field):
    typ = ADVISORY[ep][field]
    good, wrong = ({"k": "v"}, "x") if typ is dict else ("x", 5)
    v = validate_request(ep, {**BASE[ep], field: good})
    assert v.extras[field] == good
    with pytest.raises(RequestError) as e:
        validate_request(ep, {**BASE[ep], field: wrong})
    assert e.value.status == 400 and e.value.param == field


def test_a_field_in_no_class_is_refused_naming_it():
    for ep in BASE:
        with pytest.raises(RequestError) as e:
            validate_request(ep, {**BASE[ep], "frobnicate": 1})
        assert e.value.param == "frobnicate"


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# field -> (extra base fields it needs, a value that must change the validated request)
_ACTS = {
    "model": ({}, "other"), "max_tokens": ({}, 3), "temperature": ({}, 0.5), "top_p": ({}, 0.5), "top_k": ({}, 3),
    "min_p": ({}, 0.2), "seed": ({}, 9), "stop": ({}, "###"), "stop_token_ids": ({}, [5]), "n": ({}, 2),
    "stream": ({}, True), "stream_options": ({"stream": True}, {"include_usage": True}),
    "priority": ({}, "batch"), "deadline_ms": ({}, 1000), "frequency_penalty": ({}, 1.0),
    "presence_penalty": ({}, 1.0), "repetition_penalty": ({}, 1.5), "ignore_eos": ({}, True),
    "logit_bias": ({}, {"1": 2}), "response_format": ({}, {"type": "json_object"}),
    "structured_outputs": ({}, {"regex": "a+"}), "guided_json": ({}, _SCHEMA), "guided_regex": ({}, "a+"),
    "guided_choice": ({}, ["a", "b"]), "guided_grammar": ({}, 'start: "a"'),
    "guided_whitespace_pattern": ({"guided_json": _SCHEMA}, " ?"),
    "messages": ({}, [{"role": "user", "content": "other"}]), "max_completion_tokens": ({}, 3),
    "top_logprobs": ({"logprobs": True}, 3), "prompt": ({}, "other"), "echo": ({}, True),
    "tools": ({}, _TOOLS), "tool_choice": ({"tools": _TOOLS}, "required"),
    "parallel_tool_calls": ({"tools": _TOOLS}, False),
    "chat_template_kwargs": ({}, {"enable_thinking": False}),
}
_LOGPROBS = {"chat": True, "completions": 2}


def _observable(v) -> dict:
    d = dataclasses.asdict(v)
    d.pop("extras"), d.pop("given")
    return d


@pytest.mark.parametrize("ep,field", [(ep, f) for ep in ACTED for f in sorted(ACTED[ep])])
def test_acted_fields_change_the_validated_request(ep, field):
    needs, value = _ACTS[field] if field != "logprobs" else ({}, _LOGPROBS[ep])
    before = validate_request(ep, {**BASE[ep], **needs})
    after = validate_request(ep, {**BASE[ep], **needs, field: value})
    assert _observable(before) != _observable(after), f"{field} changed nothing"
