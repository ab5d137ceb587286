"""Hugging Face directory loader: ``config.json`` (+ ``generation_config.json``) -> the architecture spec
(arch_spec.from_hf_config), ``model.safetensors`` or a sharded ``model.safetensors.index.json`` -> weights.

Families ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``phi3`` (fused ``qkv_proj`` / ``gate_up_proj``, split
at load), ``gemma2``, ``gemma3_text`` (norm weights folded to ``1 + w``: gemma.py), ``mixtral``, ``qwen2_moe``,
``qwen3_moe`` (``model_type``; the experts' per-expert tensors are stacked into one [E, ...] tensor each,
decision 0047). Tensors are read with ``safetensors.safe_open``
(memory-mapped: a tensor is materialized only when converted, never a whole file copied), in the Hugging
Face layout the model uses (no Q/K permutation). Every tensor of every shard is accounted for before any is
converted: an unknown name, a missing weight, a misshapen one, an ``lm_head.weight`` beside
``tie_word_embeddings: true`` (or none without it) refuses the directory (``arch_spec.UnsupportedModel``
naming it). ``rotary_emb.inv_freq`` buffers some older checkpoints carry are derived data: skipped, by name.

The detokenizer's bytes table comes from ``tokenizer.json`` through actors/text/hf_tokenizer.py (byte-level
decoders); without one, every id decodes to no bytes (a warning).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from .arch_spec import FUSED, ModelConfig, UnsupportedModel, check_tensors, from_hf_config, split_fused, unfuse_found
from .gemma import GEMMA_FAMILIES, fold_norms
from .gemma import from_hf_config as gemma_from_hf_config

log = logging.getLogger("actorserve.engine")

CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"

_LAYER = {  # Hugging Face per-layer name (after "model.layers.{i}.") -> ours
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    "self_attn.qkv_proj.weight": "wqkv",  # phi3: fused, split at load (arch_spec.FUSED)
    "mlp.gate_up_proj.weight": "w_gate_up",
}
# Mixture-of-experts layers (decision 0047): the router, and per-expert tensors "<prefix>.experts.{e}.<name>" that
# load stacked into our [E, ...] tensors (arch_spec._moe_weights).
_MOE_LAYER = {
    "block_sparse_moe.gate.weight": "router",  # Mixtral
    "mlp.gate.weight": "router",  # Qwen2/3-MoE
    "mlp.shared_expert.gate_proj.weight": "shexp_gate",  # Qwen2-MoE shared expert
    "mlp.shared_expert.up_proj.weight": "shexp_up",
    "mlp.shared_expert.down_proj.weight": "shexp_down",
    "mlp.shared_expert_gate.weight": "shexp_router",
}
_EXPERT = {  # (prefix, per-expert name) -> our stacked name
    ("block_sparse_moe", "w1.weight"): "exp_gate", ("block_sparse_moe", "w3.weight"): "exp_up",
    ("block_sparse_moe", "w2.weight"): "exp_down",
    ("mlp", "gate_proj.weight"): "exp_gate", ("mlp", "up_proj.weight"): "exp_up", ("mlp", "down_proj.weight"): "exp_down",
}
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
_DERIVED = ".self_attn.rotary_emb.inv_freq"  # recomputed from the spec


def is_hf_dir(path: str) -> bool:
    """True for a directory holding a ``config.json``."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))


