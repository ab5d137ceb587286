"""The typed SamplingParams wire message (bus/messages.py), the choice index as a field, and the sampling
precedence request > manifest default > server default (actors/validator/sampling.py)."""

from __future__ import annotations

import orjson
import pytest

from actors.validator.sampling import COMPLETIONS_DEFAULT_MAX_TOKENS, default_max_tokens, layered, sampling_params
from actors.validator.validation import validate_chat, validate_completion
from bus.messages import (MANIFEST_DEFAULTABLE, Chunk, CompletionRecord, Dispatch, GenerateRequest, SamplingParams,
                          sampling_defaults)


def gen(sampling: SamplingParams, **kw) -> GenerateRequest:
    return GenerateRequest("r-1", "t", "m", "1", "_INBOX.t.r", (1, 2), sampling, **kw)


def chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


# ----------------------------------------------------------------------------- the wire message
def test_round_trip_through_generate_request_and_dispatch():
    p = SamplingParams(temperature=0.5, top_p=0.9, top_k=40, seed=2**64 - 1, max_tokens=7, stop_token_ids=[2, 3],
                       stop=["END"], ignore_eos=True, logprobs=3, frequency_penalty=-1, presence_penalty=2)
    assert p.stop == ("END",) and p.stop_token_ids == (2, 3) and isinstance(p.frequency_penalty, float)
    assert SamplingParams.decode(p.encode()) == p
    r = gen(p, choice_index=5)
    again = Dispatch.decode(Dispatch(r, "s").encode()).request
    assert again.sampling == p and again.choice_index == 5 and isinstance(again.sampling, SamplingParams)


def test_decode_tolerates_older_and_newer_senders():
    data = orjson.loads(gen(SamplingParams(max_tokens=4)).encode())
    del data["choice_index"]  # an older validator: no index
    data["sampling"]["top_a"] = 0.1  # a newer one: a field this worker does not know
    r = GenerateRequest.decode(orjson.dumps(data))
    assert r.choice_index == 0 and r.sampling == SamplingParams(max_tokens=4)
    assert GenerateRequest.decode(orjson.dumps({**data, "sampling": {}})).sampling == SamplingParams()
    with pytest.raises(ValueError, match="sampling"):
        GenerateRequest.decode(orjson.dumps({**data, "sampling": None}))
    with pytest.raises(ValueError, match="temperature"):
        GenerateRequest.decode(orjson.dumps({**data, "sampling": {"temperature": -1}}))


def test_generate_request_sampling_is_typed():
    with pytest.raises(ValueError, match="GenerateRequest.sampling must be a SamplingParams"):
        gen({"max_tokens": 4})  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", True), ("temperature", float("nan")), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -1), ("top_k", 2.0), ("seed", 2**64), ("seed", "7"), ("max_tokens", 0), ("stop", [1]),
    ("stop", None), ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("ignore_eos", 1), ("logprobs", 21),
    ("frequency_penalty", 3), ("presence_penalty", -2.5)])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be "):
        SamplingParams(**{field: value})


def test_seeded_choices_wrap_into_64_bits():
    assert SamplingParams(seed=10).seeded(3).seed == 13
    assert SamplingParams(seed=2**64 - 1).seeded(2).seed == 2**64 + 1 - 2**64
    unseeded = SamplingParams()
    assert unseeded.seeded(4) is unseeded


def test_choice_index_rides_chunks_and_records_with_a_default():
    c = Chunk("r-2", 0, "x", choice_index=2)
    assert Chunk.decode(c.encode()).choice_index == 2
    assert Chunk.decode(b'{"request_id":"r-2","seq":0}').choice_index == 0
    rec = CompletionRecord("r-2", "t", "m", "1", "ok", "stop", 3, 4, {}, choice_index=2)
    assert CompletionRecord.decode(rec.encode()).choice_index == 2


# ----------------------------------------------------------------------------- manifest defaults
def test_manifest_defaults_are_checked_and_normalized():
    assert sampling_defaults({"stop": "END", "temperature": 1, "seed": 3}) == {"stop": ("END",), "temperature": 1.0,
                                                                                "seed": 3}
    assert set(MANIFEST_DEFAULTABLE) >= {"temperature", "top_p", "top_k", "max_tokens", "stop", "seed"}
    assert {"min_p", "repetition_penalty"} <= set(MANIFEST_DEFAULTABLE)  # honoured by the engine now
    assert sampling_defaults({"min_p": 0.05, "repetition_penalty": 1}) == {"min_p": 0.05, "repetition_penalty": 1.0}
    with pytest.raises(ValueError, match="defaults.min_p must be a number"):
        sampling_defaults({"min_p": 1.5})
    with pytest.raises(ValueError, match="defaults.repetition_penalty must be a number"):
        sampling_defaults({"repetition_penalty": 0})
    with pytest.raises(ValueError, match="defaults.ignore_eos is not a known sampling parameter"):
        sampling_defaults({"ignore_eos": True})  # a wire field, but not one a manifest may default
    with pytest.raises(ValueError, match="defaults.max_tokens must be an integer"):
        sampling_defaults({"max_tokens": 0})
    with pytest.raises(ValueError, match="defaults must be an object"):
        sampling_defaults(["temperature"])  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- request > manifest > server
def test_layered_takes_each_level_in_turn():
    server = {"a": 1, "b": 2, "c": 3}
    assert layered({"a": 10}, {"a": 20, "b": 20}, server) == {"a": 10, "b": 20, "c": 3}
    assert layered({}, {}, server) == server
    assert layered({"a": None}, {"a": 20}, server)["a"] is None  # a value the request set wins, even None
    assert "z" not in layered({"z": 1}, {"y": 1}, server)  # only the server's keys


def test_default_max_tokens_manifest_over_server():
    assert default_max_tokens("completions", {}) == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert default_max_tokens("chat", {}) is None  # the room left in the context
    assert default_max_tokens("chat", {"max_tokens": 64}) == 64
    assert default_max_tokens("completions", {"max_tokens": 64}) == 64


def test_sampling_params_request_over_manifest_over_server():
    defaults = sampling_defaults({"temperature": 0.3, "top_k": 20, "stop": "END", "seed": 9})
    silent = sampling_params(validate_chat(chat()), 8, (2,), defaults)
    assert (silent.temperature, silent.top_k, silent.stop, silent.seed) == (0.3, 20, ("END",), 9)  # manifest
    assert (silent.top_p, silent.presence_penalty) == (1.0, 0.0)  # server
    assert silent.max_tokens == 8 and silent.stop_token_ids == (2,)
    loud = sampling_params(validate_chat(chat(temperature=1.5, top_k=-1, stop=[], seed=1)), 8, (2,), defaults)
    assert (loud.temperature, loud.top_k, loud.stop, loud.seed) == (1.5, 0, (), 1)  # the request, even "off"
    bare = sampling_params(validate_completion({"model": "m", "prompt": "x"}), 8)
    assert (bare.temperature, bare.top_k, bare.stop, bare.seed) == (1.0, 0, (), None)  # server, no manifest
