"""Tool calling end to end (docs/tools.md) through the official ``openai`` client against the session stack.

The default model (SmolLM2, manifest ``tool_call_format: "hermes"``) is made to call ``get_weather`` by
``tool_choice`` (named, then ``required``): the engine's grammar forces the call, the worker parses it into
``tool_calls``, the gateway renders them (non-streamed ``message.tool_calls``, streamed ``delta.tool_calls``).
The client then sends the call and the tool's result back; the prompt of that second request holds both
(its ``usage.prompt_tokens`` equals the token count of the prompt rendered here, and
tests/unit/test_tool_calls.py shows that prompt's text) and the model answers.
"""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import openai
import pytest

from tests.e2e.test_openai_api import MODEL, client
from tests.unit.test_tool_calls import QUESTION, TIME, WEATHER, follow_up

NAMED = {"type": "function", "function": {"name": "get_weather"}}
KW = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], temperature=0, seed=5, max_tokens=80)


def joined_stream_calls(stream) -> tuple[list[dict], str | None, str]:
    """(tool_calls joined from delta.tool_calls, the finish_reason, the joined content) of a stream."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.index not in calls:  # the first delta of a call: id, type, name, arguments ""
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                    calls[d.index]["arguments"] += d.function.arguments or ""
                    calls[d.index]["pieces"] = calls[d.index].get("pieces", 0) + 1
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def as_dicts(message) -> list[dict]:
    return [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments} for t in message.tool_calls]


def test_tool_call_round_trip(stack):
    c = client(stack)
    first = c.chat.completions.create(**KW, tool_choice=NAMED, parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == 29 and call.id[5:].isalnum()
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    streamed, finish, content = joined_stream_calls(
        c.chat.completions.create(**KW, tool_choice=NAMED, parallel_tool_calls=False, stream=True))
    assert finish == "tool_calls" and content == ""
    assert streamed[0].pop("pieces") > 1  # a forced call's arguments stream as they are generated
    strip = [{k: v for k, v in t.items() if k != "id"} for t in as_dicts(choice.message)]
    assert [{k: v for k, v in t.items() if k != "id"} for t in streamed] == strip  # same calls, fresh ids

    required = c.chat.completions.create(**KW, tool_choice="required", parallel_tool_calls=False)
    rcall = required.choices[0].message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[rcall.function.name]
    jsonschema.validate(json.loads(rcall.function.arguments), schema)

    # the client runs the tool and sends the result back; the model answers from it
    messages = follow_up(call.id, call.function.arguments)
    second = c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=24)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens == _rendered_prompt_tokens(messages)  # the call and the result are in it
    s2, _, content2 = joined_stream_calls(c.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=24, stream=True))
    assert content2 == (second.choices[0].message.content or "")
    expected = as_dicts(second.choices[0].message) if second.choices[0].message.tool_calls else []
    for t in s2:
        t.pop("pieces", None)
    assert [(t["name"], t["arguments"]) for t in s2] == [(t["name"], t["arguments"]) for t in expected]


def _rendered_prompt_tokens(messages: list[dict]) -> int:
    from actors.text.tokenizer import GGUFTokenizer
    from actors.validator.prompts import render_prompt
    from actors.validator.validation import validate_chat
    from control.ops.deploy import default_model_file

    tok = GGUFTokenizer.from_gguf(default_model_file())
    v = validate_chat({"model": MODEL, "messages": messages, "tools": [WEATHER, TIME]})
    prompt = render_prompt(v, tok, None, "hermes")
    assert "<tool_call>" in prompt and "<tool_response>" in prompt
    return len(tok.encode(prompt))


def _bad(c: openai.OpenAI, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(**{**KW, **kw})
    return ei.value


def test_bad_tool_requests_are_400_naming_the_field(stack):
    c = client(stack)
    assert _bad(c, tools=[{"type": "function", "function": {"name": "has space"}}]).param == "tools"
    assert _bad(c, tools=[{"function": {"name": "f"}}]).param == "tools"
    err = _bad(c, tool_choice={"type": "function", "function": {"name": "unknown"}})
    assert err.param == "tool_choice" and "unknown" in err.message


def test_tools_on_a_model_without_a_format(stack):
    """A version registered without ``tool_call_format`` refuses tools (400 naming ``tools``) and still
    takes ``tool_choice: "none"`` past validation."""
    from control.state.registry import Registry

    async def edit(put: bool) -> None:
        async with Registry.connect(stack.etcd_url) as reg:
            if put:
                m = dict(await reg.get_model_version(MODEL, "1"))
                await reg.put_model_version(MODEL, "notools", {**m, "version": "notools", "tool_call_format": None})
            else:
                await reg.delete_model_version(MODEL, "notools")

    asyncio.run(edit(True))
    try:
        c, ref = client(stack), f"{MODEL}@notools"
        t_end = time.time() + 20
        while True:  # the gateway learns of the version through its registry watch
            try:
                err = _bad(c, model=ref)
                break
            except openai.NotFoundError:
                if time.time() > t_end:
                    raise
                time.sleep(0.2)
        assert err.param == "tools" and "tool_call_format" in err.message
    finally:
        asyncio.run(edit(False))


def test_a_named_choice_yields_one_call_with_the_default_parallel_tool_calls(stack):
    """Issue [18]: a named choice with parallel_tool_calls left at its default streamed the right call, then a
    second with invented arguments. OpenAI and vLLM return exactly one call for a named choice."""
    c = client(stack)
    kw = {**KW, "max_tokens": 120}
    full = c.chat.completions.create(**kw, tool_choice=NAMED)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    assert choice.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    streamed, finish, _ = joined_stream_calls(c.chat.completions.create(**kw, tool_choice=NAMED, stream=True))
    assert finish == "tool_calls" and [t["name"] for t in streamed] == ["get_weather"]
    assert streamed[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_langchain_structured_output_by_function_calling_gets_the_object(stack):
    """Issue [18]: LangChain's ``with_structured_output(..., method="function_calling")`` on a two-field model
    returned None: the model filled the call with properties the schema never named until max_tokens. The
    schema carries no ``additionalProperties``; the grammar admits only the named ones."""
    pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extras (make install-test)")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city."""

        name: str = Field(description="the city's name")
        country: str = Field(description="the country")

    llm = ChatOpenAI(model=MODEL, base_url=stack.http_url + "/v1", api_key=stack.dev_api_key, max_tokens=60,
                     temperature=0, timeout=120, max_retries=0)
    for prompt in ("What is the capital of France?", "Tell me about Paris."):
        # Without the closed schema the model added "description" and "type" on both prompts (measured
        # 2026-12-06, SmolLM2 Q4_1): pydantic dropped them, a longer run-on reached max_tokens and gave None.
        raw = llm.with_structured_output(City, method="function_calling", include_raw=True).invoke(prompt)
        assert raw["parsing_error"] is None and isinstance(raw["parsed"], City), raw
        assert raw["parsed"].name and raw["parsed"].country
        assert set(raw["raw"].tool_calls[0]["args"]) == {"name", "country"}, raw["raw"].tool_calls