def our_name(hf_name: str) -> str | None:
    """Our weight name of a Hugging Face tensor name; None when unknown."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _LAYER:
        return f"layers.{parts[2]}.{_LAYER[parts[3]]}"
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _MOE_LAYER:
        return f"layers.{parts[2]}.{_MOE_LAYER[parts[3]]}"
    return _expert_name(hf_name)


def _expert_name(hf_name: str) -> str | None:
    """``layers.{i}.exp_gate.{e}`` (our stacked name, then the expert index) of a per-expert tensor name such as
    ``model.layers.0.block_sparse_moe.experts.3.w1.weight``; None for any other name."""
    parts = hf_name.split(".")
    if len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[4] == "experts" \
            and parts[5].isdigit() and (parts[3], ".".join(parts[6:])) in _EXPERT:
        return f"layers.{parts[2]}.{_EXPERT[(parts[3], '.'.join(parts[6:]))]}.{int(parts[5])}"
    return None


def hf_name(ours: str) -> str:
    """The Hugging Face tensor name of our weight name (the inverse of ``our_name``)."""
    top = {v: k for k, v in _TOP.items()}
    if ours in top:
        return top[ours]
    _, i, short = ours.split(".", 2)
    if short.startswith("exp_"):  # a stacked expert tensor: the name of its first expert
        prefix, name = next(k for k, v in _EXPERT.items() if v == short.split(".")[0])
        return f"model.layers.{i}.{prefix}.experts.{short.split('.')[1] if '.' in short else 0}.{name}"
    if short in _MOE_LAYER.values():
        return f"model.layers.{i}.{next(k for k, v in _MOE_LAYER.items() if v == short)}"
    return f"model.layers.{i}.{next(k for k, v in _LAYER.items() if v == short)}"


# Gemma 2 / 3 (gemma.py): HF's post_attention_layernorm follows attention; the MLP has its own pre and post norms
_GEMMA_LAYER = {"post_attention_layernorm.weight": "post_attn_norm", "pre_feedforward_layernorm.weight": "ffn_norm",
                "post_feedforward_layernorm.weight": "post_ffn_norm"}


def _gemma_name(hf: str) -> str | None:
    """Our name of a Gemma tensor (its norms named as ``_GEMMA_LAYER``, the rest as Llama's)."""
    parts = hf.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _GEMMA_LAYER:
        return f"layers.{parts[2]}.{_GEMMA_LAYER[parts[3]]}"
    return our_name(hf)


def _gemma_hf_name(ours: str) -> str:
    inverse = {v: k for k, v in _GEMMA_LAYER.items()}
    short = ours.rsplit(".", 1)[-1]
    return f"model.layers.{ours.split('.')[1]}.{inverse[short]}" if short in inverse else hf_name(ours)


def read_config(path: str) -> ModelConfig:
    """The spec of the directory at ``path`` (``config.json``, ``generation_config.json`` when present)."""
    d = Path(path)
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{path}: no readable {CONFIG} ({exc})") from exc
    gen = None
    if (d / "generation_config.json").is_file():
        gen = json.loads((d / "generation_config.json").read_text())
    if cfg.get("model_type") in GEMMA_FAMILIES:
        return gemma_from_hf_config(cfg, gen)
    return from_hf_config(cfg, gen)


def shard_files(path: str) -> list[Path]:
    """The safetensors files of the directory: the shards of ``model.safetensors.index.json`` (each once, in
    order) or ``model.safetensors``. UnsupportedModel when neither exists or the index names a missing shard."""
    d = Path(path)
    if (d / INDEX).is_file():
        index = json.loads((d / INDEX).read_text())
        files = list(dict.fromkeys(index.get("weight_map", {}).values()))
        for f in files:
            if not (d / f).is_file():
                raise UnsupportedModel(f"{path}: shard {f!r} named by {INDEX} is missing")
        return [d / f for f in files]
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    raise UnsupportedModel(f"{path}: neither {SINGLE} nor {INDEX}")


def account_tensors(path: str, config: ModelConfig) -> dict[str, tuple[Path, str]]:
    """{our name: (shard file, HF name)} of every tensor of every shard, checked against the spec (module
    docstring). Reads headers only."""
    from safetensors import safe_open

    spec = _quant_spec(path)
    if spec is not None:  # GPTQ / AWQ / FP8 projections (hf_quant.py)
        from .hf_quant import account

        return account(path, config, spec, sys.modules[__name__])[0]
    where, found = {}, {}
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_DERIVED):
                    continue
                ours = _gemma_name(name) if config.architecture in GEMMA_FAMILIES else our_name(name)
                if ours is None:
                    raise UnsupportedModel(f"{path}: unknown tensor {name!r} in {file.name} (not a "
                                           f"{config.architecture} weight)")
                if ours in where:
                    raise UnsupportedModel(f"{path}: tensor {name!r} appears twice ({where[ours][0].name}, {file.name})")
                where[ours] = (file, name)
                shape = tuple(f.get_slice(name).get_shape())
                if ours.rsplit(".", 1)[-1] in FUSED:  # phi3's qkv_proj / gate_up_proj: checked as their parts
                    if config.architecture != "phi3":
                        raise UnsupportedModel(f"{path}: fused tensor {name!r} is not a {config.architecture} weight")
                    parts = unfuse_found(config, ours, shape, name)
                    if any(p in found for p in parts):
                        raise UnsupportedModel(f"{path}: tensor {name!r} beside its unfused parts")
                    found.update(parts)
                    continue
                if ours in found:
                    raise UnsupportedModel(f"{path}: tensor {name!r} beside a fused tensor holding it")
                found[ours] = (shape, name)
    if config.num_experts:
        _stack_experts(config, where, found, path)
    check_tensors(config, found, path, _gemma_hf_name if config.architecture in GEMMA_FAMILIES else hf_name)
    return where


