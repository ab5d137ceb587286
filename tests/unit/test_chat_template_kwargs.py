"""`chat_template_kwargs` (vLLM's request field) reaches the chat template; chat templates from HF directories.

The template below has the shape of Qwen3's (`enable_thinking is false` writes an empty think block after the
assistant header); rendering is compared with transformers' `apply_chat_template` on the same tokenizer.
"""

from __future__ import annotations

import json
import os

import pytest

from actors.text.chat_template import render_chat
from actors.text.hf_tokenizer import HFTokenizer
from actors.text.tokenizer import GGUFTokenizer
from actors.validator.errors import RequestError
from actors.validator.prompts import prepare_prompt, render_prompt
from actors.validator.validation import RESERVED_TEMPLATE_VARIABLES, validate_chat, validate_completion
from tests.tokenizer_fixtures import build

QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- if style is defined and style %}{{- '[' + style + ']' }}{%- endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
BODY = {"model": "m", "messages": MESSAGES}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build("qwen2", str(tmp_path_factory.mktemp("tpl")), chat_template=QWEN3_LIKE)


def _prompt_text(tok, body) -> str:
    return render_prompt(validate_chat(body), tok, None)


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_enable_thinking_false_reaches_the_template(qwen, source):
    tok = GGUFTokenizer.from_gguf(qwen.gguf_path) if source == "gguf" else HFTokenizer.from_dir(qwen.hf_dir)
    assert tok.chat_template == QWEN3_LIKE
    plain = _prompt_text(tok, BODY)
    off = _prompt_text(tok, {**BODY, "chat_template_kwargs": {"enable_thinking": False}})
    on = _prompt_text(tok, {**BODY, "chat_template_kwargs": {"enable_thinking": True}})
    assert plain == on == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert off == plain + "<think>\n\n</think>\n\n"
    ids, _ = prepare_prompt(validate_chat({**BODY, "chat_template_kwargs": {"enable_thinking": False}}), tok, None,
                            4096, None, None)
    think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert ids == tok.encode(off) and think in ids and end_think in ids
    # a variable the template does not use changes nothing (as in vLLM)
    assert _prompt_text(tok, {**BODY, "chat_template_kwargs": {"unused": 1}}) == plain
    assert _prompt_text(tok, {**BODY, "chat_template_kwargs": {"style": "terse"}}) == plain + "[terse]"


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True, "style": "x"}])
def test_rendering_equals_transformers_apply_chat_template(qwen, kwargs):
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(qwen.hf_dir, "tokenizer.json"),
                                               eos_token="<|im_end|>")
    expected = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                       chat_template=QWEN3_LIKE, **kwargs)
    assert render_chat(QWEN3_LIKE, MESSAGES, add_generation_prompt=True, eos_token="<|im_end|>",
                       template_kwargs=kwargs) == expected


def test_template_kwargs_cannot_override_server_variables():
    out = render_chat("{{ add_generation_prompt }}|{{ messages | length }}|{{ x }}", MESSAGES,
                      add_generation_prompt=True, template_kwargs={"add_generation_prompt": False,
                                                                   "messages": [], "x": None})
    assert out == "True|1|None"


def test_chat_template_kwargs_validation():
    assert validate_chat(BODY).chat_template_kwargs is None
    assert validate_chat({**BODY, "chat_template_kwargs": None}).chat_template_kwargs is None
    v = validate_chat({**BODY, "chat_template_kwargs": {"enable_thinking": False, "n": [1]}})
    assert v.chat_template_kwargs == {"enable_thinking": False, "n": [1]}
    for bad in ("x", 1, True, ["enable_thinking"]):
        with pytest.raises(RequestError) as e:
            validate_chat({**BODY, "chat_template_kwargs": bad})
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
    for key in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "documents"):
        assert key in RESERVED_TEMPLATE_VARIABLES
        with pytest.raises(RequestError) as e:
            validate_chat({**BODY, "chat_template_kwargs": {key: 1}})
        assert e.value.status == 400 and e.value.param == f"chat_template_kwargs.{key}"
        assert f"chat_template_kwargs.{key}" in e.value.message
    with pytest.raises(RequestError) as e:
        validate_chat({**BODY, "chat_template_kwargs": {"": 1}})
    assert e.value.param == "chat_template_kwargs"
    # not a completions field
    with pytest.raises(RequestError) as e:
        validate_completion({"model": "m", "prompt": "hi", "chat_template_kwargs": {}})
    assert e.value.param == "chat_template_kwargs"


def test_hf_chat_template_sources(qwen, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(qwen.hf_dir, d)
    assert HFTokenizer.from_dir(d).chat_template == QWEN3_LIKE  # tokenizer_config.json
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert HFTokenizer.from_dir(d).chat_template == "D"  # named templates: the default one
    (d / "chat_template.jinja").write_text("J")
    assert HFTokenizer.from_dir(d).chat_template == "J"  # chat_template.jinja wins, as in transformers
