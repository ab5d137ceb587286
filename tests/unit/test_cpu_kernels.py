"""The C++ CPU kernels (actors/worker/engine/cpu_kernels.py) against the PyTorch expressions they replace."""

import math

import pytest
import torch
import torch.nn.functional as F

from actors.worker.engine import cpu_kernels
from actors.worker.engine.model import RotaryEmbedding, rms_norm

KERNELS = cpu_kernels.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C++ compiler here: the engine runs its PyTorch path")

DTYPES = [torch.float32, torch.bfloat16]
# float32: only operation order differs.  bf16: one rounding step (2^-8 relative) may differ.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2)}


def _ref_attention(q, kc, vc, rows, tables, lens):
    """Per sequence: gather its blocks, causal-free SDPA of its one query over its context."""
    bs, Hkv, hd = kc.shape[1], kc.shape[2], kc.shape[3]
    out = torch.zeros_like(q)
    G = q.shape[1] // Hkv
    for s in range(rows.numel()):
        n = int(lens[s])
        blocks = tables[s, : -(-n // bs)].long()
        k = kc.index_select(0, blocks).reshape(-1, Hkv, hd)[:n].transpose(0, 1)  # [Hkv, n, hd]
        v = vc.index_select(0, blocks).reshape(-1, Hkv, hd)[:n].transpose(0, 1)
        qs = q[int(rows[s])].reshape(Hkv, G, hd)
        out[int(rows[s])] = F.scaled_dot_product_attention(qs.float(), k.float(), v.float()).reshape(-1, hd).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,hd", [(9, 3, 64), (4, 4, 32), (6, 2, 24)])  # 24: not a multiple of 16 (scalar path)
@pytest.mark.parametrize("nseq", [5, 1])  # 5: a task per sequence; 1: a task per (sequence, KV head)
def test_paged_decode_attention(dtype, H, Hkv, hd, nseq):
    torch.manual_seed(0)
    bs, nb = 16, 64
    kc, vc = torch.randn(nb, bs, Hkv, hd, dtype=dtype), torch.randn(nb, bs, Hkv, hd, dtype=dtype)
    lens = torch.tensor([1, 17, 200, 64, 33][-nseq:], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in lens]).to(torch.int32)
    rows = torch.tensor([4, 0, 2, 6, 5][-nseq:], dtype=torch.int32)  # out of order, with gaps (prefill rows)
    q = torch.randn(7, H + 2 * Hkv, hd, dtype=dtype)[:, :H]  # row-strided like the model's QKV slice
    out = torch.full((7, H, hd), 7.0, dtype=dtype)
    KERNELS.paged_decode_attention(q, out, kc, vc, rows, tables, lens, 1 / math.sqrt(hd))
    ref = _ref_attention(q, kc, vc, rows, tables, lens)
    torch.testing.assert_close(out[rows.long()], ref[rows.long()], **TOL[dtype])
    untouched = [r for r in range(7) if r not in rows.tolist()]
    assert bool((out[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hkv,hd", [(8, 4, 128), (6, 2, 24)])  # 24: the scalar path
@pytest.mark.parametrize("window", [0, 21])
def test_paged_decode_attention_soft_caps_the_scores(dtype, H, Hkv, hd, window):
    """Gemma 2's attention soft-cap in the kernel: softmax over ``cap * tanh(scale * q.k / cap)`` of the keys in the
    window, against the explicit expression (a cap low enough to bind; without it the output moves)."""
    torch.manual_seed(3)
    bs, nb, cap, scale = 16, 64, 2.0, 0.3
    kc, vc = torch.randn(nb, bs, Hkv, hd, dtype=dtype), torch.randn(nb, bs, Hkv, hd, dtype=dtype)
    lens = torch.tensor([1, 17, 200, 64, 33], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in lens]).to(torch.int32)
    rows = torch.tensor([4, 0, 2, 6, 5], dtype=torch.int32)
    q = torch.randn(7, H, hd, dtype=dtype)
    out, uncapped = torch.zeros(7, H, hd, dtype=dtype), torch.zeros(7, H, hd, dtype=dtype)
    KERNELS.paged_decode_attention(q, out, kc, vc, rows, tables, lens, scale, window, cap)
    KERNELS.paged_decode_attention(q, uncapped, kc, vc, rows, tables, lens, scale, window)
    for s in range(5):
        n, r = int(lens[s]), int(rows[s])
        lo = max(0, n - window) if window else 0
        k = kc.index_select(0, tables[s].long()).reshape(-1, Hkv, hd)[lo:n].float()  # [L, Hkv, hd]
        v = vc.index_select(0, tables[s].long()).reshape(-1, Hkv, hd)[lo:n].float()
        qs = q[r].float().reshape(Hkv, H // Hkv, hd)
        scores = torch.einsum("hgd,lhd->hgl", qs, k) * scale
        probs = (torch.tanh(scores / cap) * cap).softmax(-1)
        ref = torch.einsum("hgl,lhd->hgd", probs, v).reshape(H, hd)
        torch.testing.assert_close(out[r].float(), ref, **TOL[dtype])
        if n > 1:
            assert (out[r].float() - uncapped[r].float()).abs().max() > 10 * TOL[dtype]["atol"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("d", [576, 40])  # 40: 16-lane vectors plus a scalar tail
def test_add_rms_norm(dtype, rows, d):
    torch.manual_seed(1)
    h, delta = torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype)
    w = torch.rand(d, dtype=dtype) + 0.5
    want_h = h + delta
    want = rms_norm(want_h, w, 1e-5)
    got = KERNELS.add_rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual add rounds like torch's
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(KERNELS.add_rms_norm(h.clone(), None, w, 1e-5), rms_norm(h, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_rotates_in_place_and_writes_the_cache(dtype):
    torch.manual_seed(2)
    H, Hkv, hd, T, bs, nb = 9, 3, 64, 6, 16, 8
    rope = RotaryEmbedding(hd, 10000.0, 512, "cpu")
    qkv = torch.randn(T, (H + 2 * Hkv) * hd, dtype=dtype)
    positions = torch.tensor([0, 5, 17, 300, 301, 511])
    slots = torch.tensor([3, 40, 41, 100, 7, 127])
    kc, vc = torch.zeros(nb, bs, Hkv, hd, dtype=dtype), torch.zeros(nb, bs, Hkv, hd, dtype=dtype)
    want_qk = rope.apply(qkv[:, : (H + Hkv) * hd].view(T, H + Hkv, hd), positions)
    want_v = qkv[:, (H + Hkv) * hd :].view(T, Hkv, hd).clone()
    KERNELS.rope_kv(qkv, H, Hkv, hd, positions, rope.cos, rope.sin, slots, kc, vc)
    torch.testing.assert_close(qkv[:, : (H + Hkv) * hd].view(T, H + Hkv, hd), want_qk, **TOL[dtype])
    torch.testing.assert_close(kc.view(-1, Hkv, hd)[slots], want_qk[:, H:], **TOL[dtype])
    assert torch.equal(vc.view(-1, Hkv, hd)[slots], want_v)
    others = [i for i in range(nb * bs) if i not in slots.tolist()]
    assert bool((kc.view(-1, Hkv, hd)[others] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [1536, 40])  # 40: a 16-lane body plus a scalar tail
def test_silu_mul(dtype, f):
    torch.manual_seed(3)
    gu = torch.randn(5, 2 * f, dtype=dtype) * 4
    want = F.silu(gu[:, :f]) * gu[:, f:]
    torch.testing.assert_close(KERNELS.silu_mul(gu), want, **TOL[dtype])


def test_bad_layouts_raise_value_error():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="rms_norm"):
        KERNELS.add_rms_norm(x.t(), None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        KERNELS.silu_mul(torch.randn(3, 5))
    with pytest.raises(ValueError, match="int32"):
        q = torch.randn(1, 2, 8)
        KERNELS.paged_decode_attention(q, q.clone(), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8),
                                       torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), 0.3)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("ACTORSERVE_NATIVE_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        monkeypatch.delenv("ACTORSERVE_NATIVE_KERNELS")
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("cut", [1000, -1])  # -1: all but the last byte (still an ELF header)
def test_a_corrupt_cached_build_is_rebuilt(tmp_path, monkeypatch, cut):
    """A cut library must be caught before dlopen: mapping one can SIGBUS the process."""
    import shutil

    monkeypatch.setenv("ACTORSERVE_KERNEL_DIR", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        built = cpu_kernels._build([shutil.which("g++") or shutil.which("c++")], cpu_kernels.select_isa())  # as load() would
        data = built.read_bytes()
        built.write_bytes(data[:cut])
        kernels = cpu_kernels.load()
        assert kernels is not None and built.read_bytes() == data
        x = torch.randn(2, 64)
        torch.testing.assert_close(kernels.add_rms_norm(x.clone(), None, torch.ones(64), 1e-5),
                                   rms_norm(x, torch.ones(64), 1e-5), **TOL[torch.float32])
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("cxx", ["/bin/true", "/bin/false"])  # writes nothing / fails
def test_a_compiler_that_builds_nothing_leaves_no_cache(tmp_path, monkeypatch, cxx):
    monkeypatch.setenv("ACTORSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", cxx)
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert list(tmp_path.iterdir()) == []
    finally:
        cpu_kernels.load.cache_clear()


def test_cxx_may_carry_arguments(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("ACTORSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", f"{shutil.which('g++') or shutil.which('c++')} -w")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is not None
    finally:
        cpu_kernels.load.cache_clear()


# --------------------------------------------------------------------------- AMX prefill attention
needs_amx = pytest.mark.skipif(KERNELS is None or not KERNELS.has_amx, reason="no AMX-BF16 on this CPU")


def _ref_causal(q, k, v):
    """float32 causal SDPA with K/V repeated per query group: q [n, H, hd], k/v [n, Hkv, hd]."""
    G = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.float().repeat_interleave(g, 1).transpose(0, 1) for t, g in ((q, 1), (k, G), (v, G)))
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)


@needs_amx
@pytest.mark.parametrize("n", [1, 5, 16, 33, 100, 300])  # partial 16-query tiles and 32-key blocks
@pytest.mark.parametrize("H,Hkv", [(9, 3), (4, 4)])
def test_prefill_attention_matches_causal_sdpa(n, H, Hkv):
    torch.manual_seed(n)
    qkv = torch.randn(n, (H + 2 * Hkv) * 64, dtype=torch.bfloat16) * 2  # views with the fused row stride
    q = qkv[:, : H * 64].view(n, H, 64)
    k = qkv[:, H * 64 : (H + Hkv) * 64].view(n, Hkv, 64)
    v = qkv[:, (H + Hkv) * 64 :].view(n, Hkv, 64)
    got = KERNELS.prefill_attention(q, k, v, 64 ** -0.5).float()
    ref = _ref_causal(q, k, v)
    # P rounded to bf16 before P V, the output once more: within a few bf16 steps of the float32 result
    assert (got - ref).abs().max().item() <= 2 ** -6 * ref.abs().max().item()
    # causality: changing the last token's K/V leaves every earlier output unchanged
    if n > 1:
        qkv[-1, H * 64 :] += 1
        again = KERNELS.prefill_attention(q, k, v, 64 ** -0.5).float()
        assert torch.equal(again[:-1], got[:-1]) and not torch.equal(again[-1], got[-1])


@needs_amx
def test_prefill_attention_refuses_other_head_sizes():
    q, kv = torch.randn(4, 2, 32, dtype=torch.bfloat16), torch.randn(4, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="prefill_attention"):
        KERNELS.prefill_attention(q, kv, kv, 0.1)
    q64 = torch.randn(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no KV heads"):
        KERNELS.prefill_attention(q64, q64[:, :0], q64[:, :0], 0.1)
