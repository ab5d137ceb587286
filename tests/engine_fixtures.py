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

from bench.hf_reference import load_hf_llama  # noqa: F401 (re-export: the transformers reference model)
from bench.tiny_model import (CHAT_TEMPLATE, MERGES, SPECIAL_TOKENS, tiny_vocab,  # noqa: F401 (re-exports)
                               write_tiny_llama_gguf)


def prefill_logits(engine, prompt: list[int]):
    """Logits [len(prompt), vocab] (float32) of every prompt position from an idle engine's model.

    Borrows free KV blocks through the engine's block manager and gives them back.
    """
    from actors.worker.engine.model import BatchMetadata

    table = engine.block_manager.allocate("__probe__", len(prompt))
    try:
        bs, n = engine.config.block_size, len(prompt)
        slots = engine.runner.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        positions = engine.runner.tensor(list(range(n)))
        meta = BatchMetadata(positions, slots, slots, [n], [n], positions)
        return engine.model.forward(engine.runner.tensor(prompt), meta, engine.kv.tensor)
    finally:
        engine.block_manager.free("__probe__")


def stepwise_logits(engine, prompt: list[int]):
    """Logits [len(prompt), vocab] (float32) computed one token per forward (each a 1-row, decode-shaped
    step over the K/V cached by the previous ones), from an idle engine's model."""
    import torch

    from actors.worker.engine.model import BatchMetadata

    table = engine.block_manager.allocate("__probe__", len(prompt))
    try:
        bs, rows = engine.config.block_size, []
        slots = [table[p // bs] * bs + p % bs for p in range(len(prompt))]
        for p, tok in enumerate(prompt):
            t = engine.runner.tensor
            meta = BatchMetadata(t([p]), t([slots[p]]), t(slots[: p + 1]), [1], [p + 1], t([0]))
            rows.append(engine.model.forward(engine.runner.tensor([tok]), meta, engine.kv.tensor))
        return torch.cat(rows)
    finally:
        engine.block_manager.free("__probe__")


def assert_logits_within(engine, ref, prompts, max_rel: float, min_top1: float, label: str = "") -> None:
    """The engine's logits of ``prompts`` (concatenated), prefilled whole and one token per step, against ``ref``
    (float32 [sum of lengths, vocab], e.g. transformers'): relative Frobenius error <= ``max_rel`` and top-1 agreement
    >= ``min_top1`` for both; each printed with ``label``.  AssertionError otherwise."""
    import torch

    for name, fn in (("prefill", prefill_logits), ("one token per step", stepwise_logits)):
        ours = torch.cat([fn(engine, p) for p in prompts])
        rel = ((ours - ref).norm() / ref.norm()).item()
        top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{label} {name}: rel {rel:.4f}, top1 {top1:.3f}")
        assert rel <= max_rel and top1 >= min_top1, (label, name, rel, top1)

