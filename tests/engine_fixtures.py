"""Test fixtures for the engine and the platform.

The tiny random-weight Llama GGUF writer lives in ``bench/tiny_model.py`` (benchmarks use it too)
and is re-exported here:

``write_tiny_llama_gguf(path)`` writes a valid ``llama`` GGUF (gguf.GGUFWriter) with a gpt2-style
byte-level BPE tokenizer laid out like SmolLM2's: ids 0..2 are the control tokens
``<|endoftext|>``, ``<|im_start|>`` (bos), ``<|im_end|>`` (eos); ids 3..258 are the 256 GPT-2
byte-unicode chars (byte ``b`` has id ``3 + b``); then one token per merge.  Tensors are F32
except ``blk.0.ffn_down.weight``, stored as Q8_0 to exercise dequantization.
"""

from __future__ import annotations

from bench.tiny_model import (CHAT_TEMPLATE, MERGES, SPECIAL_TOKENS, tiny_vocab,  # noqa: F401 (re-exports)
                               write_tiny_llama_gguf)


def load_hf_llama(gguf_path: str):
    """Hugging Face ``LlamaForCausalLM`` (float32, eval) built from a GGUF file by transformers.

    ``from_pretrained(dir, gguf_file=...)`` requires ``accelerate`` for GGUF; to avoid that extra
    dependency we do its steps ourselves: config from ``AutoConfig.from_pretrained(gguf_file=...)``,
    weights from transformers' own ``load_gguf_checkpoint`` (its dequantization and Q/K un-permute),
    then ``tie_weights`` (the GGUF has no ``output.weight``).
    """
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    dirname, filename = os.path.split(gguf_path)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(dirname, gguf_file=filename)).float().eval()
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights()
    return model


def prefill_logits(engine, prompt: list[int]):
    """Logits [len(prompt), vocab] (float32) of every prompt position from an idle engine's model.

    Borrows free KV blocks through the engine's block manager and gives them back.
    """
    from actors.worker.engine.model import BatchMetadata

    table = engine.block_manager.allocate("__probe__", len(prompt))
    try:
        bs, n = engine.config.block_size, len(prompt)
        slots = engine._tensor([table[p // bs] * bs + p % bs for p in range(n)])
        positions = engine._tensor(list(range(n)))
        meta = BatchMetadata(positions, slots, slots, [n], [n], positions)
        return engine.model.forward(engine._tensor(prompt), meta, engine.kv.tensor)
    finally:
        engine.block_manager.free("__probe__")
