"""Reasoning output (issue [21] item 4; actors/text/reasoning.py, docs/decisions/0044-reasoning-output.md): the
streaming think_tags parser under every split, where an output starts, the format read off a template or a
manifest, grammars that apply after ``</think>`` (llguidance's own matcher), the validator's request fields,
the gateway's chat and Responses shapes, and the forced tiny model checked against transformers' greedy output.
"""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from actors.text import reasoning as rs
from actors.text.reasoning import ThinkTagsParser, think_grammar
from bus.messages import ApiRequest, Chunk
from tests import reasoning_model as rm

QWEN3_GEN = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined "
             "and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
TEXTS = [  # (state, text, reasoning, answer)
    ("start", "<think>\nLet me see.\nYes.\n</think>\n\nThe answer <think>is</think> 4.", "Let me see.\nYes.",
     "The answer <think>is</think> 4."),
    ("start", "  \n<think>hm</think>ok  ", "hm", "ok  "),
    ("start", "Plain answer, <think> later is text.", "", "Plain answer, <think> later is text."),
    ("start", "<thinking>no tag</thinking>", "", "<thinking>no tag</thinking>"),
    ("start", "<think>\ncut short by max_tokens  \n", "cut short by max_tokens", ""),
    ("start", "\n\n", "", "\n\n"),
    ("start", "<thi", "", "<thi"),
    ("reasoning", "\nwait</think>\n\n{\"a\": 1}", "wait", "{\"a\": 1}"),
    ("reasoning", "a < b, </thin k> is not the tag</think>x", "a < b, </thin k> is not the tag", "x"),
    ("answer", "ok</think>\n<think>x", "", "ok</think>\n<think>x"),
]


def parse(state: str, pieces: list[str]) -> tuple[str, str, int]:
    p = ThinkTagsParser(state)
    r = a = ""
    for k, piece in enumerate(pieces):
        dr, da = p.step(piece, 1, k == len(pieces) - 1)
        r, a = r + dr, a + da
    return r, a, p.tokens


@pytest.mark.parametrize("state,text,reasoning,answer", TEXTS)
def test_every_split_gives_the_same_reasoning_and_answer(state, text, reasoning, answer):
    for size in range(1, len(text) + 1):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert parse(state, pieces)[:2] == (reasoning, answer), size
    for cut in range(1, len(text)):  # two pieces, cut anywhere (a tag split at every character)
        assert parse(state, [text[:cut], text[cut:]])[:2] == (reasoning, answer), cut


def test_reasoning_tokens_count_up_to_the_closing_tag():
    text = "<think>\nab\n</think>\n\nok"
    assert parse("start", list(text))[2] == len("<think>\nab\n</think>")  # one token per character
    assert parse("start", [" ", " ", "ok"])[2] == 0  # undecided whitespace turned answer: none
    assert parse("start", [" ", "<think>", "x"])[2] == 3  # undecided whitespace turned thinking: counted
    assert parse("reasoning", ["w", "a", "</think>", "\n\n", "ok"])[2] == 3
    assert parse("answer", ["<think>", "x", "</think>"])[2] == 0


def test_prompt_state_format_and_vocabulary():
    assert rs.prompt_state("<|im_start|>assistant\n<think>\n") == "reasoning"
    assert rs.prompt_state("assistant\n<think>\n\n</think>\n\n") == "answer"
    assert rs.prompt_state("<|im_start|>assistant\n") == "start"
    assert rs.infer_format(QWEN3_GEN) == "think_tags" and rs.infer_format(rm.TEMPLATE) == "think_tags"
    from bench.tiny_model import CHAT_TEMPLATE
    assert rs.infer_format(CHAT_TEMPLATE) is None and rs.infer_format(None) is None
    assert rs.resolve_format(None, QWEN3_GEN) == "think_tags" and rs.resolve_format("none", QWEN3_GEN) is None
    assert rs.resolve_format("think_tags", None) == "think_tags"
    with pytest.raises(ValueError, match="reasoning_format 'harmony'"):
        rs.resolve_format("harmony", None)
    with pytest.raises(ValueError, match="</think> is a special token"):
        rs.check_vocabulary("think_tags", {"</think>": 7})
    rs.check_vocabulary("think_tags", {"<|im_end|>": 2})
    with pytest.raises(ValueError, match="reasoning state"):
        ThinkTagsParser("thinking")
    assert rs.make_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning format"):
        rs.make_parser("harmony")


# --------------------------------------------------------------------------- grammars
@pytest.fixture(scope="module")
def byte_tok():
    from actors.worker.engine.structured import build_tokenizer
    return build_tokenizer([bytes([b]) for b in range(256)] + [b""], {256: "<|end|>"}, (256,))


def accepts(tok, grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


SCHEMA_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}}}}


