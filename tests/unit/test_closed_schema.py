"""close_schema: objects admit only the properties they name, tuples only their prefix items (issue [18]).

Checked twice: on the schema text (what keywords are added where, and what is left alone) and on what the
compiled llguidance grammar accepts, through the validator as a request would reach it.
"""

from __future__ import annotations

import copy
import json

import llguidance
import pytest

from actors.validator.closed_schema import close_schema
from actors.validator.validation import validate_chat

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"]}


def test_objects_that_name_properties_are_closed_everywhere():
    schema = {"type": "object", "properties": {
        "city": CITY, "tags": {"type": "array", "items": CITY}, "pair": {"type": "array", "prefixItems": [CITY]},
        "any": {"type": "object"}, "either": {"anyOf": [CITY, {"type": "null"}]}, "ref": {"$ref": "#/$defs/c"}},
        "$defs": {"c": CITY}}
    before = copy.deepcopy(schema)
    out = close_schema(schema)
    assert schema == before  # the input is not modified
    assert out["additionalProperties"] is False
    p = out["properties"]
    assert p["city"]["additionalProperties"] is False and p["tags"]["items"]["additionalProperties"] is False
    assert p["pair"]["items"] is False and p["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert "additionalProperties" not in p["any"]  # names no property: any object
    assert p["either"]["anyOf"][0]["additionalProperties"] is False and p["either"]["anyOf"][1] == {"type": "null"}
    assert out["$defs"]["c"]["additionalProperties"] is False


def test_what_the_schema_says_is_kept():
    said = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    assert close_schema(said) == said
    assert close_schema({**CITY, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in close_schema({**CITY, "unevaluatedProperties": False})
    tup = {"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}
    assert close_schema(tup) == tup
    assert close_schema(True) is True and close_schema({"type": "string"}) == {"type": "string"}


def test_all_of_members_stay_open_at_their_level():
    schema = {"allOf": [CITY, {"type": "object", "properties": {"zip": {"type": "string"}, "geo": CITY}}]}
    out = close_schema(schema)
    assert "additionalProperties" not in out and all("additionalProperties" not in m for m in out["allOf"])
    assert out["allOf"][1]["properties"]["geo"]["additionalProperties"] is False  # below the level: closed


def _grammar_accepts(grammar: str, text: str) -> bool:
    """Whether the grammar accepts ``text``, on a byte-level tokenizer (one token per byte)."""
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    m = llguidance.LLMatcher(tok, grammar)
    ids = list(text.encode())
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


class _Bytes:
    """Token i is the byte i; 256 is the end of sequence (the shape llguidance.TokenizerWrapper wants)."""
    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b""]
    special_token_ids = [256]

    def __call__(self, s):
        return list(s.encode() if isinstance(s, str) else s)


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json"])
def test_a_response_schema_refuses_unnamed_properties(field):
    value = {"response_format": {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY}},
             "structured_outputs": {"json": CITY}, "guided_json": CITY}[field]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    g = validate_chat(body).grammar
    assert _grammar_accepts(g, json.dumps({"name": "Paris", "country": "France"}))
    assert not _grammar_accepts(g, json.dumps({"name": "Paris", "country": "France", "description": "x"}))
    arr = {"type": "array", "prefixItems": [{"type": "string"}]}
    g2 = validate_chat({**body, field: {"response_format": {"type": "json_schema", "json_schema": {
        "name": "T", "schema": arr}}, "structured_outputs": {"json": arr}, "guided_json": arr}[field]}).grammar
    assert _grammar_accepts(g2, '["a"]') and not _grammar_accepts(g2, '["a", "b"]')


def test_disable_additional_properties_false_asks_for_the_letter_of_json_schema():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "structured_outputs": {"json": CITY, "disable_additional_properties": False}}
    g = validate_chat(body).grammar
    assert _grammar_accepts(g, json.dumps({"name": "Paris", "country": "France", "description": "x"}))
    body["structured_outputs"]["disable_additional_properties"] = True  # vLLM's option: our default
    assert not _grammar_accepts(validate_chat(body).grammar,
                                json.dumps({"name": "Paris", "country": "France", "description": "x"}))
