"""Model families behind the torch runner: the model class of a ``ModelConfig.architecture``. A new family is a
class with ``LlamaModel``'s constructor and ``forward`` (model.py) added to ``FAMILIES``; the engine and the
runner do not change."""

from __future__ import annotations

import torch

from .arch_spec import ModelConfig
from .gemma import GemmaModel
from .model import LlamaModel, QkNormModel
from .moe import MixtralModel, Qwen2MoeModel, Qwen3MoeModel

# ModelConfig.architecture -> model class. Qwen2 is Llama with Q/K/V biases (a spec field LlamaModel resolves at
# build time); Qwen3 adds per-head q/k norms (QkNormModel). arch_spec.py resolves the spec from the file.
FAMILIES = {"llama": LlamaModel, "qwen2": LlamaModel, "qwen3": QkNormModel,
            # Mistral: Llama with a sliding window; Phi-3: fused projections split by the loaders, LongRoPE, a
            # window (spec fields LlamaModel resolves; decision 0046)
            "mistral": LlamaModel, "phi3": LlamaModel,
            # Gemma 2 / 3 text: sandwich norms, GeGLU, soft-caps, per-layer windows (gemma.py; torch path)
            "gemma2": GemmaModel, "gemma3_text": GemmaModel,
            "mixtral": MixtralModel, "qwen2_moe": Qwen2MoeModel, "qwen3_moe": Qwen3MoeModel}  # mixture of experts: moe.py


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int, make_linear=None,
                native_kernels: bool = True):
    """The model of ``config``'s family over ``weights`` (model.py names; consumed) with RoPE tables for
    ``max_positions`` positions; ``make_linear(weight, name)`` builds the projections (quant.py),
    ``native_kernels``: the C++ CPU kernels where they apply. ValueError for an unknown architecture."""
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise ValueError(f"no model family for architecture {config.architecture!r} (known: {sorted(FAMILIES)})")
    if family is QkNormModel and not config.qk_norm:  # a spec with the feature switched off (negative controls)
        family = LlamaModel
    if config.tie_word_embeddings:
        weights.setdefault("lm_head", weights["embed"])
    return family(config, weights, max_positions, make_linear, native_kernels)
