"""Structured outputs on the API side (actors/validator/structured.py) and the new sampling fields.

Every accepted form must become a grammar llguidance compiles and that accepts exactly the outputs the
form asks for: checked with a real ``llguidance.LLMatcher`` over a byte-level tokenizer (token i = byte i),
so acceptance is decided by the grammar alone. Every refusal is a RequestError 400 naming the field.
The 21 pydantic models of tests/structured_models.py go through the official openai client's own schema
conversion (``type_to_response_format_param``), exactly what ``client.chat.completions.parse`` sends.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest

from actors.validator.errors import RequestError
from actors.validator.prompts import prepare_prompt
from actors.validator.sampling import sampling_params
from actors.validator.structured import DEFAULT_WHITESPACE_PATTERN
from actors.validator.validation import validate_chat, validate_completion, validate_request
from tests.structured_models import CASES, example_json, response_format


class _Bytes:
    """A byte-level tokenizer for llguidance: token i < 256 is byte i, 256 is EOS."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


_TOK = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts exactly ``text`` as a complete output."""
    m = llguidance.LLMatcher(_TOK, grammar, log_level=0)
    m.consume_tokens(list(text.encode()))
    return not m.is_error() and m.is_accepting()


def chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def comp(**kw):
    return {"model": "m", "prompt": "hi", **kw}


def grammar_of(body, kind="chat") -> str | None:
    g = validate_request(kind, body).grammar
    if g is not None:
        assert llguidance.LLMatcher.validate_grammar(g) == ""
    return g


def refused(body, kind="chat") -> RequestError:
    with pytest.raises(RequestError) as e:
        validate_request(kind, body)
    assert e.value.status == 400
    return e.value


# ----------------------------------------------------------------------------- accepted forms
def test_no_format_and_text_format_are_unconstrained():
    assert grammar_of(chat()) is None
    assert grammar_of(chat(response_format={"type": "text"})) is None
    assert grammar_of(chat(response_format=None, structured_outputs=None, guided_json=None)) is None
    assert grammar_of(chat(structured_outputs={"json": None, "json_object": False})) is None


@pytest.mark.parametrize("kind,make", [("chat", chat), ("completions", comp)])
def test_json_object(kind, make):
    for body in (make(response_format={"type": "json_object"}), make(structured_outputs={"json_object": True})):
        g = grammar_of(body, kind)
        assert json.loads(g)["grammars"][0]["json_schema"]["type"] == "object"
        assert accepts(g, '{"x": [1, {"y": null}]}') and accepts(g, "{}")
        assert not accepts(g, "[1]") and not accepts(g, '"s"') and not accepts(g, '{"x": 1')


@pytest.mark.parametrize("body", [
    chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    chat(structured_outputs={"json": SCHEMA}),
    chat(structured_outputs={"json": json.dumps(SCHEMA)}),
    chat(guided_json=SCHEMA),
    chat(guided_json=json.dumps(SCHEMA), guided_decoding_backend="xgrammar"),
    comp(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    comp(guided_json=SCHEMA),
])
def test_json_schema_forms(body):
    g = grammar_of(body, "chat" if "messages" in body else "completions")
    assert accepts(g, '{"a": 12}') and accepts(g, '{"a":1}')
    assert not accepts(g, '{"a": "x"}') and not accepts(g, '{"a": 1, "b": 2}') and not accepts(g, "{}")


@pytest.mark.parametrize("body", [chat(structured_outputs={"regex": r"[a-c]{2}\d"}), chat(guided_regex=r"[a-c]{2}\d"),
                                  comp(structured_outputs={"regex": r"[a-c]{2}\d"})])
def test_regex_forms(body):
    g = grammar_of(body, "chat" if "messages" in body else "completions")
    assert accepts(g, "ab1") and not accepts(g, "ab") and not accepts(g, "xab1") and not accepts(g, "ab12")


def test_regex_with_slash_and_newline_escape():
    g = grammar_of(chat(guided_regex=r"a/b\n"))
    assert accepts(g, "a/b\n") and not accepts(g, "a/b")


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_choice(field):
    choices = ["yes", 'say "no"', "é\\x", "two\nlines"]
    body = chat(**{field: choices if field == "guided_choice" else {"choice": choices}})
    g = grammar_of(body)
    assert all(accepts(g, c) for c in choices)
    assert not accepts(g, "ye") and not accepts(g, "yesno") and not accepts(g, "maybe")


@pytest.mark.parametrize("grammar", [
    'start: "a" b+\nb: "b" | "c"',  # Lark
    'root ::= "a" b+\nb ::= "b" | "c"',  # GBNF (llama.cpp), converted to Lark
])
@pytest.mark.parametrize("field", ["guided_grammar", "structured_outputs"])
def test_grammar(grammar, field):
    g = grammar_of(chat(**{field: grammar if field == "guided_grammar" else {"grammar": grammar}}))
    assert accepts(g, "abcb") and not accepts(g, "a") and not accepts(g, "abd")


# ----------------------------------------------------------------------------- whitespace
def _ws_grammar(**so):
    return grammar_of(chat(structured_outputs={"json": SCHEMA, **so}))


def test_whitespace_bounded_by_default():
    g = _ws_grammar()
    assert json.loads(g)["grammars"][0]["json_schema"]["x-guidance"]["whitespace_pattern"] == DEFAULT_WHITESPACE_PATTERN
    assert accepts(g, '{\n  "a": 1\n}') and accepts(g, '{"a":' + " " * 16 + "1}")
    assert not accepts(g, '{"a":' + " " * 17 + "1}")  # unbounded whitespace is what small models loop on
    assert not accepts(g, ' {"a": 1}') and not accepts(g, '{"a": 1}\n')


def test_disable_any_whitespace():
    g = _ws_grammar(disable_any_whitespace=True)
    assert accepts(g, '{"a":1}') and not accepts(g, '{"a": 1}') and not accepts(g, '{ "a":1}')
    assert _ws_grammar(disable_any_whitespace=False) == _ws_grammar()


@pytest.mark.parametrize("body", [chat(structured_outputs={"json": SCHEMA, "whitespace_pattern": " ?"}),
                                  chat(guided_json=SCHEMA, guided_whitespace_pattern=" ?")])
def test_whitespace_pattern(body):
    g = grammar_of(body)
    assert accepts(g, '{ "a": 1 }') and not accepts(g, '{"a":  1}') and not accepts(g, '{"a":\n1}')


def test_schema_own_x_guidance_is_respected():
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    g = grammar_of(chat(guided_json=schema))
    assert accepts(g, '{"a":1}') and not accepts(g, '{"a": 1}')


def test_lenient_when_not_strict():
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": False}}
    assert grammar_of(chat(response_format=rf))
    e = refused(chat(response_format={**rf, "json_schema": {**rf["json_schema"], "strict": True}}))
    assert e.param == "response_format" and "no-such-format" in e.message


# ----------------------------------------------------------------------------- refusals
_JS = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


@pytest.mark.parametrize("body,param,words", [
    (chat(response_format="json"), "response_format", "object"),
    (chat(response_format={}), "response_format", "type"),
    (chat(response_format={"type": "xml"}), "response_format", "type"),
    (chat(response_format={"type": "structural_tag"}), "response_format", "type"),
    (chat(response_format={"type": "json_object", "schema": {}}), "response_format", "schema"),
    (chat(response_format={"type": "text", "json_schema": {}}), "response_format", "json_schema"),
    (chat(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}), "response_format", "name"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a"}}), "response_format", "schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": []}}), "response_format",
     "schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "yes"}}),
     "response_format", "strict"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "x": 1}}),
     "response_format", "'x'"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}),
     "response_format", "strin"),  # llguidance's message is carried
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}),
     "response_format", "missing"),
    (comp(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"minimum": "x"}}}),
     "response_format", ""),
    (chat(structured_outputs="json"), "structured_outputs", "object"),
    (chat(structured_outputs={"jsonschema": SCHEMA}), "structured_outputs.jsonschema", "unknown"),
    (chat(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag", "unknown"),
    (chat(structured_outputs={"json": "{not json"}), "structured_outputs.json", "JSON"),
    (chat(structured_outputs={"json": 3}), "structured_outputs.json", "schema"),
    (chat(structured_outputs={"regex": "(a"}), "structured_outputs.regex", "regex"),
    (chat(structured_outputs={"regex": ""}), "structured_outputs.regex", "non-empty"),
    (chat(structured_outputs={"choice": []}), "structured_outputs.choice", "list"),
    (chat(structured_outputs={"choice": ["a", 1]}), "structured_outputs.choice", "list"),
    (chat(structured_outputs={"grammar": "start: foo"}), "structured_outputs.grammar", "foo"),
    (chat(structured_outputs={"grammar": 'root ::= ( "a" '}), "structured_outputs.grammar", "grammar"),
    (chat(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object", "true"),
    (chat(structured_outputs={"json": SCHEMA, "disable_additional_properties": "yes"}),
     "structured_outputs.disable_additional_properties", "boolean"),
    (chat(structured_outputs={"json": SCHEMA, "disable_fallback": "no"}), "structured_outputs.disable_fallback",
     "boolean"),
    (chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": 1}),
     "structured_outputs.disable_any_whitespace", "boolean"),
    (chat(structured_outputs={"json": SCHEMA, "whitespace_pattern": "("}), "structured_outputs.whitespace_pattern",
     "regex"),
    (chat(guided_json=SCHEMA, guided_whitespace_pattern="[a"), "guided_whitespace_pattern", "regex"),
    (chat(guided_json="[1"), "guided_json", "JSON"),
    (chat(guided_regex=5), "guided_regex", "string"),
    (chat(guided_regex="[z-a]"), "guided_regex", "regex"),
    (chat(guided_choice="a"), "guided_choice", "list"),
    (chat(guided_grammar="start: ("), "guided_grammar", ""),
    (chat(guided_decoding_backend=3), "guided_decoding_backend", "string"),
    (comp(guided_regex="(", max_tokens=3), "guided_regex", "regex"),
])
def test_refusals(body, param, words):
    e = refused(body, "chat" if "messages" in body else "completions")
    assert e.param == param, e.message
    assert words in e.message


@pytest.mark.parametrize("body,param", [
    (chat(response_format={"type": "json_object"}, guided_regex="a"), "guided_regex"),
    (chat(guided_regex="a", response_format={"type": "json_object"}), "response_format"),
    (chat(guided_json=SCHEMA, structured_outputs={"json": SCHEMA}), "structured_outputs"),
    (chat(structured_outputs={"json": SCHEMA, "regex": "a"}), "structured_outputs.regex"),
    (chat(structured_outputs={"choice": ["a"], "json_object": True}), "structured_outputs.json_object"),
    (chat(guided_choice=["a"], guided_grammar='start: "a"'), "guided_grammar"),
    (comp(response_format=_JS, guided_json=SCHEMA), "guided_json"),
])
def test_two_formats_refused_naming_the_second(body, param):
    e = refused(body, "chat" if "messages" in body else "completions")
    assert e.param == param and "only one" in e.message


def test_text_format_does_not_conflict():
    assert grammar_of(chat(response_format={"type": "text"}, guided_regex="a"))


@pytest.mark.parametrize("body,param", [
    (chat(structured_outputs={"regex": "a", "disable_any_whitespace": True}), "structured_outputs.disable_any_whitespace"),
    (chat(guided_regex="a", guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
    (chat(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),  # no format: it would be ignored
    (chat(structured_outputs={"whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
    (chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True, "whitespace_pattern": " "}),
     "structured_outputs.whitespace_pattern"),
    (chat(structured_outputs={"json": SCHEMA, "whitespace_pattern": " "}, guided_whitespace_pattern=" "),
     "guided_whitespace_pattern"),
    (chat(guided_json=SCHEMA, guided_whitespace_pattern=""), "guided_whitespace_pattern"),
])
def test_whitespace_options_refused_where_they_would_do_nothing(body, param):
    assert refused(body).param == param


@pytest.mark.parametrize("fmt", [{"response_format": {"type": "json_object"}}, {"guided_regex": "a+"},
                                 {"structured_outputs": {"choice": ["x"]}}, {"response_format": _JS}])
def test_ignore_eos_with_a_format_is_refused(fmt):
    for kind, make in (("chat", chat), ("completions", comp)):
        e = refused(make(ignore_eos=True, **fmt), kind)
        assert e.param == "ignore_eos"
        assert validate_request(kind, make(ignore_eos=False, **fmt)).grammar
    assert validate_chat(chat(ignore_eos=True, response_format={"type": "text"})).ignore_eos


@pytest.mark.parametrize("value", [None, True, 0, 1.5, "", "x", [], [1], {}, {"a": None}, {"type": None},
                                   {"json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
                                   {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": []}}},
                                   {"regex": "a{99999999}"}, {"grammar": "%import x"}, {"choice": [""]}])
@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json", "guided_regex",
                                   "guided_choice", "guided_grammar", "guided_whitespace_pattern"])
def test_odd_values_never_fail_other_than_400(field, value):
    """Whatever a client sends in these fields: a validated request or a 400 naming a field, never a crash."""
    try:
        v = validate_chat(chat(**{field: value}))
    except RequestError as e:
        assert e.status == 400 and e.param and e.param.split(".")[0] in (field, "ignore_eos")
    else:
        assert v.grammar is None or llguidance.LLMatcher.validate_grammar(v.grammar) == ""


# ----------------------------------------------------------------------------- openai-client pydantic schemas
@pytest.mark.parametrize("model,example,prompt", CASES, ids=[c[0].__name__ for c in CASES])
def test_openai_client_pydantic_schemas_accepted_and_compiled(model, example, prompt):
    assert len(CASES) >= 20
    rf = response_format(model)
    assert rf["type"] == "json_schema" and rf["json_schema"]["strict"] is True
    schema = rf["json_schema"]["schema"]
    compact, pretty = example_json(model, example), example_json(model, example, indent=2)
    jsonschema.validate(json.loads(compact), schema)  # the example really is an instance
    for kind, body in (("chat", chat(response_format=rf, messages=[{"role": "user", "content": prompt}])),
                       ("completions", comp(response_format=rf))):
        g = grammar_of(json.loads(json.dumps(body)), kind)  # as it arrives: JSON round trip
        assert accepts(g, compact) and accepts(g, pretty)
        assert not accepts(g, "{}") and not accepts(g, compact[:-1])


# ----------------------------------------------------------------------------- sampling fields
def test_new_sampling_fields_reach_sampling_params():
    v = validate_chat(chat(logit_bias={"7": -100, "3": 2.5}, min_p=0.05, repetition_penalty=1.3,
                           response_format={"type": "json_object"}))
    sp = sampling_params(v, 8)
    assert sp.logit_bias == ((3, 2.5), (7, -100.0)) and sp.min_p == 0.05 and sp.repetition_penalty == 1.3
    assert sp.grammar == v.grammar and json.loads(sp.grammar)["grammars"]
    plain = sampling_params(validate_completion(comp()), 8)
    assert (plain.logit_bias, plain.min_p, plain.repetition_penalty, plain.grammar) == ((), 0.0, 1.0, None)


def test_min_p_and_repetition_penalty_layering():
    defaults = {"min_p": 0.1, "repetition_penalty": 1.1}
    silent = sampling_params(validate_chat(chat()), 8, defaults=defaults)
    assert (silent.min_p, silent.repetition_penalty) == (0.1, 1.1)  # manifest fills what the request omits
    said = sampling_params(validate_chat(chat(min_p=0, repetition_penalty=1)), 8, defaults=defaults)
    assert (said.min_p, said.repetition_penalty) == (0.0, 1.0)  # the request wins, even with the "off" value
    server = sampling_params(validate_chat(chat(min_p=None)), 8)
    assert (server.min_p, server.repetition_penalty) == (0.0, 1.0)


@pytest.mark.parametrize("body,param", [
    (chat(min_p=-0.1), "min_p"), (chat(min_p=1.5), "min_p"), (chat(min_p="0.1"), "min_p"), (chat(min_p=True), "min_p"),
    (comp(repetition_penalty=0), "repetition_penalty"), (comp(repetition_penalty=10.5), "repetition_penalty"),
    (chat(repetition_penalty=-1), "repetition_penalty"),
    (chat(logit_bias=[[1, 2]]), "logit_bias"), (chat(logit_bias="x"), "logit_bias"),
    (chat(logit_bias={"-1": 1}), "logit_bias"), (chat(logit_bias={"a": 1}), "logit_bias"),
    (chat(logit_bias={"1": 100.5}), "logit_bias"), (comp(logit_bias={"1": -101}), "logit_bias"),
    (chat(logit_bias={"1": "5"}), "logit_bias"),
    (chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
])
def test_sampling_field_refusals(body, param):
    e = refused(body, "chat" if "messages" in body else "completions")
    assert e.param == param and param in e.message


def test_logit_bias_limits_accepted():
    v = validate_chat(chat(logit_bias={str(i): (-100 if i % 2 else 100) for i in range(300)}, min_p=1,
                           repetition_penalty=10))
    assert len(v.logit_bias) == 300 and v.min_p == 1.0 and v.repetition_penalty == 10.0


class _VocabTok:
    """The smallest tokenizer prepare_prompt needs: a 100-token vocabulary, one token per character."""

    bos_token = eos_token = chat_template = None
    eos_token_id, vocab_size, special_tokens = 0, 100, {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]


@pytest.mark.parametrize("bias,ok", [({"99": 1}, True), ({"0": -5, "50": 5}, True), ({"100": 1}, False),
                                     ({"5": 1, "123456": 1}, False)])
def test_logit_bias_ids_checked_against_the_vocabulary(bias, ok):
    v = validate_completion(comp(prompt=[1, 2, 3], logit_bias=bias))
    if ok:
        ids, _ = prepare_prompt(v, _VocabTok(), None, 64, 16, None)
        assert ids == [1, 2, 3]
    else:
        with pytest.raises(RequestError) as e:
            prepare_prompt(v, _VocabTok(), None, 64, 16, None)
        assert e.value.status == 400 and e.value.param == "logit_bias" and "vocabulary" in e.value.message
