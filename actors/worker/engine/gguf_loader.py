"""GGUF loader: Llama hyper-parameters (``ModelConfig``) and dequantized weights as torch tensors.

Reads the file with ``gguf.GGUFReader`` (memory-mapped) and dequantizes each tensor with
``gguf.quants.dequantize`` (numpy float32), then converts to the requested torch dtype.

Layout notes (source: llama.cpp ``convert_hf_to_gguf.py``, ``LlamaModel.permute``):
* GGUF ``ne`` order is innermost-first, so a tensor listed as ``[in, out]`` comes out of the
  reader/dequantizer as a row-major ``[out, in]`` array = torch ``nn.Linear.weight`` layout.
* The converter permutes the rows of ``attn_q``/``attn_k`` so that the two halves of each head
  (Hugging Face ``rotate_half`` convention) become interleaved pairs (GPT-J / llama.cpp RoPE).
  We undo that here (``unpermute_qk``) so the model uses the Hugging Face layout and RoPE.
* Tied embeddings: without ``output.weight`` the LM head reuses ``token_embd.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import gguf
from gguf.quants import dequantize

# GGUF tensor name -> our weight name (``{i}`` = layer index).
_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a model, read from GGUF metadata (``llama.*`` and ``tokenizer.ggml.*``); the torch
    runner builds its model from it (model_families.py picks the class by ``architecture``)."""

    num_layers: int  # transformer blocks
    hidden_size: int  # d_model
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # hidden_size // num_heads
    ffn_size: int  # SwiGLU inner size
    vocab_size: int  # embedding rows
    context_length: int  # trained context (tokens)
    rope_theta: float  # RoPE base
    rms_eps: float  # RMSNorm epsilon
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eot_token_id: int | None = None  # end-of-turn id when the file has one
    architecture: str = "llama"  # model family (GGUF general.architecture; a key of model_families.FAMILIES)
    tie_word_embeddings: bool = False  # True: the LM head is the token embedding (no output.weight)


def _field(reader: gguf.GGUFReader, key: str, default=None):
    """Return the decoded value of metadata field ``key`` or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    """Build a ``ModelConfig`` from ``llama.*`` metadata; ValueError for non-llama files."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    p = "llama."
    hidden, heads = int(_field(reader, p + "embedding_length")), int(_field(reader, p + "attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, p + "vocab_size") or (len(tokens.data) if tokens else None)
    return ModelConfig(
        num_layers=int(_field(reader, p + "block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        ffn_size=int(_field(reader, p + "feed_forward_length")),
        vocab_size=int(vocab),
        context_length=int(_field(reader, p + "context_length", 2048)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        eot_token_id=_field(reader, "tokenizer.ggml.eot_token_id"),
        architecture=arch,
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``[out, in]`` interleaved pairs -> HF half-split rows.

    Inverse of ``w.reshape(n, 2, hd/2, in).swapaxes(1, 2)`` done by ``convert_hf_to_gguf.py``.
    """
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _our_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to our weight name; None for tensors we do not use."""
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "norm"
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _dequantize(tensor, config: ModelConfig) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 numpy in torch layout, un-permuting Q/K rows."""
    arr = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    arr = arr.reshape([int(d) for d in reversed(tensor.shape)]) if arr.ndim > 1 else arr
    if tensor.name.endswith("attn_q.weight"):
        arr = unpermute_qk(arr, config.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        arr = unpermute_qk(arr, config.num_kv_heads)
    return arr


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", progress: bool = False, reader=None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load ``(ModelConfig, weights)``; weights are ``{name: tensor}`` in ``dtype`` on ``device``.

    Names: ``embed`` [vocab, d], ``norm`` [d], ``lm_head`` [vocab, d] (tied to ``embed`` when the
    file has no ``output.weight``), ``layers.{i}.{attn_norm,ffn_norm}`` [d],
    ``layers.{i}.wq`` [H*hd, d], ``wk``/``wv`` [Hkv*hd, d], ``wo`` [d, H*hd],
    ``w_gate``/``w_up`` [ffn, d], ``w_down`` [d, ffn].  ``progress`` shows a tqdm bar. ``reader``: an open
    ``gguf.GGUFReader`` of ``path`` to reuse (one parse of the default model's metadata costs 2.5-5 s here).
    """
    reader = reader if reader is not None else gguf.GGUFReader(path)
    config = read_config(reader)
    weights: dict[str, torch.Tensor] = {}
    for tensor in _progress(reader.tensors, progress, path):
        name = _our_name(tensor.name)
        if name is not None:
            arr = _dequantize(tensor, config)
            arr = arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, order="C")
            weights[name] = torch.from_numpy(arr).to(device=device, dtype=dtype)
    weights.setdefault("lm_head", weights["embed"])
    return config, weights


def _progress(items, enabled: bool, path: str):
    """Wrap ``items`` in a tqdm bar when ``enabled``."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"loading {path.rsplit('/', 1)[-1]}", unit="tensor")
