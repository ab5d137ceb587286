"""A tiny random-weight Llama GGUF file, for fast tests and benchmarks that do not need output quality.

``write_tiny_llama_gguf(path)`` writes a valid ``llama`` GGUF (gguf.GGUFWriter) with a gpt2-style
byte-level BPE tokenizer laid out like SmolLM2's: ids 0..2 are the control tokens
``<|endoftext|>``, ``<|im_start|>`` (bos), ``<|im_end|>`` (eos); ids 3..258 are the 256 GPT-2
byte-unicode chars (byte ``b`` has id ``3 + b``); then one token per merge.  Tensors are F32
except ``blk.0.ffn_down.weight``, stored as Q8_0 to exercise dequantization.
"""

from __future__ import annotations

import gguf
import numpy as np

from actors.worker.engine.detokenizer import bytes_to_unicode

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "i n", "e r", "Ġ a", "Ġt he", "o n", "r e", "Ġ s", "a n")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of the tiny tokenizer."""
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = list(SPECIAL_TOKENS) + byte_chars + merged
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(byte_chars) + len(merged))
    return tokens, types, list(MERGES)


def _add_metadata(w: gguf.GGUFWriter, n_layers, d, n_heads, n_kv_heads, ffn, vocab, ctx) -> None:
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(d // n_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)


def _add_tokenizer(w: gguf.GGUFWriter) -> None:
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _tensors(rng, n_layers, d, n_heads, n_kv_heads, ffn, vocab) -> dict[str, np.ndarray]:
    """Random float32 weights in torch layout [out, in] (GGUF lists shapes reversed)."""
    hd = d // n_heads
    rand = lambda *shape: (rng.standard_normal(shape) * 0.08).astype(np.float32)  # noqa: E731
    t = {"token_embd.weight": rand(vocab, d), "output_norm.weight": np.ones(d, np.float32)}
    for i in range(n_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1 + rand(d)).astype(np.float32)
        t[p + "ffn_norm.weight"] = (1 + rand(d)).astype(np.float32)
        t[p + "attn_q.weight"], t[p + "attn_k.weight"] = rand(n_heads * hd, d), rand(n_kv_heads * hd, d)
        t[p + "attn_v.weight"], t[p + "attn_output.weight"] = rand(n_kv_heads * hd, d), rand(d, n_heads * hd)
        t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"] = rand(ffn, d), rand(ffn, d)
        t[p + "ffn_down.weight"] = rand(d, ffn)
    return t


def write_tiny_llama_gguf(
    path: str, n_layers: int = 2, d: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
    ffn: int = 128, context_length: int = 512, seed: int = 0,
) -> str:
    """Write the tiny model to ``path`` (returns it).  ``d``/``ffn`` must be multiples of 32."""
    vocab = len(tiny_vocab()[0])
    w = gguf.GGUFWriter(path, "llama")
    _add_metadata(w, n_layers, d, n_heads, n_kv_heads, ffn, vocab, context_length)
    _add_tokenizer(w)
    for name, arr in _tensors(np.random.default_rng(seed), n_layers, d, n_heads, n_kv_heads, ffn, vocab).items():
        if name == "blk.0.ffn_down.weight":
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
