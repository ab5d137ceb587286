"""Gateway choice merging (gateway/merge.py): indexes, one finish per index, usage, include_usage."""

from __future__ import annotations

from bus.messages import Chunk
from gateway.merge import ChoiceMerger

LP = [{"token": "Hi", "bytes": [72, 105], "logprob": -0.5,
       "top_logprobs": [{"token": "Hi", "bytes": [72, 105], "logprob": -0.5}]}]


def chunks():
    u = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    return [Chunk("r-1", 0, "Hi", (1,), logprobs=LP, choice_index=1),
            Chunk("r-0", 0, "Yo", (2,), logprobs=LP, choice_index=0),
            Chunk("r-0", 1, "!", (3,), True, "stop", u, {"decode_ms": 1.0}, logprobs=LP, choice_index=0),
            Chunk("r-1", 1, "", (4,), True, "length", u, {"decode_ms": 2.0}, logprobs=[], choice_index=1)]


def test_choice_index_is_the_chunk_field_not_parsed_from_the_id():
    m = ChoiceMerger("chat", "r", "m@1", {"n": 2}, {}, 2)
    assert m.index(Chunk("r-1", 0, choice_index=1)) == 1
    assert m.index(Chunk("r-1-x", 0, choice_index=0)) == 0  # an id of any shape
    assert m.index(Chunk.decode(b'{"request_id":"r-1","seq":0}')) == 0  # an older sender: the default


def test_chat_stream_and_body_with_n2():
    m = ChoiceMerger("chat", "r", "m@1", {"n": 2, "logprobs": True, "stream_options": {"include_usage": True}},
                     {}, 2)
    events = [e for c in chunks() for e in m.add(c)]
    assert m.done
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
    assert roles == [1, 0]
    finishes = [(e["choices"][0]["index"], e["choices"][0]["finish_reason"]) for e in events
                if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "stop"), (1, "length")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 7  # prompt counted once
    assert events[-1]["usage"]["completion_tokens"] == 4 and "actorserve_timing" in events[-1]["usage"]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}  # the prompt's, once
    assert all(e["usage"] is None for e in events[:-1])
    body = m.body()
    assert [c["message"]["content"] for c in body["choices"]] == ["Yo!", "Hi"]
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"


def test_completions_logprobs_shape_and_no_usage_without_flag():
    m = ChoiceMerger("completions", "r", "m@1", {"prompt": ["a", "b"], "logprobs": 1}, {}, 2)
    events = [e for c in chunks() for e in m.add(c)]
    assert all("usage" not in e for e in events) and "actorserve_timing" in events[-1]
    lp = m.body()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hi", "Hi"] and lp["text_offset"] == [0, 2] and lp["top_logprobs"][0] == {"Hi": -0.5}
    assert m.body()["usage"]["prompt_tokens"] == 14  # two prompts
    assert m.body()["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}  # each prompt's hits