def test_a_json_schema_applies_after_the_thinking_only(byte_tok):
    from actors.validator.structured import structured_grammar

    g = structured_grammar(SCHEMA_BODY)
    ans, think = '{"answer": "yes"}', '<think>\nmaybe {"answer": 3}\n</think>\n\n'
    start, opened = think_grammar(g, "start"), think_grammar(g, "reasoning")
    assert llguidance.LLMatcher.validate_grammar(start) == "" and llguidance.LLMatcher.validate_grammar(opened) == ""
    assert accepts(byte_tok, start, think + ans) and accepts(byte_tok, start, ans)
    assert accepts(byte_tok, opened, think[len("<think>"):] + ans) and not accepts(byte_tok, opened, ans)
    assert not accepts(byte_tok, g, think + ans)  # negative control: the schema alone refuses the thinking
    for bad in (think + '{"answer": "maybe"}', think + "</think>" + ans, "<think>x" + ans, think + "prose"):
        assert not accepts(byte_tok, start, bad), bad
    assert think_grammar(g, "answer") == g and think_grammar(None, "start") is None
    with pytest.raises(ValueError, match="exactly one grammar"):
        think_grammar(json.dumps({"grammars": [{"lark_grammar": "start: \"a\""}] * 2}), "start")


def test_tool_and_regex_grammars_apply_after_the_thinking(byte_tok):
    from actors.text.tool_calls import CALL_CLOSE, CALL_OPEN
    from actors.validator.tools import tool_grammar, validate_tools
    from actors.validator.structured import structured_grammar

    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}}}
    req = validate_tools({"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False})
    call = f'{CALL_OPEN}\n{{"name": "pick", "arguments": {{"c": "red"}}}}\n{CALL_CLOSE}'
    g = think_grammar(tool_grammar(req), "start")
    assert accepts(byte_tok, g, "<think>call pick</think>\n" + call) and accepts(byte_tok, g, call)
    assert not accepts(byte_tok, g, "<think>x</think>\nno call")
    rg = think_grammar(structured_grammar({"structured_outputs": {"regex": "[0-9]+"}}), "reasoning")
    assert accepts(byte_tok, rg, "sum it</think>42") and not accepts(byte_tok, rg, "42")


# --------------------------------------------------------------------------- manifest, validator
def test_manifest_reasoning_format_is_checked_by_name():
    from control.state.manifest import ModelManifest

    base = {"name": "m", "version": "1", "artifact": "/x.gguf"}
    assert "reasoning_format" not in ModelManifest.from_dict(base).to_dict()
    assert ModelManifest.from_dict({**base, "reasoning_format": "think_tags"}).to_dict()["reasoning_format"] == \
        "think_tags"
    assert ModelManifest.from_dict({**base, "reasoning_format": "none"}).reasoning_format == "none"
    with pytest.raises(ValueError, match="reasoning_format must be .* got 'deepseek'"):
        ModelManifest.from_dict({**base, "reasoning_format": "deepseek"})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return rm.build(tmp_path_factory.mktemp("reasoner"))


def test_the_forced_model_follows_its_chain_in_transformers(model):
    """The fixture's premise, checked by transformers' own greedy decoding in both template modes."""
    from actors.text.chat_template import render_chat
    from actors.text.hf_tokenizer import HFTokenizer

    tok = HFTokenizer.from_dir(model["dir"])
    assert "<think>" not in tok.special_tokens and tok.decode([model["vocab"]["</think>"]]) == "</think>"
    cases = ((tok.chat_template, {}, "wait</think>\n\nok"), (tok.chat_template, {"enable_thinking": False}, "ok"),
             (rm.QWEN3_TEMPLATE, {}, "<think>wait</think>\n\nok"), (rm.QWEN3_TEMPLATE, {"enable_thinking": False}, "ok"))
    for template, kw, expected in cases:
        ids = tok.encode(render_chat(template, [{"role": "user", "content": "hi"}], template_kwargs=kw))
        out = model["model"].generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
        assert tok.decode(out.tolist()) == expected


def _prepare(model_dir: str, body: dict, manifest: dict | None = None, endpoint: str = "chat"):
    from actors.validator.service import ValidatorService, load_assets

    assets = load_assets({"artifact": model_dir, "format": "hf", **(manifest or {})})
    req = ApiRequest("r1", "t", "m", "m", "1", endpoint, {"model": "m", **body}, "_INBOX.x")
    return assets, ValidatorService(None, None)._prepare_sync(req, assets)[0]


def test_the_validator_sets_the_parser_the_state_and_the_wrapped_grammar(model):
    msgs = [{"role": "user", "content": "hi"}]
    assets, gen = _prepare(model["dir"], {"messages": msgs, **SCHEMA_BODY})
    assert assets.reasoning_format == "think_tags"  # inferred from chat_template.jinja
    assert (gen.reasoning_parser, gen.reasoning_state) == ("think_tags", "reasoning")
    assert "@reasoning_answer" in gen.sampling.grammar
    _, off = _prepare(model["dir"], {"messages": msgs, **SCHEMA_BODY, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.reasoning_state == "answer" and "@reasoning_answer" not in off.sampling.grammar
    assert len(off.prompt_token_ids) == len(gen.prompt_token_ids) + 3  # \n\n </think> \n\n instead of the preamble
    _, plain = _prepare(model["dir"], {"messages": msgs}, {"reasoning_format": "none"})
    assert plain.reasoning_parser is None and plain.sampling.grammar is None
    _, comp = _prepare(model["dir"], {"prompt": "hi", "max_tokens": 2}, endpoint="completions")
    assert comp.reasoning_parser is None


def _tags_made_special(src: str, dst) -> str:
    """A copy of the model directory ``src`` at ``dst`` whose added tokens (the <think> tags) are special."""
    import shutil

    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    for t in spec["added_tokens"]:
        t["special"] = True
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def test_a_template_tag_that_is_a_special_token_is_refused_at_load(model, tmp_path):
    from actors.validator.service import load_assets

    bad = _tags_made_special(model["dir"], tmp_path / "bad")
    with pytest.raises(ValueError, match="are special tokens"):
        load_assets({"artifact": str(bad), "format": "hf"})
    load_assets({"artifact": str(bad), "format": "hf", "reasoning_format": "none"})  # switched off: served as is


# --------------------------------------------------------------------------- gateway shapes
def _chunks() -> list[Chunk]:
    u = {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13,
         "completion_tokens_details": {"reasoning_tokens": 5}}
    return [Chunk("r", 0, "", (5,), reasoning="wa"), Chunk("r", 1, "", (6,), reasoning="it"),
            Chunk("r", 2, "o", (7,)), Chunk("r", 3, "k", (8,), True, "stop", u)]


def test_chat_shapes_carry_reasoning_content_and_reasoning_tokens():
    from gateway.merge import ChoiceMerger

    m = ChoiceMerger("chat", "r", "m@1", {"stream": True}, {}, 1)
    events = [e for c in _chunks() for e in m.add(c)]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "wait"
    assert "".join(d.get("content") or "" for d in deltas) == "ok"
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    body = m.body()
    msg = body["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("wait", "ok")
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    plain = ChoiceMerger("chat", "r", "m@1", {}, {}, 1)
    for c in (Chunk("r", 0, "ok", (1,), True, "stop", {"prompt_tokens": 1, "completion_tokens": 1}),):
        plain.add(c)
    assert "reasoning_content" not in plain.body()["choices"][0]["message"]
    assert "completion_tokens_details" not in plain.body()["usage"]


def test_responses_shapes_carry_a_reasoning_item():
    from gateway import responses_format as rf
    from gateway.merge import ChoiceMerger

    m = ChoiceMerger("chat", "r", "m@1", {"stream": True}, {}, 1)
    tr = rf.StreamTranslator()
    evs = [ev for c in _chunks() for e in m.add(c) for ev in tr.chunk(e)]
    evs += tr.finish({"status": "completed"})
    kinds = [e["type"] for e in evs]
    assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta") == "wait"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [i["type"] for i in tr.output] == ["reasoning", "message"]
    assert tr.output[0]["content"] == [{"type": "reasoning_text", "text": "wait"}]
    items, _ = rf.output_from_chat(m.body())
    assert [(i["type"], i["content"][0]["text"]) for i in items] == [("reasoning", "wait"), ("message", "ok")]
    assert rf.usage(m.body()["usage"])["output_tokens_details"] == {"reasoning_tokens": 5}
    resp = {"id": "resp_1", "status": "completed", "output": items}
    replayed = rf.replay_events(resp)
    once = lambda ks: [k for j, k in enumerate(ks) if j == 0 or k != ks[j - 1]]  # noqa: E731 (deltas joined)
    assert once([e["type"] for e in replayed[2:-1]]) == once(kinds[:-1])
    # a reasoning item handed back as input is kept and left out of the prompt
    back = rf.input_items([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "wait"}]},
                           {"role": "user", "content": "and?"}])
    assert back[0]["type"] == "reasoning" and rf.messages(back) == [{"role": "user", "content": "and?"}]
    with pytest.raises(Exception, match="input\\[0\\].content"):
        rf.input_items([{"type": "reasoning", "content": "wait"}])


def test_registration_infers_stores_and_refuses_the_format(model, tmp_path):
    from control.ops.cli import build_parser
    from control.ops.models_cli import RegistryCommandError, build_manifest

    def register(artifact: str, *extra: str) -> dict:
        argv = ["models", "register", "r", "1", "--artifact", artifact, *extra]
        return build_manifest(build_parser().parse_args(argv))

    assert register(model["dir"] + "/")["reasoning_format"] == "think_tags"  # from chat_template.jinja
    assert register(model["dir"] + "/", "--reasoning-format", "none")["reasoning_format"] == "none"
    from bench.tiny_model import CHAT_TEMPLATE
    tpl = tmp_path / "plain.jinja"
    tpl.write_text(CHAT_TEMPLATE)
    assert "reasoning_format" not in register(model["dir"] + "/", "--chat-template", f"@{tpl}")  # nothing implied
    with pytest.raises(RegistryCommandError, match="reasoning_format must be .*'harmony'"):
        register(model["dir"] + "/", "--reasoning-format", "harmony")
    bad = _tags_made_special(model["dir"], tmp_path / "bad")
    with pytest.raises(RegistryCommandError, match="<think> and </think> are special tokens"):
        register(str(bad) + "/")
