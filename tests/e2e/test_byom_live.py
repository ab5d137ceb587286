"""Bring your own model, live (issue [20]): a tiny Qwen3 Hugging Face directory and a tiny Llama-3 GGUF file, built
at test time with transformers (random weights, scaled so features matter; tests/family_models.py), registered
through ``actorserve models register`` beside the running default model on real NATS and etcd, answer chat
(streamed and not), a ``json_schema`` and a named tool call through the official ``openai`` client, and
``/v1/models`` lists them. A directory the engine cannot account for is refused at registration, naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import (CHATML, build_long, chat_full_and_streamed, register_chatml, tiny_deployment,
                               until_served)
from tests.e2e.test_registry_live import cli

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # `make test-slow` (.ci/run)
WORKER_ARGS = {"worker": ["--kv-cache-bytes", "8000000", "--no-progress"]}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}}}


def _models(tmp: Path, which=(("qwen3", "hf"), ("llama3", "gguf"))) -> dict[str, str]:
    """{"qwen3": HF directory, "llama3": GGUF file} of tiny models with a 4096-position context."""
    from tests import family_models as fm

    out = {}
    for name, fmt in which:
        built = build_long(fm.VARIANTS, fm.build, name, tmp, seed=3)
        out[name] = built["hf"] + "/" if fmt == "hf" else built["gguf"]
    return out


def test_a_qwen3_directory_and_a_llama3_gguf_registered_live_answer(tmp_path, tiny_gguf):
    models = _models(tmp_path)
    bad = Path(models["qwen3"].rstrip("/") + "-bad")
    bad.mkdir()
    for f in Path(models["qwen3"]).iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.0.mlp.extra.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        p = cli(sup, "models", "register", "broken", "1", "--artifact", str(bad) + "/")
        assert p.returncode == 2 and "model.layers.0.mlp.extra.weight" in p.stderr, p.stderr
        for name, artifact in models.items():
            register_chatml(sup, tmp_path, name, artifact)
        client = openai.OpenAI(base_url=sup.http_url + "/v1", api_key=sup.dev_api_key, timeout=60, max_retries=0)
        for name in models:
            until_served(client, name)
            listed = {m.id for m in client.models.list().data}
            assert {name, f"{name}@1"} <= listed, listed
            msgs = [{"role": "user", "content": "Say something."}]
            chat_full_and_streamed(client, name, msgs, 8)
            rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
            js = client.chat.completions.create(model=name, messages=msgs, max_tokens=200, response_format=rf)
            assert js.choices[0].finish_reason == "stop", js.choices[0]
            assert json.loads(js.choices[0].message.content)["answer"] in ("yes", "no")
            call = client.chat.completions.create(model=name, messages=msgs, max_tokens=400, tools=[TOOL],
                                                  tool_choice={"type": "function", "function": {"name": "pick"}})
            assert call.choices[0].finish_reason == "tool_calls", call.choices[0]
            [tc] = call.choices[0].message.tool_calls
            assert tc.function.name == "pick" and json.loads(tc.function.arguments)["colour"] in ("red", "blue")


def test_up_serves_a_hugging_face_directory_given_as_its_model_file(tmp_path):
    """``up --model-file DIR`` (Supervisor ``model_file``): the format is inferred (hf), the directory checked as
    ``models register`` checks it, and the version answers chat (streamed and not, with the directory's own
    ``chat_template.jinja``) and completions through the official client."""
    qwen3 = _models(tmp_path, (("qwen3", "hf"),))["qwen3"].rstrip("/")
    (Path(qwen3) / "chat_template.jinja").write_text(CHATML)
    with tiny_deployment(tmp_path / "state", qwen3, WORKER_ARGS) as sup:
        assert (sup.manifest["format"], sup.manifest["tokenizer"], sup.manifest["context_length"]) == ("hf", "hf", 4096)
        client = openai.OpenAI(base_url=sup.http_url + "/v1", api_key=sup.dev_api_key, timeout=60, max_retries=0)
        assert {"tiny", "tiny@1"} <= {m.id for m in client.models.list().data}
        msgs = [{"role": "user", "content": "Say something."}]
        full = chat_full_and_streamed(client, "tiny", msgs, 8)
        # the directory's template was rendered: its ChatML markers count in the prompt
        plain = client.completions.create(model="tiny", prompt="Say something.", max_tokens=4, temperature=0)
        assert full.usage.prompt_tokens > plain.usage.prompt_tokens + 5 and plain.usage.completion_tokens >= 1
