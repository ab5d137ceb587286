"""Hugging Face transformers reference model built from a GGUF file (no ``accelerate`` needed).

Used by the engine benchmark's baseline (``bench.engine_bench``) and by the reference-logits tests.
"""

from __future__ import annotations

import os


def load_hf_llama(gguf_path: str, dtype=None):
    """``LlamaForCausalLM`` (eval; float32 unless ``dtype``) built from a GGUF file by transformers.

    ``from_pretrained(dir, gguf_file=...)`` requires ``accelerate`` for GGUF; to avoid that extra
    dependency we do its steps ourselves: config from ``AutoConfig.from_pretrained(gguf_file=...)``,
    weights from transformers' own ``load_gguf_checkpoint`` (its dequantization and Q/K un-permute),
    then ``tie_weights`` (the GGUF has no ``output.weight``).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    dirname, filename = os.path.split(gguf_path)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(dirname, gguf_file=filename)).float().eval()
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model
