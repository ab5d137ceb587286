"""GGUF loader: the architecture spec (``ModelConfig``, arch_spec.py) and dequantized weights as torch tensors.

Families ``llama`` (Mistral too), ``qwen2``, ``qwen3``, ``phi3`` (fused ``attn_qkv`` / ``ffn_up`` split at load,
LongRoPE factor tensors read into the spec), ``qwen2moe``, ``qwen3moe``, Mixtral (``llama`` with
``llama.expert_count``; its experts stacked in ``ffn_{gate,up,down}_exps``, the router ``ffn_gate_inp``), ``gemma2``
and ``gemma3`` (text; norms already ``1 + w``, sandwich norms ``post_attention_norm`` / ``post_ffw_norm``)
(``general.architecture``), with llama.cpp's conventions per
architecture (``convert_hf_to_gguf.py``). Reads the file with ``gguf.GGUFReader`` (memory-mapped) and
dequantizes each tensor with ``gguf.quants.dequantize`` (numpy float32), then converts to the requested dtype.

Layout notes:
* GGUF ``ne`` order is innermost-first, so a tensor listed as ``[in, out]`` comes out of the
  reader/dequantizer as a row-major ``[out, in]`` array = torch ``nn.Linear.weight`` layout.
* ``llama`` (Mixtral included) only: the converter permutes the rows of ``attn_q``/``attn_k`` so that the two halves of each
  head (Hugging Face ``rotate_half`` convention) become interleaved pairs (GPT-J / llama.cpp RoPE). We undo
  that here (``unpermute_qk``) so the model uses the Hugging Face layout and RoPE. Qwen2 / Qwen3 files are
  written unpermuted (llama.cpp rotates them NEOX-style), so nothing is undone for them.
* Tied embeddings: without ``output.weight`` the LM head reuses ``token_embd.weight``.
* ``rope_freqs.weight`` (llama3 RoPE scaling) is read into the spec (arch_spec.from_gguf), not a weight.
* Every tensor is accounted for: one this loader does not know, or one the architecture needs and the file
  lacks, refuses the file (``arch_spec.UnsupportedModel`` naming it).
"""

from __future__ import annotations

import numpy as np
import torch

import gguf
from gguf.quants import dequantize

from .arch_spec import ModelConfig, UnsupportedModel, check_tensors, from_gguf  # noqa: F401 (ModelConfig re-exported)
from . import gemma
from .arch_spec import FUSED, GEMMA_GGUF, LONGROPE_TENSORS, split_fused, unfuse_found

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
    "attn_q.bias": "bq",  # qwen2
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm": "q_norm",  # qwen3
    "attn_k_norm": "k_norm",
    "ffn_gate_inp": "router",  # mixture of experts (Mixtral, Qwen3-MoE): [E, d]
    "ffn_gate_exps": "exp_gate",  # stacked experts [E, f, d]
    "ffn_up_exps": "exp_up",
    "ffn_down_exps": "exp_down",  # [E, d, f]
    "ffn_gate_inp_shexp": "shexp_router",  # Qwen2-MoE's shared expert: its gate [1, d] (or [d])
    "ffn_gate_shexp": "shexp_gate",
    "ffn_up_shexp": "shexp_up",
    "ffn_down_shexp": "shexp_down",
    "post_attention_norm": "post_attn_norm",  # Gemma 2 / 3 sandwich norms (gemma.py); their ffn_norm is the pre-MLP one
    "post_ffw_norm": "post_ffn_norm",
}
_CONSUMED = ("rope_freqs.weight",) + LONGROPE_TENSORS  # read into the spec (arch_spec.from_gguf)
# phi3 (llama.cpp's PHI3 tensors): Q/K/V in one ``attn_qkv``, gate and up in one ``ffn_up`` (gate rows first, as
# llama.cpp's SwiGLU split and transformers' Phi3MLP chunk); split at load (arch_spec.FUSED)
_PHI3_FUSED = {"attn_qkv": "wqkv", "ffn_up": "w_gate_up"}


def read_config(reader: gguf.GGUFReader) -> ModelConfig:
    """The spec from GGUF metadata (arch_spec.from_gguf; Gemma's own keys: gemma.from_gguf); UnsupportedModel for
    other architectures / values."""
    spec = from_gguf(reader)
    if spec.architecture in GEMMA_GGUF:
        spec = gemma.from_gguf({k: f.contents() for k, f in reader.fields.items()
                                if k.startswith(spec.architecture + ".")}, spec)
    return spec


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: ``[out, in]`` interleaved pairs -> HF half-split rows.

    Inverse of ``w.reshape(n, 2, hd/2, in).swapaxes(1, 2)`` done by ``convert_hf_to_gguf.py``.
    """
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _our_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to our weight name; None for a name this loader does not know."""
    if gguf_name == "token_embd.weight":
        return "embed"
    if gguf_name == "output_norm.weight":
        return "norm"
    if gguf_name == "output.weight":
        return "lm_head"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        key = parts[2] if parts[3] == "weight" else f"{parts[2]}.{parts[3]}"
        if key in _LAYER_NAMES:
            return f"layers.{parts[1]}.{_LAYER_NAMES[key]}"
    return None


