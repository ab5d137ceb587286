"""Tiny random-weight models of every supported family, built with transformers at test time (issue [20] item 5).

Each variant exercises spec features (arch_spec.py) where a missing one cannot hide:

* weights scaled so the logits have a standard deviation above 1 and attention is sharp (Q/K projections,
  and for Qwen3 the q/k norm weights, scaled up: at transformers' default init attention is near-uniform
  and a wrong RoPE barely moves the logits);
* norm weights and biases perturbed away from their defaults (1 and 0);
* scaled RoPE variants have ``original_max_position_embeddings`` 32, and the tests' prompts are longer.

``build(variant, folder)`` saves the Hugging Face directory (config.json, model.safetensors,
generation_config.json; tokenizer files are not the engine's) and, for variants with a llama.cpp
convention, a GGUF of the same weights (``gguf.GGUFWriter``, llama.cpp's names, Q/K permutation for llama
only, ``rope_freqs`` for llama3 scaling, ``attention.key_length`` for an independent head_dim).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ORIG_MAX = 32  # original_max_position_embeddings of the scaled-RoPE variants


@dataclass(frozen=True)
class Variant:
    family: str  # model_type
    config: dict = field(default_factory=dict)  # extra config.json fields
    gguf: bool = True  # llama.cpp has a convention for it (dynamic NTK RoPE: none)
    qk_norm_centre: float = 3.0  # q/k norm weights ~ centre + N(0, 0.5): sharp attention, so the norms matter


VARIANTS = {
    # Llama 2 shape: untied head, linear RoPE scaling.
    "llama2": Variant("llama", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                                "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Llama 3.x: tied head (3.2-1B/3B), llama3 RoPE bands.
    "llama3": Variant("llama", {"tie_word_embeddings": True, "max_position_embeddings": 128, "rope_theta": 500000.0,
                                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": ORIG_MAX}}),
    # Dynamic NTK: transformers scales beyond max_position_embeddings (no GGUF convention in llama.cpp).
    "llama-dynamic": Variant("llama", {"tie_word_embeddings": False, "max_position_embeddings": ORIG_MAX,
                                       "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, gguf=False),
    # Qwen2 / 2.5: Q/K/V biases, tied head.
    "qwen2": Variant("qwen2", {"tie_word_embeddings": True, "max_position_embeddings": 128}),
    # Qwen3: per-head q/k norms, head_dim 128 with hidden 64 and 4 heads (not 16; Qwen3-0.6B: 1024 / 16 heads
    # and 128), untied head.
    "qwen3": Variant("qwen3", {"tie_word_embeddings": False, "max_position_embeddings": 128, "head_dim": 128}),
    # Plain Llama (no RoPE scaling): the one llama file transformers' GGUF reader can load faithfully (it drops
    # rope.scaling.* and rope_freqs).
    "llama-plain": Variant("llama", {"tie_word_embeddings": False, "max_position_embeddings": 128}),
}

# Issue [21] (decision 0046), kept apart from VARIANTS (their tests: tests/unit/test_engine_windows_longrope.py):
# Mistral with a sliding window of WINDOW tokens (prompts are longer); Phi-3 with fused projections and LongRoPE
# (original length ORIG_MAX, served up to 128: short and long factors both far from 1 so either matters).
WINDOW = 16
_HALF = 8  # head_dim 16 / 2
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(_HALF)],
            "long_factor": [1.0 + 2.5 * i for i in range(_HALF)]}
WINDOW_VARIANTS = {
    "mistral": Variant("mistral", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                                   "sliding_window": WINDOW}),
    "phi3": Variant("phi3", {"tie_word_embeddings": False, "max_position_embeddings": 128,
                             "original_max_position_embeddings": ORIG_MAX, "rope_scaling": dict(LONGROPE)}),
}


# Gemma 2 / 3 text (issue [22] item 1, directories only; tests/unit/test_engine_gemma.py): a window shorter than
# the prompts on one of two layers, caps low enough to bind, query_pre_attn_scalar unlike head_dim; Gemma 3 with
# q/k norms and a local RoPE base apart from the full layers' (scaled) one.
_GEMMA = {"max_position_embeddings": 128, "sliding_window": WINDOW, "query_pre_attn_scalar": 32, "head_dim": 16,
          "hidden_activation": "gelu_pytorch_tanh", "layer_types": ["sliding_attention", "full_attention"]}
GEMMA_VARIANTS = {
    "gemma2": Variant("gemma2", {**_GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}, gguf=False),
    "gemma3": Variant("gemma3_text", {**_GEMMA, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, gguf=False),
}

# The same features as GGUF files carry them (written here and by llama.cpp's converter: test_engine_gemma.py).
# GGUF has no query_pre_attn_scalar (llama.cpp scales by head_dim ** -0.5 below 27B sizes) nor layer types (its
# patterns: Gemma 2 alternates, Gemma 3 has a full layer every sixth): these variants are what such a file can say.
_GEMMA_GGUF = {**{k: v for k, v in _GEMMA.items() if k != "layer_types"}, "query_pre_attn_scalar": 16}
GEMMA_GGUF_VARIANTS = {
    "gemma2-gguf": Variant("gemma2", {**GEMMA_VARIANTS["gemma2"].config, "query_pre_attn_scalar": 16}),
    # q/k norm multipliers ~1 (Gemma's 1 + w, w ~ 0): at 3.0 (x4) six layers are ill-conditioned, transformers'
    # own float32 is 7.7e-4 from its float64 (1e-4 is the bound here)
    "gemma3-gguf": Variant("gemma3_text", {**_GEMMA_GGUF, "num_hidden_layers": 6,
                                           "rope_parameters": GEMMA_VARIANTS["gemma3"].config["rope_parameters"]},
                           qk_norm_centre=0.0),
}


def variant_of(name: str) -> Variant:
    """The variant ``name`` of VARIANTS, WINDOW_VARIANTS or GEMMA_VARIANTS (looked up at call time: tests add
    variants)."""
    for table in (VARIANTS, WINDOW_VARIANTS, GEMMA_VARIANTS, GEMMA_GGUF_VARIANTS):
        if name in table:
            return table[name]
    raise KeyError(name)


GGUF_ARCH = {"mistral": "llama", "gemma3_text": "gemma3"}  # llama.cpp's names of them (convert_hf_to_gguf.py)

# Scaled RoPE variants (feature: rope type) and the features each variant's negative control switches off.
FEATURES = {"llama2": ("rope",), "llama3": ("rope", "tie"), "llama-dynamic": ("rope",),
            "qwen2": ("qkv_bias", "tie"), "qwen3": ("qk_norm", "tie"), "llama-plain": ("tie",)}


def _hf_config(variant: Variant):
    from transformers import AutoConfig

    from bench.tiny_model import tiny_vocab

    base = dict(vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                pad_token_id=2, hidden_act="silu")
    base.update(variant.config)
    return AutoConfig.for_model(variant.family, **base)


def _scale(model, seed: int, qk_norm_centre: float = 3.0) -> None:
    """Scale / perturb the weights in place (module docstring); q/k norm weights centred on ``qk_norm_centre``."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda t, s: torch.randn(t.shape, generator=g) * s  # noqa: E731
    d = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                big = name.endswith(("q_norm.weight", "k_norm.weight"))
                p.copy_((qk_norm_centre if big else 1.0) + rnd(p, 0.5 if big else 0.2))
            elif name.endswith(".bias"):
                p.copy_(rnd(p, 0.5))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(rnd(p, 2.0 / d ** 0.5))
            elif name.endswith("qkv_proj.weight"):  # phi3: Q and K rows sharp as above, V rows as any projection
                qk = (model.config.num_attention_heads + model.config.num_key_value_heads) * (d // model.config.num_attention_heads)
                w = rnd(p, 1.0 / d ** 0.5)
                w[:qk] *= 2.0
                p.copy_(w)
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(rnd(p, 0.4))
            else:
                p.copy_(rnd(p, 1.0 / p.shape[1] ** 0.5))


def hf_model(name: str, seed: int = 0):
    """The transformers model of variant ``name`` (float32, eval)."""
    import transformers

    variant = variant_of(name)
    cfg = _hf_config(variant)
    torch.manual_seed(seed)
    eager = {"attn_implementation": "eager"} if cfg.model_type.startswith("gemma") else {}  # SDPA has no soft-cap
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **eager).eval()
    _scale(model, seed, variant.qk_norm_centre)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


