"""Tiny random mixture-of-experts models (issue [22] item 2), built with transformers at test time as
tests/family_models.py builds the dense families (its scaling: logits std > 1, sharp attention, perturbed norms).

8 experts, top-2, the router scaled up (``ROUTER_SCALE``) so that routing is decided by clear margins and the
choice of experts moves the logits. Variants:

* ``mixtral``: Mixtral (Llama attention, top-2 renormalised), untied head;
* ``qwen3-moe``: Qwen3-MoE (q/k norms, ``moe_intermediate_size`` 96 beside a dense ``intermediate_size`` 128
  that no layer uses, ``norm_topk_prob`` true), untied head;
* ``qwen2-moe``: Qwen2-MoE (Q/K/V biases, a shared expert of 128 gated by a sigmoid, ``norm_topk_prob`` false,
  as llama.cpp's qwen2moe graph);
* ``qwen3-moe-nonorm``: the same with ``norm_topk_prob`` false (transformers' default; directory only: llama.cpp's
  qwen3moe graph always renormalises).

``build(name, folder)`` saves the Hugging Face directory and, where llama.cpp has a convention, a GGUF written
with ``gguf.GGUFWriter`` and llama.cpp's names (experts stacked in ``ffn_{gate,up,down}_exps``, the router
``ffn_gate_inp``; Mixtral labelled ``llama`` with ``llama.expert_count`` and its Q/K rows permuted).
``sentencepiece_dir(src, folder)`` copies a directory for llama.cpp's own converter with a SentencePiece
``tokenizer.model`` (Mixtral's tokenizer kind) trained at test time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch

from tests.family_models import (_GGUF_LAYER, Variant, _hf_config, _permute, _scale, add_gguf_hparams, finish_gguf,
                                 save_hf_dir)

NUM_EXPERTS, TOP_K = 8, 2
ROUTER_SCALE = 3.0  # router weights std ROUTER_SCALE / sqrt(d): router logits of std ~3

VARIANTS = {
    "mixtral": Variant("mixtral", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                                   "num_local_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K,
                                   "rope_theta": 10000.0}),
    "qwen3-moe": Variant("qwen3_moe", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                                       "head_dim": 32, "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K,
                                       "moe_intermediate_size": 96, "norm_topk_prob": True}),
    "qwen2-moe": Variant("qwen2_moe", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                                       "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K,
                                       "moe_intermediate_size": 96, "shared_expert_intermediate_size": 128,
                                       "norm_topk_prob": False}),
    "qwen3-moe-nonorm": Variant("qwen3_moe", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                                              "head_dim": 32, "num_experts": NUM_EXPERTS,
                                              "num_experts_per_tok": TOP_K, "moe_intermediate_size": 96,
                                              "norm_topk_prob": False}, gguf=False),
}


def hf_model(name: str, seed: int = 0):
    """The transformers model of variant ``name`` (float32, eval), scaled (module docstring)."""
    import transformers

    cfg = _hf_config(VARIANTS[name])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _scale(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            block = getattr(layer, "block_sparse_moe", None) or layer.mlp
            w = block.gate.weight
            w.copy_(torch.randn(w.shape, generator=g) * ROUTER_SCALE / w.shape[1] ** 0.5)
    return model


def build(name: str, folder: str | os.PathLike, seed: int = 0) -> dict:
    """Save variant ``name`` under ``folder``: {"model", "hf": directory, "gguf": file or None}."""
    folder = Path(folder)
    model = hf_model(name, seed)
    hf_dir = save_hf_dir(model, folder / f"{name}-hf")
    gguf_path = None
    if VARIANTS[name].gguf:
        gguf_path = write_moe_gguf(model, str(hf_dir), str(folder / f"{name}.gguf"))
    return {"model": model, "hf": str(hf_dir), "gguf": gguf_path}


_LAYER = {**_GGUF_LAYER,  # the dense families' names (norms, attention), then the MoE ones
          "block_sparse_moe.gate.weight": "ffn_gate_inp.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
          "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}
# per-expert name -> llama.cpp's stacked tensor
_EXPERTS = {"w1.weight": "ffn_gate_exps.weight", "w3.weight": "ffn_up_exps.weight", "w2.weight": "ffn_down_exps.weight",
            "gate_proj.weight": "ffn_gate_exps.weight", "up_proj.weight": "ffn_up_exps.weight",
            "down_proj.weight": "ffn_down_exps.weight"}


def moe_gguf_tensors(model, hf_dir: str) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 tensors of a Mixtral / Qwen3-MoE transformers model, read from its saved
    directory ``hf_dir`` (per-expert tensors there; transformers 5 holds them fused in memory)."""
    from safetensors.numpy import load_file

    cfg = model.config
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, arr in sd.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            continue
        i, rest = parts[2], ".".join(parts[3:])
        if "experts" in parts:  # model.layers.{i}.<block>.experts.{e}.<name>
            e = int(parts[parts.index("experts") + 1])
            stacks.setdefault(f"blk.{i}.{_EXPERTS['.'.join(parts[parts.index('experts') + 2:])]}", {})[e] = arr
            continue
        gname = f"blk.{i}.{_LAYER[rest]}"
        if cfg.model_type == "mixtral" and gname.endswith("attn_q.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif cfg.model_type == "mixtral" and gname.endswith("attn_k.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        out[gname] = np.ascontiguousarray(arr)
    for gname, by_e in stacks.items():
        out[gname] = np.ascontiguousarray(np.stack([by_e[e] for e in range(len(by_e))]))  # [E, out, in]
    return out


def write_moe_gguf(model, hf_dir: str, path: str, drop: tuple = (), extra_kv: dict | None = None) -> str:
    """A GGUF of a MoE ``model`` with llama.cpp's conventions (module docstring); ``drop`` / ``extra_kv``
    ({key suffix: int}) make broken files for the refusal tests."""
    import gguf

    cfg = model.config
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    w = gguf.GGUFWriter(path, arch)
    add_gguf_hparams(w, cfg)
    w.add_expert_count(cfg.num_local_experts if cfg.model_type == "mixtral" else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.model_type != "mixtral":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, value in (extra_kv or {}).items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return finish_gguf(w, path, moe_gguf_tensors(model, hf_dir), drop)


def sentencepiece_dir(src: str, folder: str | os.PathLike) -> str:
    """A copy of the directory ``src`` (config and weights) with a SentencePiece BPE ``tokenizer.model`` (byte
    fallback, trained here on a tiny corpus) instead of ``tokenizer.json``: the tokenizer kind llama.cpp's
    converter reads for a Mixtral (it pads the vocabulary to the config's ``vocab_size``)."""
    import random

    import sentencepiece as spm

    dst = Path(folder)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(src, name), dst / name)
    rng = random.Random(0)
    # 5 letters: 256 byte pieces + 3 control + 6 characters leave room for merges within the model's 269 ids
    words = ["ab", "cab", "bad", "dead", "bead", "aced", "dab", "ace", "decade", "bed"]
    corpus = dst / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(dst / "tokenizer"), vocab_size=268,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    corpus.unlink()
    return str(dst)
