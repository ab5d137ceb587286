"""LoRA adapters in PEFT format, fused to the engine's projections, and their grouped products in a step.

Algorithm: LoRA (Hu et al. 2021, arXiv:2106.09685): ``y = x W^T + s * (x A^T) B^T`` with A [r, in], B [out, r]
and ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA, Kalajdzievski 2023). File format: Hugging Face
PEFT ``save_pretrained`` (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.model.layers.<i>.<self_attn|mlp>.<q|k|v|o|gate|up|down>_proj.lora_<A|B>.weight``).

The engine fuses Q/K/V into one projection and gate/up into another (model.py); an adapter is kept per
layer, fused projection and sub-projection (A [r, in], B [out_i, r], scale folded into B), and the slots
(lora_slots.py) stack the sub-projections' A side by side and place each B in its own rank rows and output
columns, so one adapter costs two small products per fused projection.  A step serves many adapters at once (Punica, Chen et al.
2023; S-LoRA, Sheng et al. 2023): lora_slots.py keeps every slot's A and B stacked per projection and a
step's ``LoraBatch`` adds each row's own adapter's delta (batched products over the slots); rows with no
adapter get none.  No per-adapter batches are formed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# PEFT module name -> (fused projection of model.py, index of the sub-projection inside it)
MODULES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: missing or corrupt files, an unsupported PEFT option, or shapes that
    do not fit the model (the message names the adapter and the field)."""


def sub_outputs(config) -> dict[str, list[int]]:
    """Output rows of each sub-projection of a fused projection (rows), from a ``ModelConfig``."""
    H, Hkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    return {"qkv": [H * hd, Hkv * hd, Hkv * hd], "o": [config.hidden_size],
            "gate_up": [config.ffn_size, config.ffn_size], "down": [config.hidden_size]}


def in_features(config) -> dict[str, int]:
    """Input width of each fused projection (features)."""
    return {"qkv": config.hidden_size, "o": config.num_heads * config.head_dim, "gate_up": config.hidden_size,
            "down": config.ffn_size}


@dataclass
class AdapterConfig:
    """What the engine reads of ``adapter_config.json``: ``lora_alpha`` and rsLoRA for the scale, the rank."""

    rank: int  # r (the largest rank of any module when ``rank_pattern`` is absent: every module has r)
    alpha: float  # lora_alpha
    use_rslora: bool = False

    def scale(self, rank: int) -> float:
        """LoRA scale of a module of rank ``rank``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(rank) if self.use_rslora else rank)


def read_config(name: str, path: str) -> AdapterConfig:
    """Parse and check ``<path>/adapter_config.json``; AdapterError for a missing file or an unsupported option
    (DoRA, fan_in_fan_out, biases, modules_to_save, rank/alpha patterns, a peft_type other than LORA)."""
    try:
        with open(os.path.join(path, "adapter_config.json"), "rb") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: adapter_config.json unreadable ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type must be LORA")
    for key, ok in (("use_dora", not cfg.get("use_dora")), ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
                    ("bias", cfg.get("bias", "none") == "none"), ("modules_to_save", not cfg.get("modules_to_save")),
                    ("rank_pattern", not cfg.get("rank_pattern")), ("alpha_pattern", not cfg.get("alpha_pattern"))):
        if not ok:
            raise AdapterError(f"adapter {name!r}: {key}={cfg.get(key)!r} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise AdapterError(f"adapter {name!r}: r must be an integer >= 1 and lora_alpha a number")
    return AdapterConfig(r, float(alpha), bool(cfg.get("use_rslora", False)))


def read_tensors(name: str, path: str) -> dict[tuple[int, str, str], torch.Tensor]:
    """``{(layer, peft module, "A"|"B"): float32 tensor}`` from ``adapter_model.safetensors`` (or the older
    ``adapter_model.bin`` is refused: pickles are not loaded); AdapterError when unreadable or when a key names
    a module the engine cannot adapt (embeddings, lm_head)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    try:
        raw = load_file(file)
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise AdapterError(f"adapter {name!r}: adapter_model.safetensors unreadable ({e})") from None
    out = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULES:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} targets a module the engine cannot adapt")
        out[(int(m.group(1)), m.group(2), m.group(3))] = t.float()
    if not out:
        raise AdapterError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA tensors")
    return out


@dataclass
class HostAdapter:
    """An adapter read from disk (the CPU tier), float32: per (layer, fused projection) and sub-projection index
    (q, k, v = 0, 1, 2 of qkv; gate, up = 0, 1 of gate_up; 0 for o and down) its A [r, in] and scaled B [out_i, r]."""

    name: str
    rank: int  # adapter_config r
    layers: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (float32)."""
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for subs in self.layers.values() for a, b in subs.values())


def load_peft(name: str, path: str, model_config, max_rank: int = 0) -> HostAdapter:
    """Read a PEFT LoRA adapter and fuse it to the engine's projections (float32, on the CPU).

    Raises AdapterError naming the adapter and the field when a file is missing or corrupt, an option is not
    supported, ``r`` exceeds ``max_rank`` (> 0), a layer index is out of range, or a shape does not fit."""
    cfg = read_config(name, path)
    if max_rank and cfg.rank > max_rank:
        raise AdapterError(f"adapter {name!r}: r={cfg.rank} exceeds the worker's max LoRA rank {max_rank}")
    tensors = read_tensors(name, path)
    outs, ins = sub_outputs(model_config), in_features(model_config)
    parts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module, _), _t in sorted(tensors.items()):
        if layer >= model_config.num_layers:
            raise AdapterError(f"adapter {name!r}: layer {layer} is beyond the model's {model_config.num_layers}")
        proj, idx = MODULES[module]
        a, b = tensors.get((layer, module, "A")), tensors.get((layer, module, "B"))
        if a is None or b is None:
            raise AdapterError(f"adapter {name!r}: layers.{layer}.{module} lacks lora_A or lora_B")
        want = (a.shape[0], ins[proj], outs[proj][idx])
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != want[1] or tuple(b.shape) != (want[2], want[0]):
            raise AdapterError(f"adapter {name!r}: layers.{layer}.{module} lora_A {tuple(a.shape)} / lora_B "
                               f"{tuple(b.shape)} do not fit [r, {want[1]}] / [{want[2]}, r]")
        parts.setdefault((layer, proj), {})[idx] = (a, b * cfg.scale(a.shape[0]))
    return HostAdapter(name, cfg.rank, parts)


def slot_bytes(model_config, rank: int, dtype: torch.dtype) -> int:
    """Bytes one accelerator slot needs for an adapter of rank ``rank`` on every projection of every layer (per
    fused projection A [in, n_sub * r] and a block-diagonal B [n_sub * r, out]: lora_slots.SlotStack), in ``dtype``."""
    outs, ins = sub_outputs(model_config), in_features(model_config)
    per_layer = sum(len(o) * rank * (ins[p] + sum(o)) for p, o in outs.items())
    return per_layer * model_config.num_layers * torch.empty((), dtype=dtype).element_size()
