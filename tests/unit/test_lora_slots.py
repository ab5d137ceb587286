"""The step's low-rank products over the slot stack (actors/worker/engine/lora_slots.py): each way of adding
the deltas (whole batch, batched over slots, per group) equals a row-by-row reference."""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine.gguf_loader import ModelConfig
from actors.worker.engine.lora import HostAdapter, in_features, sub_outputs
from actors.worker.engine.lora_slots import SlotStack, make_batch

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=64,
                  vocab_size=10, context_length=64, rope_theta=1e4, rms_eps=1e-5)


def host(name: str, seed: int, rank: int, projs=("qkv", "o", "gate_up", "down")) -> HostAdapter:
    g = torch.Generator().manual_seed(seed)
    outs, ins = sub_outputs(CFG), in_features(CFG)
    layers = {(l, p): {i: (torch.randn(rank, ins[p], generator=g), torch.randn(n, rank, generator=g))
                       for i, n in enumerate(outs[p])}
              for l in range(CFG.num_layers) for p in projs}
    return HostAdapter(name, rank, layers)


@pytest.fixture()
def stack():
    s = SlotStack(CFG, 4, 4, torch.float32, "cpu")
    adapters = [host("a", 1, 4), host("b", 2, 2), host("c", 3, 4, projs=("qkv",)), host("d", 4, 3)]
    for slot, h in enumerate(adapters):
        s.load(slot, h)
    return s, adapters


def reference(adapters, seq_slots, lens, layer, proj, x):
    y = torch.zeros(x.shape[0], sum(sub_outputs(CFG)[proj]))
    row = 0
    for slot, n in zip(seq_slots, lens):
        for r in range(row, row + n):
            if slot is not None and (layer, proj) in adapters[slot].layers:
                y[r] = torch.cat([(x[r] @ a.t()) @ b.t() for _, (a, b) in sorted(adapters[slot].layers[(layer, proj)].items())])
        row += n
    return y


@pytest.mark.parametrize("seq_slots,lens,mode", [
    ([0, 0, 0], [1, 1, 1], "whole"),
    ([0, 1, 2, 3, None, 1], [1, 1, 1, 1, 1, 1], "bmm"),  # every slot used: no slot gather
    ([1, None, 1], [1, 1, 1], "whole-less bmm"),  # one slot beside base rows
    ([0, 3, None, 3], [2, 1, 1, 1], "bmm"),  # half the slots
    ([2, 0, 1], [20, 1, 1], "groups"),  # a long prefill beside decodes: padding would dominate
])
def test_every_mode_equals_the_row_by_row_reference(stack, seq_slots, lens, mode):
    s, adapters = stack
    batch = make_batch(s, seq_slots, lens, "cpu")
    want = {"whole": batch.whole is not None, "groups": bool(batch.groups)}.get(mode, batch.gather is not None)
    assert want, (mode, batch)
    for layer in range(CFG.num_layers):
        for proj, n_in in in_features(CFG).items():
            xin = torch.randn(sum(lens), n_in)
            got = batch.add_delta(layer, proj, xin, torch.zeros(sum(lens), sum(sub_outputs(CFG)[proj])))
            assert torch.allclose(got, reference(adapters, seq_slots, lens, layer, proj, xin), atol=1e-4), (layer, proj)


def test_no_adapter_no_batch_and_reloading_a_slot_clears_it(stack):
    s, _ = stack
    assert make_batch(s, [None, None], [1, 1], "cpu") is None
    s.load(2, host("e", 5, 1, projs=("o",)))  # c adapted qkv only, e adapts o only: c's qkv must be gone
    batch = make_batch(s, [2], [3], "cpu")
    assert not batch.adapts("qkv") and batch.adapts("o")
    assert not s.a[(0, "qkv")][2].any() and not s.b[(0, "qkv")][2].any()
    assert s.names[2] == "e" and s.nbytes > 0


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.25)])
def test_native_kernel_equals_the_row_by_row_reference(dtype, atol):
    """csrc/lora_sgmv.cpp: every row's own slot (and none), float32 and bf16 (rounded once, after the add)."""
    from actors.worker.engine import cpu_kernels

    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C++ compiler or a failed build: the torch forms serve (covered above)")
    s = SlotStack(CFG, 4, 4, dtype, "cpu")
    adapters = [host("a", 1, 4), host("b", 2, 2), host("c", 3, 4, projs=("qkv",)), host("d", 4, 3)]
    for slot, h in enumerate(adapters):
        s.load(slot, h)
    s.kernels = kernels
    seq_slots, lens = [0, 3, None, 2, 1, 0], [1, 2, 1, 1, 3, 1]
    batch = make_batch(s, seq_slots, lens, "cpu")
    assert batch.row_slots is not None
    g = torch.Generator().manual_seed(9)
    for layer in range(CFG.num_layers):
        for proj, n_in in in_features(CFG).items():
            xin = torch.randn(sum(lens), n_in, generator=g) * 0.5
            base = torch.randn(sum(lens), sum(sub_outputs(CFG)[proj]), generator=g)
            got = batch.add_delta(layer, proj, xin.to(dtype), base.to(dtype).clone()).float()
            ref = base + reference(adapters, seq_slots, lens, layer, proj, xin.to(dtype).float())
            assert (got - ref).abs().max().item() < atol * max(1.0, ref.abs().max().item() / 8), (layer, proj)
