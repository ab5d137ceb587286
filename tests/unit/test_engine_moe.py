"""Mixture of experts (issue [22] item 2): Mixtral and Qwen3-MoE, Hugging Face directories and GGUF files, against
transformers in float32; the routing's cost counted with torch's FlopCounterMode; llama.cpp's own converter.

Models: tests/moe_models.py (8 experts, top-2, router and attention scaled so routing and features matter).
Tolerance: float32 logits within LOGIT_ATOL = 1e-4 (tests/unit/test_engine_families.py). Negative controls:
renormalisation of the top-k switched (off where the config has it on, on where off) and top-1 instead of top-2
move the logits by more than 100 x LOGIT_ATOL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from actors.worker.engine.arch_spec import UnsupportedModel
from actors.worker.engine.engine import EngineConfig, LLMEngine
from tests.engine_fixtures import prefill_logits, stepwise_logits
from tests.family_checks import (LOGIT_ATOL, QUANT_TOLERANCES, assert_batched_equals_alone,
                                 assert_greedy_matches_transformers, build_models, control_moves, engine_cache,
                                 hf_forward, rel_top1, worst_logit_error)
from tests.moe_models import NUM_EXPERTS, TOP_K, VARIANTS, build, sentencepiece_dir, write_moe_gguf
# llama.cpp's source tree (docs/bench.md unpacks it there); its convert_hf_to_gguf.py is the independent writer
LLAMA_CPP = os.environ.get("ACTORSERVE_LLAMA_CPP_DIR", "/work/llama-build/llama.cpp")

_g = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, 260, (n,), generator=_g).tolist() for n in (40, 24, 7)]
CASES = [(v, f) for v in VARIANTS for f in ("hf", "gguf") if f == "hf" or VARIANTS[v].gguf]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(build, VARIANTS, tmp_path_factory.mktemp("moe"))


@pytest.fixture(scope="module")
def engines(models):
    """engine(variant, format, quantization=None): float32 engines, made once per module."""
    with engine_cache(models, max_loras=4) as get:
        yield get


# --------------------------------------------------------------------------------------- logits, greedy, batch


@pytest.mark.parametrize("variant,fmt", CASES)
def test_logits_match_transformers(models, engines, variant, fmt):
    eng = engines(variant, fmt)
    cfg = eng.model_config
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (NUM_EXPERTS, TOP_K)
    assert cfg.norm_topk_prob == (variant not in ("qwen3-moe-nonorm", "qwen2-moe"))
    assert cfg.shared_ffn_size == (128 if variant == "qwen2-moe" else 0)
    worst = worst_logit_error(eng, models[variant]["model"], PROMPTS)
    print(f"{variant}/{fmt}: max|dlogit| {worst:.2e}")
    assert worst <= LOGIT_ATOL


@pytest.mark.parametrize("variant,fmt", CASES)
def test_greedy_32_tokens_match_transformers(models, engines, variant, fmt):
    assert_greedy_matches_transformers(engines(variant, fmt), models[variant]["model"], PROMPTS[0])


@pytest.mark.parametrize("variant,fmt", CASES)
def test_batched_equals_alone(engines, variant, fmt):
    assert_batched_equals_alone(engines(variant, fmt), PROMPTS)


def test_gguf_equals_the_directory(engines):
    for variant in ("mixtral", "qwen2-moe", "qwen3-moe"):
        a, b = engines(variant, "hf"), engines(variant, "gguf")
        assert (prefill_logits(a, PROMPTS[0]) - prefill_logits(b, PROMPTS[0])).abs().max().item() <= LOGIT_ATOL


def test_moe_models_run_the_torch_path_and_say_why(engines):
    eng = engines("mixtral", "gguf")
    assert eng.model.kernels is None and "mixture-of-experts" in eng.runner.native_off_reason


# --------------------------------------------------------------------------------------- negative controls


CONTROLS = {  # feature -> spec change
    "renormalisation switched": lambda c, w: dataclasses.replace(c, norm_topk_prob=not c.norm_topk_prob),
    "top-1 instead of top-2": lambda c, w: dataclasses.replace(c, num_experts_per_tok=1),
    "shared expert dropped": lambda c, w: dataclasses.replace(c, shared_ffn_size=0),
}


@pytest.mark.parametrize("variant,fmt,feature", [(v, f, c) for v, f in CASES for c in CONTROLS
                                                 if c != "shared expert dropped" or v == "qwen2-moe"])
def test_negative_control_moves_the_logits(models, variant, fmt, feature):
    moved = control_moves(models[variant][fmt], models[variant]["model"], PROMPTS[0], CONTROLS[feature])
    print(f"{variant}/{fmt} {feature}: max|dlogit| {moved:.2f}")
    assert moved > 100 * LOGIT_ATOL


# --------------------------------------------------------------------------------------- cost follows the routing


class _Products:
    """FlopCounterMode with its matrix-product formulas wrapped to record each call's shapes as well."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.calls: list[tuple] = []

        def mm(a, b, *args, out_shape=None, **kw):  # [m, k] @ [k, n]: 2 m k n, as torch's mm_flop
            self.calls.append((tuple(a), tuple(b)))
            return 2 * a[0] * a[1] * b[1]

        def addmm(bias, a, b, *args, out_shape=None, **kw):
            return mm(a, b)

        aten = torch.ops.aten
        self.mode = FlopCounterMode(display=False, custom_mapping={aten.mm: mm, aten.addmm: addmm})

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    @property
    def flops(self) -> int:
        return self.mode.get_total_flops()