def build(name: str, folder: str | os.PathLike, seed: int = 0) -> dict:
    """Save variant ``name`` under ``folder``: {"model": transformers model, "hf": directory, "gguf": file or
    None}."""
    folder = Path(folder)
    model = hf_model(name, seed)
    hf_dir = save_hf_dir(model, folder / f"{name}-hf")
    gguf_path = None
    if variant_of(name).gguf:
        gguf_path = str(folder / f"{name}.gguf")
        write_gguf(model, gguf_path)
    return {"model": model, "hf": str(hf_dir), "gguf": gguf_path}


def save_hf_dir(model, hf_dir: Path) -> Path:
    """Saves ``model`` as a Hugging Face directory ``hf_dir``: config.json, model.safetensors,
    generation_config.json and the tiny vocabulary's tokenizer.json (write_tokenizer_json). Returns ``hf_dir``."""
    model.save_pretrained(hf_dir, safe_serialization=True)
    model.generation_config.save_pretrained(hf_dir)
    write_tokenizer_json(str(hf_dir / "tokenizer.json"))
    return hf_dir


def write_tokenizer_json(path: str) -> str:
    """bench/tiny_model.py's byte-level BPE vocabulary (the GGUF's) as a ``tokenizer.json`` (tokenizers)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from bench.tiny_model import MERGES, SPECIAL_TOKENS, tiny_vocab

    tokens = tiny_vocab()[0]
    merges = [tuple(m.split(" ")) for m in MERGES]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tok.save(path)
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py ``LlamaModel.permute``: HF half-split rows -> llama.cpp interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
               "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}  # phi3


# Gemma's sandwich norms (llama.cpp's MODEL_TENSOR.ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM)
_GEMMA_GGUF_LAYER = {**_GGUF_LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 tensors of ``model`` (module docstring); Gemma's norm weights written as ``1 + w``
    (llama.cpp's conversion/gemma.py)."""
    cfg = model.config
    arch = GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    sd = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    gemma = arch in ("gemma2", "gemma3")
    if gemma:
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for name, arr in sd.items():
        parts = name.split(".", 3)
        if parts[:2] != ["model", "layers"]:
            continue
        gname = f"blk.{parts[2]}.{(_GEMMA_GGUF_LAYER if gemma else _GGUF_LAYER)[parts[3]]}"
        if arch == "llama" and gname.endswith("attn_q.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        out[gname] = np.ascontiguousarray(arr)
    return out


def add_gguf_hparams(w, cfg) -> dict:
    """Writes the hyperparameters every llama.cpp architecture here shares (block count, context, widths, heads,
    RoPE dimension and base, RMS epsilon; key/value lengths where head_dim is not hidden / heads) of the
    transformers config ``cfg`` to the GGUFWriter ``w``. Returns the config's ``rope_parameters`` (a dict; a Gemma 3
    config's full-attention set, its sliding set's base written as ``rope.freq_base_swa``)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    local = None
    if "full_attention" in rope:  # Gemma 3: the full layers' RoPE, the sliding layers' base apart (conversion/base.py)
        local = (rope.get("sliding_attention") or {}).get("rope_theta")
        rope = dict(rope["full_attention"])
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    if local is not None:
        w.add_rope_freq_base_swa(float(local))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    return rope


def write_gguf(model, path: str, extra_tensors: dict | None = None, drop: tuple = (), rope_type: str | None = None,
               extra_uint32: dict | None = None) -> str:
    """A GGUF of ``model``'s weights with llama.cpp's conventions; ``extra_tensors`` / ``drop`` / ``rope_type``
    (a ``rope.scaling.type`` string) / ``extra_uint32`` ({key: value}) make broken files for the refusal tests."""
    import gguf

    from actors.worker.engine import arch_spec

    cfg = model.config
    arch = GGUF_ARCH.get(cfg.model_type, cfg.model_type)
    w = gguf.GGUFWriter(path, arch)
    rope = add_gguf_hparams(w, cfg)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    kind = rope.get("rope_type", "default")
    tensors = gguf_tensors(model)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "llama3":  # llama.cpp: the per-frequency divisors as a tensor, no scaling type
        spec = arch_spec.from_hf_config(cfg.to_dict())
        tensors["rope_freqs.weight"] = np.array(arch_spec.llama3_freq_factors(spec), dtype=np.float32)
    elif kind == "longrope":  # llama.cpp's conversion/phi.py: factor tensors, original length, attention factor
        spec = arch_spec.from_hf_config(cfg.to_dict())
        tensors["rope_factors_long.weight"] = np.array(spec.rope_long_factors, dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(spec.rope_short_factors, dtype=np.float32)
        w.add_rope_scaling_orig_ctx_len(spec.rope_original_max_positions)
        w.add_rope_scaling_attn_factors(spec.rope_attention_factor)
    elif kind != "default":
        raise ValueError(f"no llama.cpp convention for rope type {kind!r}")
    if getattr(cfg, "sliding_window", None) and cfg.model_type in ("mistral", "phi3", "gemma2", "gemma3_text"):
        w.add_sliding_window(cfg.sliding_window)  # {arch}.attention.sliding_window (llama.cpp writes none for Mistral)
    if arch in ("gemma2", "gemma3"):  # as llama.cpp's conversion/gemma.py writes them
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, key, None):
                w.add_float32(f"{arch}.{key}", float(getattr(cfg, key)))
    for key, value in (extra_uint32 or {}).items():
        w.add_uint32(key, value)
    if rope_type is not None:
        w.add_string(f"{arch}.rope.scaling.type", rope_type)
    tensors.update(extra_tensors or {})
    return finish_gguf(w, path, tensors, drop)


def finish_gguf(w, path: str, tensors: dict, drop: tuple = ()) -> str:
    """Adds bench/tiny_model.py's vocabulary and ``tensors`` ({llama.cpp name: array}) but those named in ``drop`` to
    the GGUFWriter ``w``, writes the file and closes it. Returns ``path``."""
    from bench.tiny_model import _add_tokenizer

    _add_tokenizer(w)
    for name, arr in tensors.items():
        if name not in drop:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