def _stack_experts(config: ModelConfig, where: dict, found: dict, path: str) -> None:
    """Replace the per-expert entries ``layers.{i}.exp_*.{e}`` of ``where`` / ``found`` (in place) by one stacked
    entry per tensor: ``where`` then holds the list of (file, name) of experts 0..E-1, ``found`` the shape
    [E, ...]. UnsupportedModel names an expert index beyond ``num_experts``, a missing expert or one whose shape
    differs from expert 0's."""
    groups: dict[str, dict[int, tuple]] = {}
    for ours in [n for n in where if n.rsplit(".", 1)[0].rsplit(".", 1)[-1].startswith("exp_")]:
        stacked, e = ours.rsplit(".", 1)
        groups.setdefault(stacked, {})[int(e)] = (where.pop(ours), found.pop(ours))
    for stacked, by_expert in groups.items():
        extra = [e for e in by_expert if e >= config.num_experts]
        if extra:
            raise UnsupportedModel(f"{path}: unexpected tensor {by_expert[extra[0]][1][1]!r} (the config has "
                                   f"{config.num_experts} experts)")
        missing = [e for e in range(config.num_experts) if e not in by_expert]
        if missing:
            raise UnsupportedModel(f"{path}: missing tensor {hf_name(f'{stacked}.{missing[0]}')!r} ({len(missing)} "
                                   f"experts of {stacked} missing)")
        shape0, name0 = by_expert[0][1]
        for e in range(config.num_experts):
            if by_expert[e][1][0] != shape0:
                raise UnsupportedModel(f"{path}: tensor {by_expert[e][1][1]!r} has shape {list(by_expert[e][1][0])}, "
                                       f"expert 0 {list(shape0)}")
        where[stacked] = [by_expert[e][0] for e in range(config.num_experts)]
        found[stacked] = ((config.num_experts, *shape0), name0)


def tensor_types(path: str) -> list[str]:
    """safetensors dtype names of the projection tensors (``["BF16", ...]``: no GGUF block type, so
    ``--quantization auto`` keeps them dense)."""
    from safetensors import safe_open

    spec = _quant_spec(path)
    if spec is not None:  # "GPTQ" / "AWQ" (4-bit: "auto" resolves int4, quant.py) or "FP8"
        return [spec.label] * 7
    types = []
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            types += [f.get_slice(n).get_dtype() for n in f.keys() if n.endswith("_proj.weight")]
    return types


