"""Gemma 2 and Gemma 3 (text) on the torch path (issue [22] item 1): Hugging Face directories and GGUF files.

What sets them apart from Llama (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size";
2025, "Gemma 3 Technical Report"; transformers' ``modeling_gemma2`` / ``modeling_gemma3``):

* RMSNorm weights are offsets: the norm multiplies by ``1 + w`` (folded into the weights at load, ``fold_norms``,
  as llama.cpp's converter does for its GGUF files), four norms per layer: before and after attention, before
  and after the MLP (the "after" ones normalise the block's output before the residual add);
* GeGLU MLP with the tanh GELU (``gelu_pytorch_tanh``); embeddings multiplied by ``sqrt(hidden_size)`` (in the
  model dtype);
* attention scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``; Gemma 2 soft-caps attention
  logits (``cap * tanh(s / cap)``, before the mask) and final logits;
* ``layer_types``: sliding-window layers (window ``sliding_window``, decision 0046) and full ones (Gemma 2
  alternating, Gemma 3 five to one); Gemma 3 rotates sliding layers with its local RoPE base and full ones with
  ``rope_theta`` and its scaling, and normalises q and k per head (``1 + w``) before RoPE.

Attention (``_attend``): the step's decodes together, each prefill chunk alone, K/V gathered from the paged cache;
a soft-capped layer computes its scores explicitly (scale, cap, mask, float32 softmax: SDPA cannot soft-cap), an
uncapped one runs SDPA with the same mask and scale. bench/softcap_bench.py measures the capped decode against the
same model with the caps removed. The fused native kernels do not run these models (arch_spec.native_unsupported);
the step's decodes go through the native paged decode attention where it builds (``_native_decodes``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from . import arch_spec, cpu_kernels
from .arch_spec import ModelConfig, UnsupportedModel
from .model import BatchMetadata, LlamaModel, RotaryEmbedding, _block_tables_from_slots, rms_norm

GEMMA_FAMILIES = ("gemma2", "gemma3_text")


# ------------------------------------------------------------------------------------------------ spec


def from_hf_config(cfg: dict, generation: dict | None = None) -> ModelConfig:
    """The spec of a Gemma 2 / Gemma 3 text ``config.json`` (module docstring). UnsupportedModel names a field
    the engine does not model: another activation, ``attention_bias``, bidirectional attention, a layer type
    other than sliding / full, a local RoPE with scaling."""
    arch = cfg.get("model_type")
    if arch not in GEMMA_FAMILIES:
        raise UnsupportedModel(f"config.json: model_type {arch!r} is not a Gemma text model")
    act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise UnsupportedModel(f"config.json: hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    for key in ("attention_bias", "use_bidirectional_attention"):
        if cfg.get(key):
            raise UnsupportedModel(f"config.json: {key} true is not supported")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % (2 if arch == "gemma2" else 6) else
                                       "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModel(f"config.json: layer_types {types!r} are not {layers} of sliding / full attention")
    window = int(cfg.get("sliding_window") or 0)
    if window < 1 and "sliding_attention" in types:
        raise UnsupportedModel(f"config.json: sliding_window {cfg.get('sliding_window')!r} with sliding layers")
    rope = dict(cfg.get("rope_parameters") or {})
    local_theta = None
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5.x: one set per layer type
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModel(f"config.json: sliding-layer rope_type {local.get('rope_type')!r} is not supported")
        local_theta = float(local["rope_theta"]) if "rope_theta" in local else None
        rope = dict(rope.get("full_attention") or {})
    elif arch == "gemma3_text" and cfg.get("rope_local_base_freq") is not None:  # transformers 4.x
        local_theta = float(cfg["rope_local_base_freq"])
    if arch == "gemma3_text" and local_theta is None:
        local_theta = 10000.0
    base = {k: v for k, v in cfg.items() if k not in ("model_type", "rope_parameters", "rope_scaling",
                                                      "layer_types", "sliding_window", "use_sliding_window")}
    spec = arch_spec.from_hf_config({**base, "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
                                     "rope_parameters": rope or None}, generation)
    head_dim = spec.head_dim
    return dataclasses.replace(
        spec, architecture=arch, qk_norm=arch == "gemma3_text",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=window or None,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        attn_softcap=_cap(cfg.get("attn_logit_softcapping")), final_softcap=_cap(cfg.get("final_logit_softcapping")),
        rope_local_theta=local_theta)


# llama.cpp's per-architecture conventions for Gemma GGUF files (src/models/gemma2.cpp, gemma3.cpp and
# llama-hparams.h of the llama.cpp sources docs/bench.md unpacks): the sliding-window pattern when the file has
# none (every 2nd / every 6th layer full), Gemma 2's default window and caps, and the block counts of the 27B
# models, whose attention is scaled by (hidden / heads) ** -0.5 instead of head_dim ** -0.5 (their
# query_pre_attn_scalar; GGUF files carry no such key).
_GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
_GGUF_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}
_GEMMA2_DEFAULTS = {"attention.sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_GEMMA3_SWA_THETA = 10000.0  # llama-hparams.h rope_freq_base_train_swa, when the file has no rope.freq_base_swa


def from_gguf(fields: dict, spec: ModelConfig) -> ModelConfig:
    """The spec of a ``gemma2`` / ``gemma3`` GGUF file: ``spec`` as arch_spec.from_gguf read the shared keys,
    completed from ``fields`` ({key: value} of the file's metadata) with llama.cpp's meaning of its Gemma keys
    (constants above): windows per layer (``attention.sliding_window``, ``attention.sliding_window_pattern`` as a
    period or a per-layer array), soft-caps, the local RoPE base (``rope.freq_base_swa``), the attention scale.
    Norm weights are already ``1 + w`` in such files (the converter folds them). UnsupportedModel names a key the
    engine does not model (Gemma 3 attention soft-capping, a per-layer array of the wrong length)."""
    gguf_arch = spec.architecture
    p = gguf_arch + "."
    get = lambda key, default=None: fields.get(p + key, default)  # noqa: E731
    defaults = _GEMMA2_DEFAULTS if gguf_arch == "gemma2" else {}
    window = int(get("attention.sliding_window", defaults.get("attention.sliding_window", 0)) or 0)
    if gguf_arch == "gemma2" and window < 1:  # llama.cpp keeps Gemma 2's sliding layers and masks every key on them
        raise UnsupportedModel(f"GGUF {p}attention.sliding_window {window}: Gemma 2's sliding layers need a window "
                               ">= 1 (llama.cpp would mask every key of those layers)")
    swa = _swa_layers(get("attention.sliding_window_pattern", _GGUF_PATTERN[gguf_arch]), spec.num_layers, p)
    if gguf_arch == "gemma3" and get("attn_logit_softcapping") is not None:
        raise UnsupportedModel(f"GGUF {p}attn_logit_softcapping: Gemma 3 has no attention soft-capping "
                               "(llama.cpp ignores the key; this engine does not guess)")
    windows = tuple(window if s else 0 for s in swa) if window > 0 else (0,) * spec.num_layers
    local = get("rope.freq_base_swa")
    if gguf_arch == "gemma3":
        local = float(local if local is not None else _GEMMA3_SWA_THETA) if window > 0 else None
    elif local is not None and float(local) != spec.rope_theta:
        raise UnsupportedModel(f"GGUF {p}rope.freq_base_swa {local}: Gemma 2 rotates every layer with one base")
    big = spec.num_layers == _GGUF_27B_BLOCKS[gguf_arch]
    return dataclasses.replace(
        spec, architecture=arch_spec.GEMMA_GGUF[gguf_arch], qk_norm=gguf_arch == "gemma3",
        sliding_window=window or None, layer_windows=windows, rope_local_theta=local,
        query_pre_attn_scalar=float(spec.hidden_size // spec.num_heads if big else spec.head_dim),
        attn_softcap=_cap(get("attn_logit_softcapping", defaults.get("attn_logit_softcapping"))),
        final_softcap=_cap(get("final_logit_softcapping", defaults.get("final_logit_softcapping"))))


def _swa_layers(pattern, layers: int, p: str) -> list[bool]:
    """Which layers slide: llama.cpp ``set_swa_pattern`` (layer i slides unless ``i % n == n - 1``; n = 0: all)
    for a period ``n``, or the file's per-layer booleans."""
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise UnsupportedModel(f"GGUF {p}attention.sliding_window_pattern has {len(pattern)} entries for "
                                   f"{layers} layers")
        return [bool(x) for x in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _cap(value) -> float | None:
    return None if value in (None, 0, 0.0) else float(value)


def fold_norms(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """``w -> 1 + w`` for every RMSNorm weight of a Gemma checkpoint (in place of the norm's ``1 + w``; in float32
    the same numbers transformers multiplies by)."""
    for name in list(weights):
        if name == "norm" or name.rsplit(".", 1)[-1] in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm",
                                                          "q_norm", "k_norm"):
            weights[name] = (weights[name].float() + 1.0).to(weights[name].dtype)


# ------------------------------------------------------------------------------------------------ model


class GemmaModel(LlamaModel):
    """Gemma 2 / 3 text over the paged KV cache, torch path (module docstring). ``forward`` as LlamaModel's;
    LoRA adapters are refused (``lora_off_reason``: the runner gives the model no adapter slots and names it)."""

    lora_off_reason = "LoRA adapters are not supported for Gemma models"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 make_linear=None, native_kernels: bool = True) -> None:
        post = {i: (weights.pop(f"layers.{i}.post_attn_norm"), weights.pop(f"layers.{i}.post_ffn_norm"))
                for i in range(config.num_layers)}
        qk = {i: (weights.pop(f"layers.{i}.q_norm"), weights.pop(f"layers.{i}.k_norm"))
              for i in range(config.num_layers)} if config.qk_norm else {}
        super().__init__(dataclasses_replace_qk(config), weights, max_positions, make_linear, native_kernels=False)
        self.config = config
        # why the fused native layer path is off (the decode attention below still runs native); None when the
        # native kernels were not asked for at all, as the Llama decoder says (model.py)
        self.native_off_reason = arch_spec.native_unsupported(config) if native_kernels else None
        self.post = post
        self.qk = qk
        device = str(self.embed.device)
        self.local_rope = self.rope
        if config.rope_local_theta is not None:
            self.local_rope = RotaryEmbedding(config.head_dim, config.rope_local_theta, max_positions, device)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.windows = config.layer_windows or (config.sliding_window or 0,) * config.num_layers
        # the step's decodes through the native paged decode attention (scale, window and soft-cap in the kernel:
        # csrc/cpu_kernels.cpp) where it runs this dtype and device; else the torch path below
        self.decode_kernels = (cpu_kernels.load() if native_kernels and cpu_kernels.CpuKernels.supports(self.dtype, device)
                               else None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """float32 logits [len(meta.logits_indices), vocab]; K/V written into ``kv_cache``."""
        if meta.lora is not None:
            raise ValueError("LoRA adapters are not supported for Gemma models")
        cfg = self.config
        H, Hkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_eps
        T = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed) * torch.tensor(math.sqrt(cfg.hidden_size), dtype=self.dtype)
        bs = kv_cache.shape[3]
        tables = meta.block_tables if meta.block_tables is not None else _block_tables_from_slots(meta, bs)
        tabs = {w: (self.local_rope if w else self.rope).tables(meta.positions) for w in set(self.windows)}
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(rms_norm(h, lw.attn_norm, eps))
            q = qkv[:, : H * hd].reshape(T, H, hd)
            k = qkv[:, H * hd : (H + Hkv) * hd].reshape(T, Hkv, hd)
            v = qkv[:, (H + Hkv) * hd :].reshape(T, Hkv, hd)
            if cfg.qk_norm:
                q, k = rms_norm(q, self.qk[i][0], eps), rms_norm(k, self.qk[i][1], eps)
            cos, sin = tabs[self.windows[i]]
            q, k = self.rope.rotate(q, cos, sin), self.rope.rotate(k, cos, sin)
            cache = kv_cache[i]
            cache[0].view(-1, Hkv, hd).index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
            cache[1].view(-1, Hkv, hd).index_copy_(0, meta.slot_mapping, v.to(cache.dtype))
            attn = self._attend(q, meta, tables, cache, self.windows[i])
            h = h + rms_norm(lw.o(attn.reshape(T, H * hd)), self.post[i][0], eps)
            gu = lw.gate_up(rms_norm(h, lw.ffn_norm, eps))
            f = gu.shape[-1] // 2
            h = h + rms_norm(lw.down(F.gelu(gu[:, :f], approximate="tanh") * gu[:, f:]), self.post[i][1], eps)
        h = rms_norm(h[meta.logits_indices], self.norm, eps)
        logits = (h @ self.lm_head.weight.t()).float()
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def _attend(self, q: torch.Tensor, meta: BatchMetadata, tables, cache: torch.Tensor, window: int) -> torch.Tensor:
        """Causal attention of every sequence's chunk over its cached keys: q [T, H, hd] -> [T, H, hd]. Scores
        scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped (``attn_softcap``), masked to the causal
        ``window`` (0 = none), softmax in float32 (transformers' eager attention). The step's one-token decodes
        go together (their blocks gathered, padded to the longest, masked); uncapped layers (Gemma 3) run SDPA
        with the same mask and scale instead of the explicit product."""
        out = torch.empty_like(q)
        bs, starts, start = cache.shape[2], [], 0
        for n in meta.query_lens:
            starts.append(start)
            start += n
        dec = [s for s, n in enumerate(meta.query_lens) if n == 1]
        if dec and self.decode_kernels is not None and cache.dtype == q.dtype:
            self._native_decodes(q, out, dec, starts, meta, tables, cache, window)
        elif dec:
            lens = [meta.context_lens[s] for s in dec]
            nblk = -(-max(lens) // bs)
            blocks = torch.tensor([tables[s][: -(-c // bs)] + [tables[s][0]] * (nblk - -(-c // bs))
                                   for s, c in zip(dec, lens)], device=q.device)
            rows = torch.tensor([starts[s] for s in dec], device=q.device)
            ctx = torch.tensor(lens, device=q.device).unsqueeze(1)
            keys = torch.arange(nblk * bs, device=q.device).unsqueeze(0)
            allowed = keys < ctx
            if window:
                allowed &= keys >= ctx - window
            out[rows] = self._scores(q[rows].unsqueeze(1), blocks, cache, allowed.unsqueeze(1)).squeeze(1)
        for s, (n, c) in enumerate(zip(meta.query_lens, meta.context_lens)):
            if n == 1:
                continue
            blocks = torch.tensor([tables[s][: -(-c // bs)]], device=q.device)
            q_pos = torch.arange(c - n, c, device=q.device).unsqueeze(1)
            keys = torch.arange(blocks.shape[1] * bs, device=q.device).unsqueeze(0)
            allowed = keys <= q_pos
            if window:
                allowed &= keys > q_pos - window
            out[starts[s] : starts[s] + n] = self._scores(q[starts[s] : starts[s] + n].unsqueeze(0), blocks, cache,
                                                         allowed.unsqueeze(0))[0]
        return out

    def _native_decodes(self, q: torch.Tensor, out: torch.Tensor, dec: list[int], starts: list[int], meta: BatchMetadata,
                        tables, cache: torch.Tensor, window: int) -> None:
        """The one-token queries of sequences ``dec`` into ``out`` by cpu_kernels.paged_decode_attention: K/V read
        in place from ``cache`` [2, blocks, bs, Hkv, hd], scaled by ``query_pre_attn_scalar ** -0.5``, soft-capped
        (``attn_softcap``), within ``window`` (0 = none)."""
        lens = [meta.context_lens[s] for s in dec]
        bs = cache.shape[2]
        width = max(-(-c // bs) for c in lens)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        blocks = i32([list(tables[s][: -(-c // bs)]) + [0] * (width - -(-c // bs)) for s, c in zip(dec, lens)])
        self.decode_kernels.paged_decode_attention(
            q, out, cache[0], cache[1], i32([starts[s] for s in dec]), blocks, i32(lens), self.scale, window,
            self.config.attn_softcap or 0.0)

    def _scores(self, q: torch.Tensor, blocks: torch.Tensor, cache: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [B, n, H, hd] over the K/V of ``blocks`` [B, nblk] (``allowed`` bool [B, n, nblk * bs]) -> [B, n, H, hd]."""
        cfg = self.config
        Hkv, hd, G, cap = cfg.num_kv_heads, cfg.head_dim, self.num_groups, cfg.attn_softcap
        B, n = q.shape[:2]
        L = blocks.shape[1] * cache.shape[2]
        k = cache[0].index_select(0, blocks.view(-1)).view(B, L, Hkv, hd).to(q.dtype)
        v = cache[1].index_select(0, blocks.view(-1)).view(B, L, Hkv, hd).to(q.dtype)
        qg = q.reshape(B, n, Hkv, G, hd).permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * G, hd)  # query rows n-major
        mask = allowed.repeat_interleave(G, 1).unsqueeze(1)  # [B, 1, n * G, L]
        if cap is None:
            o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                               scale=self.scale)
        else:  # one KV head at a time: its K / V rows are strided matrices bmm reads in place (no [B,Hkv,L,hd] copy;
            o = torch.empty_like(qg)  # one matmul over the [B, Hkv, hd, L] view was 6x slower in float32 at 32 rows)
            for h in range(Hkv):
                o[:, h] = torch.bmm(self._capped_probs(torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)), mask[:, 0],
                                                       q.dtype), v[:, :, h])
        return o.view(B, Hkv, n, G, hd).permute(0, 2, 1, 3, 4).reshape(B, n, Hkv * G, hd)

    def _capped_probs(self, scores: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Softmax (float32, then ``dtype``) of raw scores [..., L] scaled, soft-capped (``cap * tanh(s / cap)``)
        and masked where ``allowed`` (bool, broadcast) is False; in place on a float32 copy of ``scores``."""
        cap = self.config.attn_softcap
        s = scores.float() if scores.dtype != torch.float32 else scores
        s.mul_(self.scale / cap).tanh_().mul_(cap).masked_fill_(~allowed, float("-inf"))
        return torch.softmax(s, -1).to(dtype)


def dataclasses_replace_qk(config: ModelConfig) -> ModelConfig:
    """``config`` with ``qk_norm`` off for LlamaModel's constructor (GemmaModel applies the q/k norms itself)."""
    return dataclasses.replace(config, qk_norm=False)
