"""Reasoning output live (issue [21] item 4): a tiny model whose weights force ``<think>wait</think>\\n\\nok``
(tests/reasoning_model.py, checked against transformers in tests/unit/test_reasoning.py), registered through
``actorserve models register`` beside the running default model on real NATS and etcd (its reasoning format
inferred from its chat template), answers through the official ``openai`` client with the thinking apart:
chat ``message.reasoning_content`` and streamed ``delta.reasoning_content``, a Responses ``reasoning`` item
(streamed and not), ``usage`` reasoning tokens; a ``json_schema`` and a named tool call apply after
``</think>``; ``enable_thinking=false`` renders the closed empty block instead of the thinking preamble. The same
directory registered with Qwen3's hybrid template (no preamble) opens the thinking itself.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests import reasoning_model as rm
from tests.e2e.helpers import tiny_deployment, until_served
from tests.e2e.test_byom_live import SCHEMA, TOOL
from tests.e2e.test_registry_live import cli

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # `make test-slow` (.ci/run)
WORKER_ARGS = {"worker": ["--kv-cache-bytes", "8000000", "--no-progress", "--dtype", "float32",
                          "--quantization", "none"]}
MSGS = [{"role": "user", "content": "Think, then answer."}]


def _reasoning(obj) -> str | None:
    return getattr(obj, "reasoning_content", None)


def test_a_reasoning_model_answers_apart_from_its_thinking(tmp_path, tiny_gguf):
    built = rm.build(tmp_path)
    artifact = built["dir"] + "/"
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        p = cli(sup, "models", "register", "odd", "1", "--artifact", artifact, "--reasoning-format", "harmony")
        assert p.returncode == 2 and "reasoning_format" in p.stderr and "'harmony'" in p.stderr, p.stderr
        p = cli(sup, "models", "register", "reasoner", "1", "--artifact", artifact,
                "--option", 'tool_call_format="hermes"')
        assert p.returncode == 0, p.stderr
        shown = cli(sup, "models", "show", "reasoner", "--json")
        assert '"reasoning_format": "think_tags"' in shown.stdout, shown.stdout  # inferred from the template
        c = openai.OpenAI(base_url=sup.http_url + "/v1", api_key=sup.dev_api_key, timeout=60, max_retries=0)
        until_served(c, "reasoner")
        kw = dict(model="reasoner", messages=MSGS, max_tokens=40, temperature=0)

        full = c.chat.completions.create(**kw)
        m = full.choices[0].message
        assert (_reasoning(m), m.content, full.choices[0].finish_reason) == (rm.REASONING, rm.ANSWER, "stop")
        assert full.usage.completion_tokens_details.reasoning_tokens == rm.REASONING_TOKENS

        thought, content, order = "", "", []
        for ch in c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
            for choice in ch.choices:
                if _reasoning(choice.delta):
                    thought += _reasoning(choice.delta)
                    order.append("r")
                if choice.delta.content:
                    content += choice.delta.content
                    order.append("c")
            if ch.usage is not None:
                assert ch.usage.completion_tokens_details.reasoning_tokens == rm.REASONING_TOKENS
        assert (thought, content) == (rm.REASONING, rm.ANSWER) and order == sorted(order, reverse=True)

        off = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].message.content == rm.ANSWER and _reasoning(off.choices[0].message) is None
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
        assert off.usage.prompt_tokens == full.usage.prompt_tokens + 3  # "\n\n</think>\n\n" after <think>

        rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        js = c.chat.completions.create(**{**kw, "max_tokens": 120}, response_format=rf)
        assert js.choices[0].finish_reason == "stop", js.choices[0]
        assert _reasoning(js.choices[0].message) == rm.REASONING  # the schema left the thinking free
        assert json.loads(js.choices[0].message.content)["answer"] in ("yes", "no")

        call = c.chat.completions.create(**{**kw, "max_tokens": 200}, tools=[TOOL],
                                         tool_choice={"type": "function", "function": {"name": "pick"}})
        assert call.choices[0].finish_reason == "tool_calls" and _reasoning(call.choices[0].message) == rm.REASONING
        [tc] = call.choices[0].message.tool_calls
        assert tc.function.name == "pick" and json.loads(tc.function.arguments)["colour"] in ("red", "blue")

        r = c.responses.create(model="reasoner", input=MSGS[0]["content"], max_output_tokens=40, temperature=0)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == rm.REASONING and r.output_text == rm.ANSWER
        assert r.usage.output_tokens_details.reasoning_tokens == rm.REASONING_TOKENS
        events = list(c.responses.create(model="reasoner", input=MSGS[0]["content"], max_output_tokens=40,
                                         temperature=0, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == rm.REASONING
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == rm.ANSWER
        assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]

        # Qwen3's hybrid generation prompt: the model opens the thinking itself; the schema waits for it too
        (tmp_path / "qwen3.jinja").write_text(rm.QWEN3_TEMPLATE)
        p = cli(sup, "models", "register", "hybrid", "1", "--artifact", artifact, "--chat-template",
                f"@{tmp_path / 'qwen3.jinja'}")
        assert p.returncode == 0, p.stderr
        until_served(c, "hybrid")
        kw = {**kw, "model": "hybrid"}
        full = c.chat.completions.create(**kw)
        assert (_reasoning(full.choices[0].message), full.choices[0].message.content) == (rm.REASONING, rm.ANSWER)
        assert full.usage.completion_tokens_details.reasoning_tokens == rm.REASONING_TOKENS + 1  # its own <think>
        js = c.chat.completions.create(**{**kw, "max_tokens": 120}, response_format=rf)
        assert _reasoning(js.choices[0].message) == rm.REASONING, js.choices[0]
        assert json.loads(js.choices[0].message.content)["answer"] in ("yes", "no")
