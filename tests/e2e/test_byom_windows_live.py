"""Bring your own model, live (issue [21] items 1-2): a tiny Mistral GGUF (sliding window of 16 tokens) and a tiny
Phi-3 Hugging Face directory (fused projections, LongRoPE), built at test time with transformers
(tests/family_models.py), registered through ``actorserve models register`` beside the running default model on
real NATS and etcd, answer chat (streamed and not) through the official ``openai`` client, past the window and past
LongRoPE's original length; and a tiny Gemma 3 text directory (issue [22] item 1: sandwich norms, GeGLU, q/k norms,
a sliding and a full layer, torch path).

The Mistral GGUF carries bench/tiny_model.py's byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``), not
a SentencePiece one: SentencePiece GGUF vocabularies are issue [21] item 3, not in this branch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import (build_long, chat_full_and_streamed, register_all, tiny_deployment,
                               until_served)
from tests.e2e.test_byom_live import WORKER_ARGS

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # `make test-slow` (.ci/run)
PROMPT = "Tell me a long story about a red fox, a blue bird and a green frog who walk to the sea together."


def _models(tmp: Path) -> dict[str, str]:
    """{"mistral": GGUF file, "phi3": HF directory, "gemma3": HF directory} of tiny models with a 4096-position
    context."""
    from tests import family_models as fm

    out = {}
    for name, fmt in (("mistral", "gguf"), ("phi3", "hf"), ("gemma3", "hf")):
        built = build_long(fm.WINDOW_VARIANTS, fm.build, name, tmp, seed=5, variant=fm.variant_of(name))
        out[name] = built["hf"] + "/" if fmt == "hf" else built["gguf"]
    return out


def test_a_mistral_gguf_and_phi3_and_gemma3_directories_registered_live_answer(tmp_path, tiny_gguf):
    models = _models(tmp_path)
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        client = register_all(sup, tmp_path, models)
        for name in models:
            until_served(client, name)
            assert {name, f"{name}@1"} <= {m.id for m in client.models.list().data}
            msgs = [{"role": "user", "content": PROMPT}]
            full = chat_full_and_streamed(client, name, msgs, 24)
            # the prompt is past the window (16) and LongRoPE's original length (32) on its own
            assert full.usage.prompt_tokens > 32, full.usage
