"""The architecture spec of a model (``ModelConfig``), resolved once at load time from a Hugging Face
``config.json`` or from GGUF metadata (decision 0041).

Families: ``llama`` (Llama 2 and 3.x, SmolLM2), ``qwen2`` (Qwen2 / 2.5), ``qwen3`` (dense Qwen3), ``mistral``
(sliding window), ``phi3`` (fused projections, LongRoPE: decision 0046; Gemma 2 / 3 text: gemma.py), ``mixtral``,
``qwen2_moe`` and ``qwen3_moe`` (mixtures of experts, decision 0047; in a GGUF ``llama`` with ``expert_count``,
``qwen2moe`` and ``qwen3moe``). The
features that set them apart are fields of the spec, and the torch model (model.py) turns them into its
module structure when it is built, so the llama decode path carries no per-call test for them:

* ``qkv_bias``: bias on the Q, K and V projections (Qwen2);
* ``qk_norm``: per-head RMSNorm of queries and keys before RoPE (Qwen3);
* ``head_dim``: independent of ``hidden_size / num_heads`` (Qwen3: 128 with hidden 1024 and 16 heads);
* ``tie_word_embeddings``: the LM head is the token embedding;
* RoPE scaling ``rope_scaling``: None, ``"linear"`` (positions divided by ``rope_factor``), ``"dynamic"``
  (NTK-aware base, recomputed for a sequence longer than ``rope_original_max_positions``, as transformers'
  ``dynamic_rope_update``) or ``"llama3"`` (frequency bands, ``rope_low_freq_factor`` /
  ``rope_high_freq_factor``; from a GGUF, the per-frequency divisors of its ``rope_freqs`` tensor) or
  ``"longrope"`` (Phi-3: short / long factors and an attention factor, rope.py);
* ``sliding_window``: a query at position p attends to keys p - window + 1 .. p (Mistral, Phi-3).
* mixture of experts (``mixtral``, ``qwen3_moe``; decision 0047): ``num_experts``, ``num_experts_per_tok``,
  ``norm_topk_prob`` and ``shared_ffn_size``; ``ffn_size`` is then one expert's inner size. The model's MLP
  blocks are moe.py's.

Anything else is refused (``UnsupportedModel``, a ValueError naming the field or tensor): an unknown
``model_type`` / ``general.architecture``, a RoPE type, an activation other than SiLU, attention or MLP bias
where the family has none, Qwen2's per-layer sliding windows, partial rotary dimensions. A model is never served
with a feature silently left out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")  # mixture-of-experts MLPs (moe.py, decision 0047)
GGUF_ARCHES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # llama.cpp's general.architecture -> our family (Mixtral: llama + experts)
GEMMA_GGUF = {"gemma2": "gemma2", "gemma3": "gemma3_text"}  # likewise; their windows, caps, scale: gemma.py from_gguf
ROPE_SCALINGS = (None, "linear", "dynamic", "llama3", "longrope")


class UnsupportedModel(ValueError):
    """A model file or config the engine refuses; the message names the field, value or tensor."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a model (module docstring); the torch runner builds its model from it
    (model_families.py). Fields after ``tie_word_embeddings`` default to plain Llama."""

    num_layers: int  # transformer blocks
    hidden_size: int  # d_model
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per-head size (Qwen3: not hidden_size // num_heads)
    ffn_size: int  # SwiGLU inner size
    vocab_size: int  # embedding rows
    context_length: int  # positions the model serves (tokens)
    rope_theta: float  # RoPE base
    rms_eps: float  # RMSNorm epsilon
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eot_token_id: int | None = None  # end-of-turn id when the file has one
    architecture: str = "llama"  # model family: one of FAMILIES (model_families.FAMILIES)
    tie_word_embeddings: bool = False  # True: the LM head is the token embedding (no output / lm_head tensor)
    qkv_bias: bool = False  # Q/K/V projections have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE (Qwen3)
    rope_scaling: str | None = None  # one of ROPE_SCALINGS
    rope_factor: float = 1.0  # linear / dynamic / llama3 factor
    rope_original_max_positions: int = 0  # dynamic: scaling starts beyond it; llama3: the band edges
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_freq_factors: tuple[float, ...] | None = None  # llama3 from GGUF ``rope_freqs``: inv_freq divisors
    generation_eos_ids: tuple[int, ...] = ()  # extra stop ids of generation_config.json
    # decision 0046: a query at position p attends to keys at positions > p - sliding_window (Mistral, Phi-3)
    sliding_window: int | None = None  # tokens; None = full causal attention
    rope_short_factors: tuple[float, ...] | None = None  # longrope: inv_freq divisors within the original length
    rope_long_factors: tuple[float, ...] | None = None  # longrope: divisors beyond it
    rope_attention_factor: float = 1.0  # longrope: cos / sin multiplied by it
    # Gemma 2 / 3 (gemma.py)
    layer_windows: tuple[int, ...] | None = None  # per layer: its sliding window (tokens) or 0 (full attention)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    attn_softcap: float | None = None  # attention logits -> cap * tanh(s / cap)
    final_softcap: float | None = None  # final logits likewise
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers (plain RoPE)
    # Mixture of experts (moe.py): 0 experts = a dense SwiGLU MLP. With experts, ``ffn_size`` is one expert's
    # inner size (Mixtral ``intermediate_size``, Qwen3-MoE ``moe_intermediate_size``).
    num_experts: int = 0  # routed experts per layer
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    norm_topk_prob: bool = True  # renormalise the top-k softmax probabilities to sum to 1
    shared_ffn_size: int = 0  # inner size of a shared expert beside the routed ones (Qwen2-MoE style); 0 = none

    def __post_init__(self) -> None:  # JSON (the weights cache) gives lists: keep the dataclass hashable
        for name in ("rope_freq_factors", "generation_eos_ids", "rope_short_factors", "rope_long_factors",
                     "layer_windows"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if self.rope_scaling not in ROPE_SCALINGS:
            raise UnsupportedModel(f"rope_scaling type {self.rope_scaling!r} is not supported (supported: "
                                   "linear, dynamic, llama3, longrope)")

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """From ``dataclasses.asdict`` output (unknown keys ignored: an older cache entry is read again)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def kv_release_window(config: ModelConfig | None) -> int | None:
    """The window (tokens) every layer's attention stays within, or None: the span behind which a sequence's KV
    blocks may be released (block_manager.release_before_window). A model with full-attention layers beside
    sliding ones (Gemma's ``layer_windows`` with a 0) has none: its full layers read every key."""
    if config is None:
        return None
    if config.layer_windows is None:
        return config.sliding_window
    return max(config.layer_windows) if all(config.layer_windows) else None


