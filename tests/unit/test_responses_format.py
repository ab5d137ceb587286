"""gateway/responses_format.py: Responses request checks, translation to chat, output and stream events."""

from __future__ import annotations

import pytest

from gateway import responses_format as rf
from gateway.openai_format import ApiError


def parsed(**kw) -> dict:
    return rf.parse_request({"model": "m", "input": "hi", **kw})


@pytest.mark.parametrize("body,param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"model": "m", "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "max_output_tokens": True}, "max_output_tokens"),
    ({"model": "m", "input": "x", "temperature": 2.5}, "temperature"),
    ({"model": "m", "input": "x", "top_p": "1"}, "top_p"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
    ({"model": "m", "input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "x"}}, "tool_choice"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
    ({"model": "m", "input": "x", "metadata": {"a": 1}}, "metadata"),
    ({"model": "m", "input": "x", "background": True, "store": False}, "background"),
    ({"model": "m", "input": "x", "conversation": "c"}, "conversation"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"model": "m", "input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "input": "x", "top_logprobs": False}, "top_logprobs"),
    ({"model": "m", "input": "x", "max_tool_calls": 2}, "max_tool_calls"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(ApiError) as exc:
        rf.parse_request(body)
    assert exc.value.status == 400 and exc.value.param == param


def test_default_values_and_advisory_fields_are_accepted():
    req = parsed(reasoning={}, include=[], truncation="disabled", top_logprobs=0, max_tool_calls=None,
                 user="u", service_tier="auto", stream_options={"include_obfuscation": False})
    assert set(rf.chat_body(req, [])) == {"model", "messages", "stream"}  # none of them reaches the model run


def test_openapi_request_fields_are_exactly_the_field_classes():
    from gateway.openapi import openapi_document

    doc = openapi_document(["m"])
    schema = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == rf.TRANSLATED | rf.ADVISORY | set(rf.DEFAULT_ONLY)
    assert not (rf.TRANSLATED & rf.ADVISORY) and not (rf.TRANSLATED & set(rf.DEFAULT_ONLY))
    assert set(doc["paths"]) >= {"/v1/responses/{id}", "/v1/responses/{id}/input_items", "/v1/responses/{id}/cancel"}


def test_string_input_instructions_and_sampling_become_a_chat_body():
    req = parsed(instructions="Be brief.", max_output_tokens=7, temperature=0.2, top_p=0.9, stream=True,
                 metadata={"k": "v"}, priority="batch")
    assert req["store"] is True and req["background"] is False
    body = rf.chat_body(req, [])
    assert body == {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}],
                    "stream": True, "max_tokens": 7, "temperature": 0.2, "top_p": 0.9, "priority": "batch"}
    [item] = req["_items"]
    assert item["type"] == "message" and item["id"].startswith("msg_") and item["content"] == [
        {"type": "input_text", "text": "hi"}]


def test_tools_tool_choice_and_text_format_map_to_chat():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parsed(tools=[{"type": "function", "name": "f", "description": "d", "parameters": schema, "strict": True}],
                 tool_choice={"type": "function", "name": "f"},
                 text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    body = rf.chat_body(req, [])
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "description": "d", "parameters": schema,
                                                               "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                              "strict": True}}
    assert rf.chat_body(parsed(text={"format": {"type": "json_object"}}), [])["response_format"] == {
        "type": "json_object"}
    plain = rf.chat_body(parsed(text={"format": {"type": "text"}}, tool_choice="auto"), [])
    assert "response_format" not in plain and plain["tool_choice"] == "auto"


def test_function_call_items_and_outputs_become_tool_messages():
    items = rf.input_items([
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": "{\"c\":1}"},
        {"type": "function_call", "call_id": "call_2", "name": "get", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert rf.messages(items) == [
        {"role": "developer", "content": "rules"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"c\":1}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    lone = rf.messages(rf.input_items([{"type": "function_call", "call_id": "c", "name": "f", "arguments": ""}]))
    assert lone == [{"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]}]


def test_history_comes_before_the_input():
    history = rf.input_items("first") + [rf.message_item("answer")]
    msgs = rf.chat_body(parsed(input="second", instructions="sys"), history)["messages"]
    assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "answer"}, {"role": "user", "content": "second"}]


def test_validator_params_map_back():
    assert rf.response_param("max_tokens") == "max_output_tokens"
    assert rf.response_param("messages[2].content") == "input"
    assert rf.response_param("response_format.json_schema") == "text.format"
    assert rf.response_param("tools[1].function.parameters") == "tools[1].parameters"
    assert rf.response_param("temperature") == "temperature" and rf.response_param(None) is None


def test_output_and_status_of_a_chat_completion():
    chat = {"choices": [{"message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    items, finish = rf.output_from_chat(chat)
    assert [i["type"] for i in items] == ["message"] and items[0]["status"] == "incomplete"
    assert items[0]["content"][0] == {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}
    assert rf.status_of(finish) == ("incomplete", {"reason": "max_output_tokens"})
    assert rf.status_of("stop") == ("completed", None)
    assert rf.usage(chat["usage"])["total_tokens"] == 5 and rf.usage(chat["usage"])["input_tokens"] == 3
    calls = {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        "finish_reason": "tool_calls"}]}
    [fc], _ = rf.output_from_chat(calls)
    assert fc["type"] == "function_call" and fc["id"].startswith("fc_") and fc["call_id"] == "call_9"
    assert (fc["name"], fc["arguments"], fc["status"]) == ("f", "{}", "completed")


def _record(status="in_progress", **extra) -> dict:
    req = rf.public_request(parsed(max_output_tokens=5))
    return {"id": "resp_1", "created_at": 1, "status": status, "model": "m@1", "request": req, **extra}


def test_response_object_fields():
    obj = rf.response_object(_record("completed", output=[rf.message_item("x")], usage=rf.usage({})))
    assert obj["object"] == "response" and obj["id"] == "resp_1" and obj["status"] == "completed"
    assert obj["model"] == "m@1" and obj["max_output_tokens"] == 5 and obj["store"] is True
    assert obj["text"] == {"format": {"type": "text"}} and obj["tools"] == [] and obj["tool_choice"] == "auto"
    assert "input" not in obj and "_items" not in str(obj)


def test_lost_records_read_as_failed():
    rec = _record(deadline_at=100.0)
    assert rf.lost(rec, 120.0) is rec
    assert rf.lost(rec, 200.0)["status"] == "failed" and rf.lost(rec, 200.0)["error"]["code"] == "gateway_lost"
    done = _record("completed", deadline_at=100.0)
    assert rf.lost(done, 1e9) is done


def _chunk(content=None, tool_calls=None, role=False):
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_stream_translator_text_events():
    tr = rf.StreamTranslator()
    resp = rf.response_object(_record())
    evs = tr.start(resp) + tr.chunk(_chunk("", role=True)) + tr.chunk(_chunk("Hel")) + tr.chunk(_chunk("lo"))
    evs += tr.finish({**resp, "status": "completed"})
    assert [e["type"] for e in evs] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    added, done = evs[2], evs[8]
    assert added["item"]["content"] == [] and added["item"]["status"] == "in_progress"
    assert done["item"]["status"] == "completed" and done["item"]["content"][0]["text"] == "Hello"
    assert evs[6]["text"] == "Hello" and evs[4]["item_id"] == added["item"]["id"] == evs[6]["item_id"]
    assert evs[-1]["response"]["output"] == [done["item"]]
    tr2 = rf.StreamTranslator()
    tail = tr2.chunk(_chunk("x")) + tr2.finish({**resp, "status": "incomplete"})
    assert tail[-1]["type"] == "response.incomplete" and tail[-2]["item"]["status"] == "incomplete"


def test_stream_translator_tool_calls():
    tr = rf.StreamTranslator()
    evs = tr.chunk(_chunk("Let me check."))
    evs += tr.chunk(_chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": "get", "arguments": "{\"c\""}}]))
    evs += tr.chunk(_chunk(tool_calls=[{"index": 0, "function": {"arguments": ":1}"}}]))
    evs += tr.finish({**rf.response_object(_record()), "status": "completed"})
    kinds = [e["type"] for e in evs]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    fc = evs[-2]["item"]
    assert evs[-2]["output_index"] == 1 and fc["type"] == "function_call" and fc["call_id"] == "call_1"
    assert fc["name"] == "get" and fc["arguments"] == "{\"c\":1}" and evs[-3]["arguments"] == fc["arguments"]
    assert [i["type"] for i in evs[-1]["response"]["output"]] == ["message", "function_call"]


def test_failed_stream_ends_with_response_failed():
    tr = rf.StreamTranslator()
    evs = tr.chunk(_chunk("par")) + tr.finish({**rf.response_object(_record()), "status": "failed",
                                                "error": {"code": "worker_lost", "message": "m"}})
    assert evs[-1]["type"] == "response.failed" and evs[-1]["response"]["error"]["code"] == "worker_lost"


def test_replay_events_rebuild_the_live_stream_with_the_stored_ids():
    tr = rf.StreamTranslator()
    base = rf.response_object(_record())
    live = tr.start(base) + tr.chunk(_chunk("Hi")) + tr.chunk(_chunk(" there"))
    live += tr.chunk(_chunk(tool_calls=[{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]))
    live += tr.finish({**base, "status": "completed"})
    stored = live[-1]["response"]
    replay = rf.replay_events(stored)
    live = [e for i, e in enumerate(live) if i == 0 or e["type"] != "response.output_text.delta"
            or live[i - 1]["type"] != e["type"]]  # the replay sends a message's text as one delta
    assert [e["type"] for e in replay] == [e["type"] for e in live]
    assert [e.get("item_id") for e in replay] == [e.get("item_id") for e in live]
    assert [e.get("item", {}).get("id") for e in replay] == [e.get("item", {}).get("id") for e in live]
    assert replay[-1]["response"] is stored and [e["sequence_number"] for e in replay] == list(range(len(replay)))
    assert "".join(e["delta"] for e in replay if e["type"] == "response.output_text.delta") == "Hi there"
    empty = rf.replay_events({**base, "status": "completed", "output": [rf.message_item("")]})
    assert [e["type"] for e in empty][2:] == ["response.output_item.added", "response.content_part.added",
                                              "response.output_text.done", "response.content_part.done",
                                              "response.output_item.done", "response.completed"]


def _outcome(chunks, detail=None, disconnected=False):
    from gateway.merge import ChoiceMerger
    from gateway.pipeline import Outcome
    from bus.errors import ServeError

    merger = ChoiceMerger("chat", "r1", "m@1", {"model": "m"}, {}, 1)
    for ch in chunks:
        merger.add(ch)
    return Outcome(merger, ServeError.from_wire(detail) if detail is not None else None, disconnected)


def test_records_of_finished_runs():
    from bus.messages import Chunk
    from gateway import responses_api as ra

    req = parsed(max_output_tokens=2)
    rec = ra.record("resp_r1", "r1", "acme", req, [], 1000, "in_progress")
    assert rec["input_items"] == req["_items"] and rec["deadline_at"] > rec["created_at"]
    assert ra.response_key("acme", "resp_r1") == "r.acme.resp_r1"
    done = ra.finished(rec, _outcome([Chunk("r1", 0, text="Hi", model="m@2"),
                                      Chunk("r1", 1, final=True, finish_reason="length",
                                            usage={"prompt_tokens": 4, "completion_tokens": 2})]))
    assert (done["status"], done["incomplete_details"], done["model"]) == (
        "incomplete", {"reason": "max_output_tokens"}, "m@2")
    assert done["output"][0]["content"][0]["text"] == "Hi" and done["usage"]["total_tokens"] == 6
    lost = ra.finished(rec, _outcome([Chunk("r1", 0, text="H")], {"status": 503, "message": "gone",
                                                                   "code": "worker_lost"}))
    assert lost["status"] == "failed" and lost["error"] == {"code": "worker_lost", "message": "gone"}
    cancelled = ra.finished(rec, _outcome([], {"status": 499, "message": "cancelled", "code": "cancelled"}))
    assert cancelled["status"] == "cancelled"


def test_idempotent_request_ids():
    from gateway import responses_api as ra

    a = ra.idempotent_request_id("acme", "k1")
    assert a == ra.idempotent_request_id("acme", "k1") != ra.idempotent_request_id("other", "k1")
    assert len(a) == 32 and int(a, 16) >= 0
    for bad in ("", "x" * 256):
        with pytest.raises(ApiError) as exc:
            ra.idempotent_request_id("acme", bad)
        assert exc.value.param == "Idempotency-Key"


def test_usage_carries_the_cached_prompt_tokens():
    u = rf.usage({"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}})
    assert u["input_tokens"] == 40 and u["input_tokens_details"] == {"cached_tokens": 32} and u["total_tokens"] == 43
    assert rf.usage(None)["input_tokens_details"] == {"cached_tokens": 0}