def account_tensors(reader: gguf.GGUFReader, config: ModelConfig, path: str = "GGUF") -> dict[str, str]:
    """{GGUF name: our name} of every weight tensor; UnsupportedModel naming an unknown, missing or misshapen
    tensor (arch_spec.check_tensors)."""
    names, found = {}, {}
    for t in reader.tensors:
        if t.name in _CONSUMED:
            continue
        ours = _phi3_fused_name(t.name) if config.architecture == "phi3" else _our_name(t.name)
        if ours is None:
            raise UnsupportedModel(f"{path}: unknown tensor {t.name!r} (not a {config.architecture} weight)")
        names[t.name] = ours
        shape = tuple(int(d) for d in reversed(t.shape))
        if ours.rsplit(".", 1)[-1] in FUSED:
            found.update(unfuse_found(config, ours, shape, t.name))
        else:
            found[ours] = ((1, *shape) if ours.endswith("shexp_router") and len(shape) == 1 else shape, t.name)
    check_tensors(config, found, path, gguf_name)
    return names


def _phi3_fused_name(gguf_name: str) -> str | None:
    """Our name of a phi3 GGUF tensor: ``blk.{i}.attn_qkv.weight`` / ``ffn_up.weight`` fused (``wqkv`` /
    ``w_gate_up``); ``attn_q`` / ``ffn_gate`` and the like are not phi3 tensors (None); others as llama."""
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if parts[2] in _PHI3_FUSED:
            return f"layers.{parts[1]}.{_PHI3_FUSED[parts[2]]}"
        if parts[2] in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
            return None
    return _our_name(gguf_name)


def gguf_name(ours: str) -> str:
    """llama.cpp's tensor name of our weight name (the inverse of ``_our_name``)."""
    top = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
    if ours in top:
        return top[ours]
    _, i, short = ours.split(".", 2)
    key = next(k for k, v in _LAYER_NAMES.items() if v == short)
    return f"blk.{i}.{key}" if key.endswith(".bias") else f"blk.{i}.{key}.weight"


def _dequantize(tensor, config: ModelConfig) -> np.ndarray:
    """Dequantize one ReaderTensor to float32 numpy in torch layout, un-permuting Q/K rows of llama files."""
    arr = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    arr = arr.reshape([int(d) for d in reversed(tensor.shape)]) if arr.ndim > 1 else arr
    if config.architecture in ("llama", "mixtral"):  # Mixtral files are labelled llama (convert_hf_to_gguf.py)
        if tensor.name.endswith("attn_q.weight"):
            arr = unpermute_qk(arr, config.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            arr = unpermute_qk(arr, config.num_kv_heads)
    return arr


def load_gguf(
    path: str, dtype: torch.dtype = torch.float32, device: str = "cpu", progress: bool = False, reader=None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load ``(ModelConfig, weights)``; weights are ``{name: tensor}`` in ``dtype`` on ``device``.

    Names (arch_spec.expected_weights): ``embed`` [vocab, d], ``norm`` [d], ``lm_head`` [vocab, d] (tied to
    ``embed`` when the file has no ``output.weight``), ``layers.{i}.{attn_norm,ffn_norm}`` [d],
    ``layers.{i}.wq`` [H*hd, d], ``wk``/``wv`` [Hkv*hd, d], ``wo`` [d, H*hd],
    ``w_gate``/``w_up`` [ffn, d], ``w_down`` [d, ffn]; qwen2 ``bq`` [H*hd], ``bk``/``bv`` [Hkv*hd]; qwen3
    ``q_norm``/``k_norm`` [hd]. ``progress`` shows a tqdm bar. ``reader``: an open ``gguf.GGUFReader`` of
    ``path`` to reuse (one parse of the default model's metadata costs 2.5-5 s here). UnsupportedModel
    (ValueError) names an unsupported value or tensor before any weight is converted.
    """
    reader = reader if reader is not None else gguf.GGUFReader(path)
    config = read_config(reader)
    names = account_tensors(reader, config, path)
    weights: dict[str, torch.Tensor] = {}
    for tensor in _progress([t for t in reader.tensors if t.name in names], progress, path):
        arr = _dequantize(tensor, config)
        arr = arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, order="C")
        weights[names[tensor.name]] = torch.from_numpy(arr).to(device=device, dtype=dtype)
        if names[tensor.name].rsplit(".", 1)[-1] in FUSED:
            weights.update(split_fused(config, names[tensor.name], weights.pop(names[tensor.name])))
        elif names[tensor.name].endswith("shexp_router"):  # llama.cpp's {n_embd}: one output row
            weights[names[tensor.name]] = weights[names[tensor.name]].reshape(1, -1)
    weights.setdefault("lm_head", weights["embed"])
    return config, weights


def _progress(items, enabled: bool, path: str):
    """Wrap ``items`` in a tqdm bar when ``enabled``."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"loading {path.rsplit('/', 1)[-1]}", unit="tensor")
