"""Quantized checkpoints, live (issue [23]): a GPTQ Hugging Face directory (packed by the test from known float
weights, tests/unit/test_engine_hf_quant.py's packer) and a Q4_K_M GGUF (llama.cpp's own quantizer,
tests/unit/test_engine_kquant.py) registered through ``actorserve models register`` beside the running default
model on real NATS and etcd answer chat (streamed and not) through the official ``openai`` client, and
``actorserve status`` shows what each engine holds (the file's int4 blocks, not a re-quantization).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import openai
import pytest
import torch

from tests.e2e.helpers import tiny_deployment
from tests.e2e.helpers import CHATML, until_served
from tests.e2e.test_registry_live import cli
from tests.unit.test_engine_kquant import llama_quantize, needs_quantize

pytestmark = [pytest.mark.timeout(420), needs_quantize, pytest.mark.slow]  # `make test-slow` (.ci/run)
WORKER_ARGS = {"worker": ["--kv-cache-bytes", "8000000", "--no-progress"]}


def _model():
    """A tiny llama (hidden 256: whole K-quant super-blocks) with a 4096-position context."""
    import transformers

    from tests.family_models import VARIANTS, Variant, _hf_config, _scale

    cfg = _hf_config(Variant("llama", {**VARIANTS["llama-plain"].config, "hidden_size": 256,
                                       "intermediate_size": 512, "max_position_embeddings": 4096}))
    torch.manual_seed(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _scale(model, 6)
    return model


def _artifacts(tmp: Path) -> dict[str, str]:
    from tests.family_models import write_gguf
    from tests.unit.test_engine_hf_quant import _gptq_tensors, _write_dir

    model = _model()
    f32 = write_gguf(model, str(tmp / "f32.gguf"))
    q4km = str(tmp / "q4km.gguf")
    llama_quantize(f32, q4km, "Q4_K_M")
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False}
    gptq, _ = _write_dir(model, tmp / "gptq", qc, lambda w: _gptq_tensors(w, 64, False, False))
    return {"gptq": gptq + "/", "q4km": q4km}


def test_a_gptq_directory_and_a_q4_k_m_gguf_registered_live_answer(tmp_path, tiny_gguf):
    arts = _artifacts(tmp_path)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    with tiny_deployment(tmp_path / "state", tiny_gguf, WORKER_ARGS) as sup:
        for name, artifact in arts.items():
            p = cli(sup, "models", "register", name, "1", "--artifact", artifact, "--chat-template",
                    f"@{tmp_path / 'chatml.jinja'}")
            assert p.returncode == 0, p.stderr
        client = openai.OpenAI(base_url=sup.http_url + "/v1", api_key=sup.dev_api_key, timeout=60, max_retries=0)
        msgs = [{"role": "user", "content": "Say something."}]
        for name in arts:
            until_served(client, name)
            cold = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
            assert cold.choices[0].finish_reason in ("stop", "length") and cold.usage.completion_tokens >= 1
            # the streamed answer against a non-streamed one computed the same way: both after the prompt's prefix-
            # cache hit (the block products' int8 activations may round a hit's logits apart from a whole prefill's
            # at a near-tie, as llama.cpp's: quant.block_quant_enabled, decision 0053; random weights tie often)
            full = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, temperature=0)
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=name, messages=msgs, max_tokens=8, temperature=0, stream=True) if c.choices)
            assert text == (full.choices[0].message.content or "")
        status = cli(sup, "status")
        assert status.returncode == 0, status.stderr
        print(status.stdout)
        held = {name: next((ln for ln in status.stdout.splitlines() if f"worker-{name}-1-0:" in ln), "")
                for name in arts}
        assert "holds int4" in held["gptq"] and "(GPTQ) x 8" in held["gptq"], status.stdout
        assert "int4" in held["q4km"] and "(Q4_K) x 6" in held["q4km"] and "(Q6_K) x 1" in held["q4km"], status.stdout
        assert "re-quantized" not in held["gptq"] + held["q4km"]