def test_a_decode_step_reads_only_the_selected_experts_and_groups_rows_by_expert(engines):
    """On the 8-expert, top-2 Mixtral: one row costs at most 2/8 of a dense pass's expert FLOPs (every expert on
    the row) plus the router's; 32 rows make one gate/up and one down product per distinct selected expert, each
    over all the rows that chose it (not one per row)."""
    eng = engines("mixtral", "hf")
    block = eng.model.mlp.blocks[0]
    d, f, E = eng.model_config.hidden_size, eng.model_config.ffn_size, NUM_EXPERTS
    router_flops = lambda rows: 2 * rows * d * E  # noqa: E731
    x1 = torch.randn(1, d, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        with _Products() as dense:  # a dense pass: every expert on the row
            for e in range(E):
                block.expert(e, x1)
        with _Products() as one:
            block(x1)
    assert dense.flops == E * 2 * (d * 2 * f + f * d)
    print(f"1 row: {one.flops - router_flops(1)} expert FLOPs against {dense.flops} dense")
    assert one.flops - router_flops(1) <= dense.flops * TOP_K / E
    assert len(one.calls) == 1 + 2 * TOP_K  # the router, then gate/up and down of the 2 selected experts

    x32 = torch.randn(32, d, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        _, chosen = block.route(x32)
        with _Products() as many:
            block(x32)
    rows_per_expert = torch.bincount(chosen.reshape(-1), minlength=E)
    selected = int((rows_per_expert > 0).sum())
    expert_calls = many.calls[1:]
    assert len(expert_calls) == 2 * selected < 2 * 32  # one gate/up and one down per selected expert
    assert sorted(a[0] for a, _ in expert_calls[::2]) == sorted(n for n in rows_per_expert.tolist() if n)
    assert many.flops - router_flops(32) == 32 * TOP_K * 2 * (d * 2 * f + f * d)


def test_a_one_row_step_of_the_whole_model_reads_two_experts_per_layer(engines):
    """Through the model's forward (every layer, the engine's own block objects): a one-token step makes exactly
    top-2 expert gate/up products per layer, each of one row."""
    from actors.worker.engine.model import BatchMetadata

    eng = engines("mixtral", "hf")
    cfg = eng.model_config
    kv = torch.zeros(cfg.num_layers, 2, 4, 16, cfg.num_kv_heads, cfg.head_dim)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    meta = BatchMetadata(t([0]), t([0]), None, [1], [1], t([0]), block_tables=[[0, 1, 2, 3]])
    with torch.inference_mode(), _Products() as step:
        eng.model.forward(t([PROMPTS[0][0]]), meta, kv)
    gate_up = [(a, b) for a, b in step.calls if b == (cfg.hidden_size, 2 * cfg.ffn_size)]
    assert len(gate_up) == cfg.num_layers * TOP_K and all(a[0] == 1 for a, _ in gate_up)


def test_quantized_experts_call_the_native_kernel_once_per_selected_expert(engines):
    """The native path (int8 experts: quant_blocks.QuantLinear over the C++ ``qgemm``): counted at the kernel's own
    entry (the ctypes function of the CpuKernels the expert linears hold, wrapped here: its weight pointer names the
    expert linear, its M argument the rows; no counter inside the engine). One row:
    one gate/up and one down call for each of the top-2 experts; 32 rows: one of each per distinct selected expert,
    each over all the rows that chose it."""
    from actors.worker.engine.quant_blocks import QuantLinear

    eng = engines("mixtral", "hf", quantization="int8")
    block = eng.model.mlp.blocks[0]
    lins = block.gate_up + block.down
    if not all(isinstance(lin, QuantLinear) for lin in lins):
        pytest.skip(f"int8 experts are {type(lins[0]).__name__} here, not the native QuantLinear (no C++ kernels)")
    kernels, packs = lins[0].kernels, {lin.packed.data_ptr(): n for n, lin in enumerate(lins)}
    calls: list[tuple[int, int]] = []  # (expert linear index, rows)
    real = kernels._qgemm

    def spy(*args):  # actorserve_qgemm(dtype, bits, x, ldx, w, y, ldy, M, N, K)
        if args[4] in packs:
            calls.append((packs[args[4]], args[7]))
        return real(*args)

    kernels._qgemm = spy
    try:
        with torch.inference_mode():
            block(torch.randn(1, eng.model_config.hidden_size, generator=torch.Generator().manual_seed(1)))
            one, calls[:] = list(calls), []
            x32 = torch.randn(32, eng.model_config.hidden_size, generator=torch.Generator().manual_seed(2))
            _, chosen = block.route(x32)
            block(x32)
    finally:
        kernels._qgemm = real
    assert len(one) == 2 * TOP_K and all(rows == 1 for _, rows in one)
    rows_per_expert = torch.bincount(chosen.reshape(-1), minlength=NUM_EXPERTS)
    selected = int((rows_per_expert > 0).sum())
    assert len(calls) == 2 * selected < 2 * 32
    gate_up_rows = sorted(rows for n, rows in calls if n < NUM_EXPERTS)
    assert gate_up_rows == sorted(n for n in rows_per_expert.tolist() if n)


# --------------------------------------------------------------------------------------- quantized, memory


def _hf_with_our_quantized_experts(model, engine):
    """A copy of the transformers model whose projections hold the values our quantized engine serves."""
    import copy

    ref = copy.deepcopy(model)
    cfg = engine.model_config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    with torch.no_grad():
        for i, (lw, layer) in enumerate(zip(engine.model.layers, ref.model.layers)):
            qkv = lw.qkv.dequantize().float()
            attn = layer.self_attn
            attn.q_proj.weight.copy_(qkv[:q]), attn.k_proj.weight.copy_(qkv[q:q + kv])
            attn.v_proj.weight.copy_(qkv[q + kv:]), attn.o_proj.weight.copy_(lw.o.dequantize().float())
            experts = (getattr(layer, "block_sparse_moe", None) or layer.mlp).experts  # transformers 5: fused
            block = engine.model.mlp.blocks[i]
            for e in range(cfg.num_experts):
                experts.gate_up_proj[e].copy_(block.gate_up[e].dequantize().float())
                experts.down_proj[e].copy_(block.down[e].dequantize().float())
    return ref


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe"])
def test_quantized_experts_within_tolerance(models, engines, variant, quant):
    """Every expert is quantized as the other projections are (quant.make_linear_factory); checked against
    transformers holding the same quantized values, with test_engine_families.py's bounds."""
    from actors.worker.engine.model import Linear

    max_rel, min_top1 = QUANT_TOLERANCES[quant]
    eng = engines(variant, "hf", quantization=quant)
    block = eng.model.mlp.blocks[0]
    assert not any(isinstance(lin, Linear) for lin in block.gate_up + block.down)  # none left dense
    ref = torch.cat([hf_forward(_hf_with_our_quantized_experts(models[variant]["model"], eng), p) for p in PROMPTS])
    for f in (prefill_logits, stepwise_logits):
        rel, top1 = rel_top1(torch.cat([f(eng, p) for p in PROMPTS]), ref)
        print(f"{variant}/{quant}/{f.__name__}: rel {rel:.4f} top1 {top1:.3f}")
        assert rel <= max_rel and top1 >= min_top1


@pytest.mark.parametrize("variant", ["mixtral", "qwen3-moe"])
def test_bfloat16_within_tolerance(models, variant):
    """bf16 (oneDNN-packed experts where available) against transformers float32: the project's bf16 bounds
    (test_engine_families.py: rel 0.08, top1 0.8)."""
    eng = LLMEngine(EngineConfig(model_path=models[variant]["hf"], dtype="bfloat16", kv_cache_bytes=8 * 2**20,
                                 max_loras=0))
    ref = torch.cat([hf_forward(models[variant]["model"], p) for p in PROMPTS])
    rel, top1 = rel_top1(torch.cat([prefill_logits(eng, p) for p in PROMPTS]), ref)
    print(f"{variant}/bf16: rel {rel:.4f} top1 {top1:.3f}")
    assert rel <= 0.08 and top1 >= 0.8


def test_the_memory_estimate_counts_every_expert(models, engines):
    """The weights' bytes (memory.tensor_bytes, what a host measures for residency) include all experts' bytes,
    dense float32 and int8; the manifest's estimate before a load (the files' bytes) holds them too."""
    from actors.worker.engine.hf_loader import artifact_bytes

    for quant, per_weight in ((None, 4), ("int8", 1)):
        eng = engines("mixtral", "hf", quantization=quant)
        c = eng.model_config
        experts = c.num_layers * c.num_experts * 3 * c.ffn_size * c.hidden_size * per_weight
        assert eng.runner.weights_bytes >= experts, (quant, eng.runner.weights_bytes, experts)
    c = engines("mixtral", "hf").model_config
    for fmt in ("hf", "gguf"):
        assert artifact_bytes(models["mixtral"][fmt]) >= c.num_layers * c.num_experts * 3 * c.ffn_size * c.hidden_size * 4


def test_kernel_choice_reads_the_shapes_of_a_moe_gguf(models):
    from actors.worker.engine.kernel_choice import read_shapes

    shapes = read_shapes(models["qwen3-moe"]["gguf"])
    assert shapes.gate_up == (2 * 96, 64) and shapes.down == (64, 96)


# --------------------------------------------------------------------------------------- refused by name


def test_lora_and_tensor_parallelism_are_refused_by_name(models, engines):
    eng = engines("qwen3-moe", "hf")
    assert eng.runner.adapters is None
    with pytest.raises(ValueError, match="LoRA adapters are not supported for mixture-of-experts models"):
        eng.runner.check_adapter("a", "/nowhere", set())
    with pytest.raises(ValueError, match="LoRA adapters are not supported for mixture-of-experts"):
        eng.runner.register_adapter("a", "/nowhere")
    with pytest.raises(ValueError, match="mixture-of-experts models .qwen3_moe. are not supported with tensor "
                                         "parallelism"):
        LLMEngine(EngineConfig(model_path=models["qwen3-moe"]["hf"], dtype="float32", kv_cache_bytes=2**20,
                               max_loras=0, tensor_parallel=2))


def _refused(path: str, match: str) -> None:
    from actors.worker.engine.weights_cache import read_artifact

    with pytest.raises(UnsupportedModel, match=match):
        read_artifact(path, torch.float32)


def test_a_directory_missing_an_expert_is_refused_naming_it(models, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "x"
    shutil.copytree(models["mixtral"]["hf"], d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("model.layers.1.block_sparse_moe.experts.5.w2.weight")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _refused(str(d), "model.layers.1.block_sparse_moe.experts.5.w2.weight")


def test_a_ninth_expert_is_refused_naming_it(models, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "x"
    shutil.copytree(models["qwen3-moe"]["hf"], d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = tensors["model.layers.0.mlp.experts.0.up_proj.weight"].clone()
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _refused(str(d), "model.layers.0.mlp.experts.8.up_proj.weight")


@pytest.mark.parametrize("field,value,match", [("decoder_sparse_step", 2, "decoder_sparse_step"),
                                               ("mlp_only_layers", [1], "mlp_only_layers"),
                                               ("num_experts_per_tok", 9, "num_experts_per_tok")])
def test_a_config_value_we_do_not_model_is_refused(models, tmp_path, field, value, match):
    d = tmp_path / "x"
    shutil.copytree(models["qwen3-moe"]["hf"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(str(d), match)


def test_a_gguf_missing_stacked_experts_or_with_another_gating_is_refused(models, tmp_path):
    model, hf = models["mixtral"]["model"], models["mixtral"]["hf"]
    _refused(write_moe_gguf(model, hf, str(tmp_path / "a.gguf"), drop=("blk.1.ffn_down_exps.weight",)),
             "blk.1.ffn_down_exps.weight")
    _refused(write_moe_gguf(model, hf, str(tmp_path / "b.gguf"), extra_kv={"expert_gating_func": 2}),
             "expert_gating_func")


# --------------------------------------------------------------------------------------- llama.cpp's converter


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_llama_cpp_converter_output_matches_transformers(models, tmp_path, outtype):
    """llama.cpp's convert_hf_to_gguf.py (the independent writer; ``ACTORSERVE_LLAMA_CPP_DIR``, default where
    docs/bench.md unpacks it) converts the Mixtral directory, given a SentencePiece tokenizer; our loader serves
    its file (labelled ``llama`` with ``llama.expert_count``) at transformers' logits: within 1e-4 in float32;
    ``q8_0`` (stacked experts in Q8_0 blocks, the router kept float32 by the converter) within the int8 bounds."""
    script = os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")
    if not os.path.isfile(script):
        pytest.skip(f"llama.cpp sources not found at {LLAMA_CPP} (set ACTORSERVE_LLAMA_CPP_DIR; docs/bench.md)")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter reads a Mixtral's SentencePiece tokenizer")
    src = sentencepiece_dir(models["mixtral"]["hf"], tmp_path / "mixtral-sp")
    out = str(tmp_path / f"mixtral-llamacpp-{outtype}.gguf")
    env = {**os.environ, "PYTHONPATH": os.path.join(LLAMA_CPP, "gguf-py")}  # its own gguf-py, not ours
    proc = subprocess.run([sys.executable, script, src, "--outtype", outtype, "--outfile", out], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import gguf

    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.expert_count"].contents() == NUM_EXPERTS
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == outtype.upper()
    eng = LLMEngine(EngineConfig(model_path=out, dtype="float32", kv_cache_bytes=8 * 2**20, max_loras=0))
    assert eng.model_config.architecture == "mixtral"
    model = models["mixtral"]["model"]
    ref = torch.cat([hf_forward(model, p) for p in PROMPTS])
    for f in (prefill_logits, stepwise_logits):
        ours = torch.cat([f(eng, p) for p in PROMPTS])
        if outtype == "f32":
            assert (ours - ref).abs().max().item() <= LOGIT_ATOL
        else:
            rel = ((ours - ref).norm() / ref.norm()).item()
            top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"llama.cpp q8_0 mixtral/{f.__name__}: rel {rel:.4f} top1 {top1:.3f}")
            assert rel <= QUANT_TOLERANCES["int8"][0] and top1 >= QUANT_TOLERANCES["int8"][1]
