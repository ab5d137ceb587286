"""Mixture-of-experts MLP blocks (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) and the model classes that use
them (decision 0047).

A block replaces a layer's dense SwiGLU MLP. For hidden states x [T, d]:

1. **Router**: logits ``x @ W_r^T`` [T, E], softmax in float32, the ``top_k`` largest probabilities and their
   experts (``torch.topk``); with ``norm_topk_prob`` the k probabilities are divided by their sum (Mixtral
   always; Qwen3-MoE as its config says). Shazeer et al. 2017 (sparsely-gated MoE), Jiang et al. 2024
   (Mixtral of Experts), the Qwen3 technical report (2025).
2. **Experts grouped**: the T x k (row, expert) pairs are sorted by expert, and each expert that at least one
   row selected runs **one** product over all its rows (gate/up fused, SwiGLU, down), weighted by the rows'
   probabilities and added into the output. An expert no row selected is not read at all: a decode step of one
   row touches ``top_k`` of E experts' weights, a step of 32 rows one product per distinct selected expert
   (tests/unit/test_engine_moe.py counts it with ``torch.utils.flop_counter.FlopCounterMode``).
3. **Shared expert** (``shared_ffn_size``): a dense SwiGLU on every row, scaled by ``sigmoid(x @ w_s^T)``
   (Qwen2-MoE's ``shared_expert_gate``), added to the routed sum.

The experts' projections are built by the model's ``make_linear`` like every other projection (dense, or
int8 / int4 through quant.py), one per expert. The native CPU kernels do not cover these blocks
(arch_spec.native_unsupported): MoE models run the torch path. LoRA adapters and tensor parallelism are refused
for them by name (torch_runner.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import LlamaModel, QkNormModel


class MoeBlock:
    """One layer's routed experts (module docstring). ``router`` [E, d] (model dtype); ``gate_up[e]`` /
    ``down[e]``: expert e's fused [gate; up] projection (out 2f) and down projection (out d), any linear of
    model.py / quant.py; ``shared``: (gate_up, down, gate weight [1, d]) of a shared expert, or None."""

    def __init__(self, router: torch.Tensor, gate_up: list, down: list, top_k: int, norm_topk_prob: bool,
                 shared: tuple | None = None) -> None:
        if len(gate_up) != router.shape[0] or len(down) != router.shape[0]:
            raise ValueError(f"MoeBlock: {router.shape[0]} router rows for {len(gate_up)} / {len(down)} experts")
        self.router, self.gate_up, self.down = router.contiguous(), gate_up, down
        self.num_experts, self.top_k, self.norm_topk_prob = router.shape[0], top_k, norm_topk_prob
        self.shared = shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in x's dtype, experts int64 [T, top_k]) for x [T, d]: softmax of the router
        logits in float32, top-k, renormalised when ``norm_topk_prob``."""
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s SwiGLU of x [n, d] -> [n, d]: ``down(silu(x W_g^T) * (x W_u^T))`` (Shazeer 2020)."""
        gate_up = self.gate_up[e]
        if getattr(gate_up, "fused_swiglu", False):  # AmxInt4Linear: SwiGLU in the product's epilogue
            return self.down[e](gate_up.swiglu(x))
        gu = gate_up(x)
        f = gu.shape[-1] // 2
        return self.down[e](F.silu(gu[:, :f]) * gu[:, f:])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output [T, d] for x [T, d] (module docstring): each selected expert once, on its rows."""
        weights, experts = self.route(x)
        flat = experts.reshape(-1)  # [T * k]: pair p is row p // k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, rows ascending within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = order // self.top_k
        pair_w = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:  # no row chose expert e: its weights are not touched
                continue
            idx = rows[start:start + n]
            xe = x if n == x.shape[0] and self.top_k == 1 else x.index_select(0, idx)
            out.index_add_(0, idx, self.expert(e, xe) * pair_w[start:start + n])
            start += n
        if self.shared is not None:
            gate_up, down, gate = self.shared
            gu = gate_up(x)
            f = gu.shape[-1] // 2
            out += torch.sigmoid(F.linear(x, gate)) * down(F.silu(gu[:, :f]) * gu[:, f:])
        return out


def build_block(config, w, make_linear) -> MoeBlock:
    """The MoeBlock of one layer from its weights: ``w(name)`` pops ``router``, ``exp_gate`` / ``exp_up``
    [E, f, d], ``exp_down`` [E, d, f] (and ``shexp_*`` with ``config.shared_ffn_size``); ``make_linear(weight,
    name)`` builds each expert's projections (names ``gate_up`` / ``down``, as the dense MLP's)."""
    router, gate, up, down = w("router"), w("exp_gate"), w("exp_up"), w("exp_down")
    gate_up = [make_linear(torch.cat([gate[e], up[e]]), "gate_up") for e in range(gate.shape[0])]
    downs = [make_linear(down[e].contiguous(), "down") for e in range(down.shape[0])]
    shared = None
    if config.shared_ffn_size:
        shared = (make_linear(torch.cat([w("shexp_gate"), w("shexp_up")]), "gate_up"),
                  make_linear(w("shexp_down"), "down"), w("shexp_router").contiguous())
    return MoeBlock(router, gate_up, downs, config.num_experts_per_tok, config.norm_topk_prob, shared)


class MoeMlp:
    """The MLP part of a mixture-of-experts model (``LlamaModel.MLP``, beside model.py's ``DenseMlp``): one
    ``MoeBlock`` per layer (``blocks[layer]``). LoRA adapters do not reach the experts: a batch that carries any is
    refused (ValueError)."""

    def __init__(self, config) -> None:
        self.config = config
        self.blocks: list[MoeBlock] = []

    def fields(self, w, make_linear, layer: int) -> dict:
        """Builds layer ``layer``'s block from its router and stacked experts (``w(name)`` pops one); the layer
        record's dense MLP fields stay empty."""
        self.blocks.append(build_block(self.config, w, make_linear))
        return {"gate_up": None, "down": None}

    def __call__(self, lw, x: torch.Tensor, meta, layer: int) -> torch.Tensor:
        """The block's output [T, d] for the normed hidden states ``x`` [T, d]."""
        if meta.lora is not None:
            raise ValueError(f"LoRA adapters are not supported for mixture-of-experts models "
                             f"({self.config.architecture})")
        return self.blocks[layer](x)


class MixtralModel(LlamaModel):
    """Mixtral: Llama attention, a mixture-of-experts MLP (top-k renormalised)."""

    MLP = MoeMlp


class Qwen2MoeModel(LlamaModel):
    """Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (Q/K/V biases), routed experts (``norm_topk_prob``) and a
    shared expert gated by ``sigmoid(x w^T)``."""

    MLP = MoeMlp


class Qwen3MoeModel(QkNormModel):
    """Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), a mixture-of-experts MLP (``norm_topk_prob``)."""

    MLP = MoeMlp
