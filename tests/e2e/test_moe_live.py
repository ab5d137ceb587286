"""Mixture of experts, live (issue [22] acceptance): a tiny Qwen3-MoE Hugging Face directory (8 experts, top-2,
random weights scaled so routing matters; tests/moe_models.py), registered through ``actorserve models register``
beside the running default model on real NATS and etcd, answers chat (streamed and not) and a ``json_schema``
through the official ``openai`` client, and ``/v1/models`` lists it.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.e2e.helpers import (build_long, chat_full_and_streamed, register_chatml, tiny_deployment,
                               until_served)
from tests.e2e.test_byom_live import SCHEMA, WORKER_ARGS
from tests.e2e.test_registry_live import cli

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # `make test-slow` (.ci/run)


def _qwen3_moe(tmp: Path) -> str:
    """The tiny Qwen3-MoE directory with a 4096-position context."""
    from tests import moe_models as mm

    import dataclasses

    variant = dataclasses.replace(mm.VARIANTS["qwen3-moe"], gguf=False)
    return build_long(mm.VARIANTS, mm.build, "qwen3-moe", tmp, seed=3, variant=variant)["hf"] + "/"


def test_a_qwen3_moe_directory_registered_live_answers(tmp_path, tiny_gguf):
    artifact = _qwen3_moe(tmp_path)
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        register_chatml(sup, tmp_path, "moe", artifact)
        p = cli(sup, "models", "show", "moe")
        assert p.returncode == 0, p.stderr
        client = openai.OpenAI(base_url=sup.http_url + "/v1", api_key=sup.dev_api_key, timeout=60, max_retries=0)
        until_served(client, "moe")
        assert {"moe", "moe@1"} <= {m.id for m in client.models.list().data}
        msgs = [{"role": "user", "content": "Route this through two experts."}]
        chat_full_and_streamed(client, "moe", msgs, 8)
        rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        js = client.chat.completions.create(model="moe", messages=msgs, max_tokens=200, response_format=rf)
        assert js.choices[0].finish_reason == "stop", js.choices[0]
        assert json.loads(js.choices[0].message.content)["answer"] in ("yes", "no")