def load_hf(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
            progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(ModelConfig, weights)`` of the directory (names as gguf_loader.load_gguf); UnsupportedModel
    (ValueError) before any tensor is converted when the spec or the tensors do not match."""
    from safetensors import safe_open

    config = read_config(path)
    spec = _quant_spec(path)
    if spec is not None:  # GPTQ / AWQ / FP8: projections dequantized (hf_quant.py)
        from .hf_quant import load

        return config, load(path, config, spec, dtype, device, sys.modules[__name__])
    where = account_tensors(path, config)
    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    experts: dict[str, list] = {}  # stacked name -> its experts' tensors (in order)
    for ours, entry in where.items():
        if isinstance(entry, list):  # a stacked expert tensor (_stack_experts): each expert read on its own
            experts[ours] = [None] * len(entry)
            for e, (file, name) in enumerate(entry):
                by_file.setdefault(file, []).append((f"{ours}#{e}", name))
            continue
        file, name = entry
        by_file.setdefault(file, []).append((ours, name))
    items = [(file, pairs) for file, pairs in by_file.items()]
    if progress:
        from tqdm import tqdm

        items = tqdm(items, desc=f"loading {os.path.basename(path.rstrip('/'))}", unit="shard")
    for file, pairs in items:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for ours, name in pairs:
                if "#" in ours:
                    stacked, e = ours.split("#")
                    experts[stacked][int(e)] = f.get_tensor(name).to(device=device, dtype=dtype)
                    continue
                weights[ours] = f.get_tensor(name).to(device=device, dtype=dtype)
                if ours.rsplit(".", 1)[-1] in FUSED:
                    weights.update(split_fused(config, ours, weights.pop(ours)))
    for stacked, parts in experts.items():
        weights[stacked] = torch.stack(parts)
        parts.clear()
    if config.architecture in GEMMA_FAMILIES:
        fold_norms(config, weights)  # 1 + w, before lm_head may alias the embedding
    weights.setdefault("lm_head", weights["embed"])
    return config, weights


def _quant_spec(path: str):
    """hf_quant.QuantSpec of the directory's ``quantization_config`` (None without one)."""
    from .hf_quant import spec_of_dir

    return spec_of_dir(path)


# hf_quant.py is imported by functions of this module and reads its names through the module object it is given
# (``sys.modules[__name__]``), so neither imports the other at the top.


def token_tables(path: str, vocab_size: int) -> tuple[list[bytes], dict[int, str]]:
    """(bytes of every id with the decoder's first-token rule (detokenizer.TokenBytes), {id: name} of the special
    tokens) from ``tokenizer.json`` through the project's tokenizer (actors/text/hf_tokenizer.py: byte-level and
    SentencePiece-style decoders; its TokenizerError, a ValueError, names anything else). Special tokens decode to
    no bytes, as a GGUF's control tokens (detokenizer.py)."""
    from actors.text.hf_tokenizer import HFTokenizer

    from .detokenizer import TokenBytes

    if not (Path(path) / "tokenizer.json").is_file():
        log.warning("%s: no tokenizer.json: generated tokens decode to no text", path)
        return [b""] * vocab_size, {}
    tok = HFTokenizer.from_dir(path)
    n = min(vocab_size, len(tok))
    special = {i: tok.id_to_token(i) or "" for i in range(n) if tok.is_special(i)}
    table = [b"" if i in special else tok.token_bytes(i) for i in range(n)]
    return TokenBytes(table + [b""] * (vocab_size - n), tok.lead_space, tok.lead_keep_ids), special


def artifact_files(path: str) -> list[Path]:
    """The files whose bytes are the model: the GGUF itself, or a directory's config and safetensors."""
    if not os.path.isdir(path):
        return [Path(path)]
    d = Path(path)
    extra = [d / n for n in (CONFIG, INDEX, "generation_config.json") if (d / n).is_file()]
    return extra + shard_files(path)


def artifact_bytes(path: str) -> int:
    """Bytes of the model's files (the host's memory estimate before a load); 0 when unreadable."""
    try:
        return sum(f.stat().st_size for f in artifact_files(path))
    except (OSError, ValueError):
        return 0


def artifact_stamp(path: str) -> list[str]:
    """Identity of an artifact (path, sizes, mtimes of its files), for cache keys."""
    out = [os.path.abspath(path)]
    for f in artifact_files(path):
        st = f.stat()
        out += [f.name, str(st.st_size), str(st.st_mtime_ns)]
    return out