def native_unsupported(config: ModelConfig) -> str | None:
    """Why the native CPU kernels (cpu_kernels.py: fused RMSNorm + RoPE + K/V write, paged decode attention)
    cannot run this model, or None when they can. Their RoPE reads one static cos/sin table by position, and
    their fused projection-to-cache step has no place for a per-head norm."""
    if config.architecture in ("gemma2", "gemma3_text"):
        return ("Gemma's sandwich norms, GeGLU and per-layer RoPE are not in the fused native kernels (its decode "
                "attention, soft-cap and windows included, runs the native paged kernel)")
    if config.num_experts:
        return "mixture-of-experts MLP blocks (moe.py) run on the torch path"
    if config.qk_norm:
        return "q/k RMSNorm (qwen3) is not in the native kernels"
    if config.rope_scaling == "dynamic":
        return "dynamic NTK RoPE depends on the sequence length; the native kernels read one static table"
    return None


# ------------------------------------------------------------------------------------------------ RoPE


def base_inv_freq(config: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """float32 [head_dim / 2] inverse frequencies, computed as transformers does."""
    base = config.rope_theta if theta is None else theta
    dim = config.head_dim
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The static inverse frequencies of ``config`` (float32 [head_dim / 2]); for ``dynamic`` those below the
    original length (the model recomputes them beyond it: ``dynamic_inv_freq``)."""
    inv = base_inv_freq(config)
    kind = config.rope_scaling
    if kind == "linear":
        return inv / config.rope_factor
    if kind == "llama3":
        if config.rope_freq_factors is not None:  # GGUF: llama.cpp's per-frequency divisors
            factors = torch.tensor(config.rope_freq_factors, dtype=torch.float32)
            if factors.numel() != inv.numel():
                raise UnsupportedModel(f"rope_freqs has {factors.numel()} entries, head_dim {config.head_dim} "
                                       f"needs {inv.numel()}")
            return inv / factors
        return _llama3(inv, config)
    return inv


def _llama3(inv_freq: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``, expression for expression (float32)."""
    factor, low, high, old = c.rope_factor, c.rope_low_freq_factor, c.rope_high_freq_factor, \
        c.rope_original_max_positions
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def llama3_freq_factors(config: ModelConfig) -> list[float]:
    """llama.cpp's ``rope_freqs`` for a llama3-scaled config (convert_hf_to_gguf.py, LlamaModel): the divisor
    of each base inverse frequency."""
    inv = base_inv_freq(config)
    return (inv / _llama3(inv, config)).tolist()


def dynamic_inv_freq(config: ModelConfig, seq_len: torch.Tensor) -> torch.Tensor:
    """NTK-aware inverse frequencies [len(seq_len), head_dim / 2] for sequences of ``seq_len`` tokens (int64
    [n]), as transformers' ``_compute_dynamic_ntk_parameters`` (the original table at or below the original
    length)."""
    orig, factor, dim = config.rope_original_max_positions, config.rope_factor, config.head_dim
    s = torch.maximum(seq_len, torch.tensor(orig, dtype=seq_len.dtype))
    base = config.rope_theta * ((factor * s / orig) - (factor - 1)) ** (dim / (dim - 2))  # float32 [n]
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (base.unsqueeze(1) ** exps.unsqueeze(0))
    return torch.where((seq_len > orig).unsqueeze(1), inv, base_inv_freq(config).unsqueeze(0))


# ------------------------------------------------------------------------------------------------ weights


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{our weight name: shape} of every tensor the model needs (model.py names); ``lm_head`` only when untied."""
    d, hd, f = config.hidden_size, config.head_dim, config.ffn_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"embed": (config.vocab_size, d), "norm": (d,)}
    if not config.tie_word_embeddings:
        out["lm_head"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm": (d,), p + "ffn_norm": (d,), p + "wq": (q, d), p + "wk": (kv, d),
                    p + "wv": (kv, d), p + "wo": (d, q), p + "w_gate": (f, d), p + "w_up": (f, d),
                    p + "w_down": (d, f)})
        if config.qkv_bias:
            out.update({p + "bq": (q,), p + "bk": (kv,), p + "bv": (kv,)})
        if config.qk_norm:
            out.update({p + "q_norm": (hd,), p + "k_norm": (hd,)})
        if config.architecture in ("gemma2", "gemma3_text"):  # sandwich norms (gemma.py)
            out.update({p + "post_attn_norm": (d,), p + "post_ffn_norm": (d,)})
        if config.num_experts:
            _moe_weights(out, p, config)
    return out


def _moe_weights(out: dict, p: str, config: ModelConfig) -> None:
    """Replace layer ``p``'s dense MLP in ``out`` by the router ``router`` [E, d], the stacked experts
    ``exp_gate`` / ``exp_up`` [E, f, d] and ``exp_down`` [E, d, f] (llama.cpp's ``*_exps`` layout; a Hugging
    Face directory's per-expert tensors are stacked by hf_loader) and, with ``shared_ffn_size``, the shared
    expert ``shexp_gate`` / ``shexp_up`` [fs, d], ``shexp_down`` [d, fs] and its gate ``shexp_router`` [1, d]."""
    d, f, e, fs = config.hidden_size, config.ffn_size, config.num_experts, config.shared_ffn_size
    for name in ("w_gate", "w_up", "w_down"):
        del out[p + name]
    out.update({p + "router": (e, d), p + "exp_gate": (e, f, d), p + "exp_up": (e, f, d), p + "exp_down": (e, d, f)})
    if fs:
        out.update({p + "shexp_gate": (fs, d), p + "shexp_up": (fs, d), p + "shexp_down": (d, fs),
                    p + "shexp_router": (1, d)})


def check_tensors(config: ModelConfig, found: dict[str, tuple[tuple[int, ...], str]], where: str,
                  name_in_file=None) -> None:
    """Every expected tensor present with its shape, nothing else: ``found`` maps our names to (shape, the
    file's own tensor name); ``name_in_file(ours)``: the file's name of a missing one. UnsupportedModel naming the
    first missing, unexpected or misshapen tensor."""
    expected = expected_weights(config)
    for name, (shape, file_name) in found.items():
        if name not in expected:
            why = ("the config ties the LM head to the embedding (tie_word_embeddings)" if name == "lm_head"
                   else "not a weight of this architecture")
            raise UnsupportedModel(f"{where}: unexpected tensor {file_name!r} ({why})")
        if tuple(shape) != expected[name]:
            raise UnsupportedModel(f"{where}: tensor {file_name!r} has shape {list(shape)}, the config needs "
                                   f"{list(expected[name])}")
    missing = [n for n in expected if n not in found]
    if missing:
        name = name_in_file(missing[0]) if name_in_file else missing[0]
        raise UnsupportedModel(f"{where}: missing tensor {name!r} ({len(missing)} missing in all; the "
                               f"{config.architecture} config needs it)")


# ------------------------------------------------------------------------------------------------ config.json


def from_hf_config(cfg: dict, generation: dict | None = None) -> ModelConfig:
    """The spec of a Hugging Face ``config.json`` (transformers 4.x ``rope_scaling`` / ``rope_theta`` or 5.x
    ``rope_parameters``), ``generation``: its ``generation_config.json``. UnsupportedModel names the field."""
    arch = cfg.get("model_type")
    if arch not in FAMILIES:
        raise UnsupportedModel(f"config.json: model_type {arch!r} is not supported (supported: {', '.join(FAMILIES)})")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise UnsupportedModel("config.json: mlp_bias true is not supported")
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedModel("config.json: attention_bias true is not supported (bias on the output projection)")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModel("config.json: use_sliding_window true is not supported")
    extra = _sliding_window_hf(cfg) if arch in ("mistral", "phi3") else {}
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnsupportedModel("config.json: partial_rotary_factor is not supported (RoPE on every dimension)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    scaling: dict = {}
    if kind == "default":
        pass
    elif kind in ("longrope", "su") and arch == "phi3":  # rope.py; transformers 4.x "su" is LongRoPE
        scaling = longrope_hf(cfg, rope, head_dim, max_pos)
    elif kind in ("linear", "dynamic", "llama3"):
        if "factor" not in rope:
            raise UnsupportedModel(f"config.json: rope scaling {kind!r} without 'factor'")
        scaling = {"rope_scaling": kind, "rope_factor": float(rope["factor"])}
        if kind == "dynamic":  # transformers scales beyond max_position_embeddings
            scaling["rope_original_max_positions"] = max_pos
            max_pos = int(max_pos * float(rope["factor"]))
        elif kind == "llama3":
            scaling.update(rope_original_max_positions=int(rope.get("original_max_position_embeddings", max_pos)),
                           rope_low_freq_factor=float(rope["low_freq_factor"]),
                           rope_high_freq_factor=float(rope["high_freq_factor"]))
    else:
        raise UnsupportedModel(f"config.json: rope_scaling type {kind!r} is not supported "
                               "(supported: default, linear, dynamic, llama3; longrope for phi3)")
    gen = generation or {}
    eos = cfg.get("eos_token_id") if gen.get("eos_token_id") is None else gen.get("eos_token_id")
    eos_list = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    return _moe_from_hf(cfg, arch, ModelConfig(
        num_layers=int(cfg["num_hidden_layers"]), hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        ffn_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]), context_length=max_pos,
        rope_theta=theta, rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        bos_token_id=None if bos is None else int(bos), eos_token_id=eos_list[0] if eos_list else None,
        architecture=arch, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),  # the three classes' default
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias")), qk_norm=arch == "qwen3",
        generation_eos_ids=tuple(eos_list[1:]), **scaling, **extra))


def _sliding_window_hf(cfg: dict) -> dict:
    """``sliding_window`` of a Mistral / Phi-3 ``config.json`` (transformers applies it whenever it is not null:
    ``masking_utils.sliding_window_overlay``, keys at positions > p - window)."""
    window = cfg.get("sliding_window")
    if window is None:
        return {}
    if int(window) < 1:
        raise UnsupportedModel(f"config.json: sliding_window {window!r} is not a positive number of tokens")
    return {"sliding_window": int(window)}


def longrope_hf(cfg: dict, rope: dict, head_dim: int, max_pos: int) -> dict:
    """The LongRoPE fields of a Phi-3 ``config.json`` (transformers' ``_compute_longrope_parameters``:
    ``original_max_position_embeddings`` at the top level wins over the rope dict's; ``factor`` defaults to
    max / original; ``attention_factor`` defaults to sqrt(1 + ln(factor) / ln(original)), 1 for factor <= 1).
    UnsupportedModel names a missing or misshapen field."""
    orig = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    if not orig:
        raise UnsupportedModel("config.json: longrope without original_max_position_embeddings")
    orig = int(orig)
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = rope.get(key)
        if not isinstance(value, list) or len(value) != head_dim // 2:
            raise UnsupportedModel(f"config.json: rope scaling longrope {key} must be a list of {head_dim // 2} "
                                   f"numbers (head_dim {head_dim})")
        factors[key] = tuple(float(x) for x in value)
    factor = float(rope.get("factor") or max_pos / orig)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_scaling": "longrope", "rope_factor": factor, "rope_original_max_positions": orig,
            "rope_short_factors": factors["short_factor"], "rope_long_factors": factors["long_factor"],
            "rope_attention_factor": float(attention)}


# ------------------------------------------------------------------------------------------------ fused


# Phi-3 packs Q/K/V and gate/up into one tensor each (HF ``qkv_proj`` / ``gate_up_proj``, GGUF ``attn_qkv`` /
# ``ffn_up``): the loaders account for and split them into our names; the model fuses them again (model.py).
FUSED = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}


def _fused_rows(config: ModelConfig, short: str) -> list[int]:
    q, kv, f = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.ffn_size
    return [q, kv, kv] if short == "wqkv" else [f, f]


def unfuse_found(config: ModelConfig, ours: str, shape: tuple[int, ...], file_name: str) -> dict:
    """``{part name: (shape, file name)}`` of the fused tensor ``ours`` (``layers.{i}.wqkv`` / ``w_gate_up``) of
    ``shape`` (for check_tensors); UnsupportedModel naming the tensor when its rows do not split as the config
    says."""
    prefix, short = ours.rsplit(".", 1)
    rows = _fused_rows(config, short)
    if len(shape) != 2 or shape[0] != sum(rows) or shape[1] != config.hidden_size:
        raise UnsupportedModel(f"tensor {file_name!r} has shape {list(shape)}, the config needs "
                               f"[{sum(rows)}, {config.hidden_size}]")
    return {f"{prefix}.{part}": ((r, shape[1]), file_name) for part, r in zip(FUSED[short], rows)}


def split_fused(config: ModelConfig, ours: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parts (our names, row blocks of ``tensor`` [rows, d], each its own storage) of a fused tensor."""
    prefix, short = ours.rsplit(".", 1)
    parts = torch.split(tensor, _fused_rows(config, short))
    return {f"{prefix}.{name}": part.clone() for name, part in zip(FUSED[short], parts)}


def _moe_from_hf(cfg: dict, arch: str, spec: ModelConfig) -> ModelConfig:
    """``spec`` with the mixture-of-experts fields of a ``mixtral`` / ``qwen2_moe`` / ``qwen3_moe`` config.json
    (unchanged for the dense families). Mixtral always renormalises its top-k (transformers'
    ``MixtralTopKRouter``); Qwen2/3-MoE as ``norm_topk_prob`` says (default false); Qwen2-MoE has Q/K/V biases
    (``qkv_bias``, default true) and a shared expert of ``shared_expert_intermediate_size``. UnsupportedModel names a field the engine does not model: dense layers among
    sparse ones (``decoder_sparse_step`` other than 1, ``mlp_only_layers``), a sliding window, top-k outside
    1..experts."""
    if arch not in MOE_FAMILIES:
        return spec
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise UnsupportedModel(f"config.json: num_experts {experts} / num_experts_per_tok {top_k}: need "
                               "1 <= num_experts_per_tok <= experts")
    if cfg.get("sliding_window") is not None and arch == "mixtral":
        raise UnsupportedModel(f"config.json: sliding_window {cfg['sliding_window']} is not supported for mixtral")
    changes: dict = {"num_experts": experts, "num_experts_per_tok": top_k}
    if arch == "mixtral":
        changes["norm_topk_prob"] = True
    else:  # qwen2_moe, qwen3_moe
        if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
            raise UnsupportedModel("config.json: decoder_sparse_step / mlp_only_layers (dense MLP layers among the "
                                   "mixture-of-experts ones) are not supported")
        changes.update(norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), qk_norm=arch == "qwen3_moe",
                       ffn_size=int(cfg["moe_intermediate_size"]))
        if arch == "qwen2_moe":
            changes.update(qkv_bias=bool(cfg.get("qkv_bias", True)),
                           shared_ffn_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    return dataclasses.replace(spec, **changes)


# ------------------------------------------------------------------------------------------------ GGUF


# GGUF general.architecture values (llama.cpp writes Mistral as ``llama``: convert_hf_to_gguf.py registers
# MistralForCausalLM with LlamaModel and writes no sliding window for it; decision 0046)
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "phi3")
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # llama.cpp's Phi-3 LongRoPE


def _gguf_window_and_longrope(reader, arch: str, names: dict, ctx: int, head_dim: int) -> dict:
    """``{arch}.attention.sliding_window`` (> 0: a window; 0 or absent: none) and Phi-3's LongRoPE (the
    ``rope_factors_long`` / ``rope_factors_short`` tensors, ``rope.scaling.original_context_length``,
    ``rope.scaling.attn_factor``: llama.cpp's conversion/phi.py). UnsupportedModel names a key or tensor."""
    p, out = arch + ".", {}
    window = None if arch in GEMMA_GGUF else _field(reader, p + "attention.sliding_window")  # gemma.py reads it
    if window is not None and int(window) > 0:
        if arch not in ("llama", "phi3"):
            raise UnsupportedModel(f"GGUF {p}attention.sliding_window {window} is not supported for {arch}")
        out["sliding_window"] = int(window)
    present = [n for n in LONGROPE_TENSORS if n in names]
    if not present:
        return out
    if arch != "phi3" or len(present) != 2:
        raise UnsupportedModel(f"GGUF tensor {present[0]!r}: LongRoPE needs phi3 and both rope_factors_long and "
                               f"rope_factors_short ({arch}, found {present})")
    from gguf.quants import dequantize

    long_f, short_f = (tuple(float(x) for x in dequantize(names[n].data, names[n].tensor_type).reshape(-1))
                       for n in LONGROPE_TENSORS)
    if len(long_f) != head_dim // 2 or len(short_f) != head_dim // 2:
        raise UnsupportedModel(f"GGUF rope_factors_long / short have {len(long_f)} / {len(short_f)} entries, "
                               f"head_dim {head_dim} needs {head_dim // 2}")
    orig = _field(reader, p + "rope.scaling.original_context_length")
    if not orig:
        raise UnsupportedModel(f"GGUF LongRoPE without {p}rope.scaling.original_context_length")
    factor = ctx / int(orig)
    attn = _field(reader, p + "rope.scaling.attn_factor")
    if attn is None:  # llama.cpp's formula (conversion/phi.py), as transformers' default
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(orig)))
    out.update(rope_scaling="longrope", rope_factor=factor, rope_original_max_positions=int(orig),
               rope_long_factors=long_f, rope_short_factors=short_f, rope_attention_factor=float(attn))
    return out


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def from_gguf(reader) -> ModelConfig:
    """The spec of an open ``gguf.GGUFReader`` (llama.cpp's keys ``{arch}.*``; ``rope_freqs`` read here for
    llama3 scaling). UnsupportedModel names the key."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_FAMILIES and arch not in GGUF_ARCHES and arch not in GEMMA_GGUF:
        raise UnsupportedModel(f"GGUF general.architecture {arch!r} is not supported (supported: "
                               f"{', '.join((*GGUF_FAMILIES, *GGUF_ARCHES, *GEMMA_GGUF))})")
    p = arch + "."
    hidden, heads = int(_field(reader, p + "embedding_length")), int(_field(reader, p + "attention.head_count"))
    head_dim = int(_field(reader, p + "attention.key_length", 0) or _field(reader, p + "rope.dimension_count", 0)
                   or hidden // heads)
    value_len = _field(reader, p + "attention.value_length")
    if value_len is not None and int(value_len) != head_dim:
        raise UnsupportedModel(f"GGUF {p}attention.value_length {value_len} differs from key_length {head_dim}")
    rot = _field(reader, p + "rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise UnsupportedModel(f"GGUF {p}rope.dimension_count {rot}: partial rotary embeddings are not supported "
                               f"(head_dim {head_dim})")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, p + "vocab_size") or (len(tokens.data) if tokens else None)
    names = {t.name: t for t in reader.tensors}
    scaling: dict = {}
    kind = _field(reader, p + "rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedModel(f"GGUF {p}rope.scaling.type {kind!r} is not supported (supported: none, linear; "
                                   "llama3 through the rope_freqs tensor)")
        scaling = {"rope_scaling": "linear", "rope_factor": float(_field(reader, p + "rope.scaling.factor"))}
    if "rope_freqs.weight" in names:
        if arch != "llama" or scaling:
            raise UnsupportedModel(f"GGUF tensor 'rope_freqs.weight' with {arch} / rope scaling {kind!r} is not "
                                   "supported (llama3 scaling of llama models only)")
        from gguf.quants import dequantize

        t = names["rope_freqs.weight"]
        factors = dequantize(t.data, t.tensor_type).astype("float32").reshape(-1)
        scaling = {"rope_scaling": "llama3", "rope_freq_factors": tuple(float(x) for x in factors),
                   "rope_factor": float(_field(reader, p + "rope.scaling.factor", 1.0) or 1.0)}
    ctx = int(_field(reader, p + "context_length", 2048))
    extra = _gguf_window_and_longrope(reader, arch, names, ctx, head_dim)
    if scaling and "rope_scaling" in extra:
        raise UnsupportedModel(f"GGUF {p}rope.scaling.type {kind!r} beside LongRoPE factors is not supported")
    return _moe_from_gguf(reader, p, ModelConfig(
        num_layers=int(_field(reader, p + "block_count")), hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)), head_dim=head_dim,
        ffn_size=int(_field(reader, p + "feed_forward_length")), vocab_size=int(vocab), context_length=ctx,
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        eot_token_id=_field(reader, "tokenizer.ggml.eot_token_id"),
        architecture=arch, tie_word_embeddings="output.weight" not in names,
        qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", **scaling, **extra))


def _moe_from_gguf(reader, p: str, spec: ModelConfig) -> ModelConfig:
    """``spec`` with llama.cpp's mixture-of-experts keys (``{arch}.expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``, ``expert_weights_norm``): a ``llama`` file with experts is Mixtral, a
    ``qwen3moe`` file Qwen3-MoE. Renormalisation of the top-k follows ``expert_weights_norm`` where the file has
    it, else llama.cpp's own graphs (llama and qwen3moe renormalise, qwen2moe does not: src/models/llama.cpp,
    qwen3moe.cpp, qwen2moe.cpp; its shared expert defaults to ``feed_forward_length``).
    A ``qwen2moe`` file has Q/K/V biases and a shared expert of ``expert_shared_feed_forward_length``.
    UnsupportedModel names a key the engine does not model (a gating function other than softmax, an expert
    weight scale, leading dense blocks, shared experts outside qwen2moe)."""
    experts = int(_field(reader, p + "expert_count", 0) or 0)
    arch = GGUF_ARCHES.get(spec.architecture, spec.architecture)
    if arch == "llama" and experts:
        arch = "mixtral"
    if arch not in MOE_FAMILIES:
        return spec
    top_k = int(_field(reader, p + "expert_used_count", 0) or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise UnsupportedModel(f"GGUF {p}expert_count {experts} / {p}expert_used_count {top_k}: need "
                               "1 <= expert_used_count <= expert_count")
    gating = _field(reader, p + "expert_gating_func")
    if gating not in (None, 1):  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise UnsupportedModel(f"GGUF {p}expert_gating_func {gating} is not supported (softmax only)")
    scale = _field(reader, p + "expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise UnsupportedModel(f"GGUF {p}expert_weights_scale {scale} is not supported")
    for key in ("leading_dense_block_count", "expert_shared_count", "expert_shared_feed_forward_length"):
        if _field(reader, p + key) and not (arch == "qwen2_moe" and key == "expert_shared_feed_forward_length"):
            raise UnsupportedModel(f"GGUF {p}{key} is not supported for {arch}")
    norm = _field(reader, p + "expert_weights_norm")
    ffn = int(_field(reader, p + "expert_feed_forward_length", 0) or spec.ffn_size)
    return dataclasses.replace(spec, architecture=arch, num_experts=experts, num_experts_per_tok=top_k,
                               norm_topk_prob=arch != "qwen2_moe" if norm is None else bool(norm), ffn_size=ffn,
                               qk_norm=arch == "qwen3_moe", qkv_bias=arch == "qwen2_moe",
                               shared_ffn_size=0 if arch != "qwen2_moe" else
                               int(_field(reader, p + "expert_shared_feed_forward_length", 0) or spec.ffn_size))
