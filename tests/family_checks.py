"""Checks shared by the engine family tests (tests/unit/test_engine_families.py, test_engine_windows_longrope.py,
test_engine_moe.py, test_engine_gemma.py): a module-wide engine cache, transformers' float32 reference (logits and
greedy tokens), the worst logit difference over prefill / one-token steps / chunked prefill, batched-equals-alone,
our model's logits with its spec changed (the negative controls).

Tolerance: float32 logits within LOGIT_ATOL = 1e-4 of transformers: the project's float32 bound for the tiny
models (measured 1e-5 .. 6e-5: different summation orders only).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.engine_fixtures import prefill_logits, stepwise_logits

LOGIT_ATOL = 1e-4
GEN_TOKENS = 32
# Quantized options, float32 activations: rel = ||ours - hf|| / ||hf||, top1 = share of equal argmax; the bounds
# of tests/unit/test_engine_reference.py (test_engine_families.test_quantized_within_tolerance says against what).
QUANT_TOLERANCES = {"int8": (0.12, 0.85), "int4": (0.08, 0.85)}


def build_models(build, names, folder) -> dict:
    """{name: build(name, folder)} (tests/family_models.py or tests/moe_models.py ``build``: {"model", "hf",
    "gguf"}), transformers' warnings about the tiny configs silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: build(name, folder) for name in names}


@contextlib.contextmanager
def engine_cache(models: dict, **defaults):
    """Yields ``get(variant, fmt="hf", native=True, **options) -> LLMEngine``: float32 engines of
    ``models[variant][fmt]`` (a path), each made once per distinct arguments and dropped on exit. ``defaults`` and
    ``options`` are EngineConfig fields (options win; a None option is the field's default); ``native`` is
    ``native_kernels``."""
    made: dict = {}

    def get(variant: str, fmt: str = "hf", native: bool = True, **options) -> LLMEngine:
        fields = {"dtype": "float32", "kv_cache_bytes": 8 * 2**20, "max_num_seqs": 8, "max_loras": 0,
                  **defaults, **{k: v for k, v in options.items() if v is not None}, "native_kernels": native}
        key = (variant, fmt, tuple(sorted(fields.items())))
        if key not in made:
            made[key] = LLMEngine(EngineConfig(model_path=models[variant][fmt], **fields))
        return made[key]

    try:
        yield get
    finally:
        made.clear()


def reset_rope(model) -> None:
    """Resets transformers' dynamic-RoPE state (it keeps the frequencies of the longest sequence seen until one
    shorter than the original length comes); nothing changes for a static RoPE."""
    rot = model.model.rotary_emb
    if hasattr(rot, "original_inv_freq"):
        rot.inv_freq = rot.original_inv_freq.clone()
        rot.max_seq_len_cached = rot.original_max_seq_len


def hf_forward(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(ids), vocab] of one full forward, the RoPE state reset first."""
    reset_rope(model)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def greedy_reference(model, prompt: list[int], n: int = GEN_TOKENS) -> list[int]:
    """transformers' greedy continuation of ``prompt``: ``n`` token ids, no EOS stop (pad id 2)."""
    reset_rope(model)
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=2)[0, len(prompt):].tolist()


def greedy(n: int) -> SamplingParams:
    """Greedy sampling of exactly ``n`` tokens (EOS ignored)."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_all(engine) -> dict[str, list[int]]:
    """Steps ``engine`` until nothing is unfinished: request id -> generated token ids."""
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def assert_greedy_matches_transformers(engine, model, prompt: list[int], n: int = GEN_TOKENS) -> None:
    """Our ``n`` greedy tokens of ``prompt`` equal transformers' (greedy_reference)."""
    ref = greedy_reference(model, prompt, n)
    engine.add_request(EngineRequest("g", tuple(prompt), greedy(n)))
    assert run_all(engine)["g"] == ref


def assert_batched_equals_alone(engine, prompts: list[list[int]], n: int = 12) -> None:
    """``n`` greedy tokens of each prompt run alone equal those of all prompts run in one batch."""
    alone = []
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"a{i}", tuple(p), greedy(n)))
        alone.append(run_all(engine)[f"a{i}"])
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"b{i}", tuple(p), greedy(n)))
    got = run_all(engine)
    assert [got[f"b{i}"] for i in range(len(prompts))] == alone


def chunked_logits(engine, prompt: list[int], first: int) -> torch.Tensor:
    """Logits [len(prompt), vocab] of ``prompt`` prefilled in two chunks: ``first`` tokens fresh, the rest after the
    cached prefix (the prefix-cache / chunked-prefill attention path)."""
    from actors.worker.engine.model import BatchMetadata

    table = engine.block_manager.allocate("__chunks__", len(prompt))
    try:
        bs, t = engine.config.block_size, engine.runner.tensor
        slots = [table[p // bs] * bs + p % bs for p in range(len(prompt))]
        out = []
        for lo, hi in ((0, first), (first, len(prompt))):
            n = hi - lo
            meta = BatchMetadata(t(list(range(lo, hi))), t(slots[lo:hi]), t(slots[:hi]), [n], [hi], t(list(range(n))))
            out.append(engine.model.forward(t(prompt[lo:hi]), meta, engine.kv.tensor))
        return torch.cat(out)
    finally:
        engine.block_manager.free("__chunks__")


def worst_logit_error(engine, model, prompts: list[list[int]], stepwise: bool = True,
                      chunk_at: int | None = None) -> float:
    """max |ours - transformers| over every position of ``prompts``: our prefill, our one-token steps (``stepwise``)
    and, for prompts longer than ``chunk_at + 1``, a prefill chunked after ``chunk_at`` tokens. Asserts first that
    each reference has logits std >= 1 (the fixtures' scaling holds)."""
    worst = 0.0
    for p in prompts:
        ref = hf_forward(model, p)
        assert ref.std().item() >= 1.0
        parts = [prefill_logits(engine, p)]
        if stepwise:
            parts.append(stepwise_logits(engine, p))
        if chunk_at is not None and len(p) > chunk_at + 1:
            parts.append(chunked_logits(engine, p, chunk_at))
        worst = max([worst] + [(x - ref).abs().max().item() for x in parts])
    return worst


def assert_two_ranks_equal_one(path: str, one, prompts: list[list[int]]) -> None:
    """A float32 engine of ``path`` on two tensor-parallel ranks equals ``one`` (an engine of the same file, one
    rank): prefill logits of ``prompts[0]`` within LOGIT_ATOL, 8 greedy tokens of ``prompts[1]`` equal."""
    two = LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=8 * 2**20, max_loras=0,
                                 tensor_parallel=2))
    try:
        assert (prefill_logits(two, prompts[0]) - prefill_logits(one, prompts[0])).abs().max().item() <= LOGIT_ATOL
        two.add_request(EngineRequest("t", tuple(prompts[1]), greedy(8)))
        one.add_request(EngineRequest("t", tuple(prompts[1]), greedy(8)))
        assert run_all(two)["t"] == run_all(one)["t"]
    finally:
        two.close()


def assert_native_matches_torch_path(native, torch_path, prompts: list[list[int]]) -> None:
    """Prefill and one-token-step logits of ``prompts`` on the engine with the native kernels and on the one with
    the torch path agree within LOGIT_ATOL."""
    for f in (prefill_logits, stepwise_logits):
        a = torch.cat([f(native, p) for p in prompts])
        b = torch.cat([f(torch_path, p) for p in prompts])
        assert (a - b).abs().max().item() <= LOGIT_ATOL


def rel_top1(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||ours - ref|| / ||ref||, share of positions with equal argmax) of logits [positions, vocab]."""
    rel = ((ours - ref).norm() / ref.norm()).item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return rel, top1


def our_logits(path: str, prompt: list[int], change=None) -> torch.Tensor:
    """Our float32 logits [len(prompt), vocab] (torch path) of the model file ``path`` with the spec changed by
    ``change(config, weights) -> config``."""
    from actors.worker.engine.model import BatchMetadata
    from actors.worker.engine.model_families import build_model
    from actors.worker.engine.weights_cache import read_artifact

    art = read_artifact(path, torch.float32)
    cfg = change(art.config, art.weights) if change else art.config
    model = build_model(cfg, art.weights, 128, native_kernels=False)
    n, bs = len(prompt), 16
    kv = torch.zeros(cfg.num_layers, 2, 128 // bs, bs, cfg.num_kv_heads, cfg.head_dim)
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    meta = BatchMetadata(t(list(range(n))), t(list(range(n))), None, [n], [n], t(list(range(n))),
                         block_tables=[list(range(128 // bs))])
    return model.forward(t(prompt), meta, kv)


def control_moves(path: str, model, prompt: list[int], change) -> float:
    """A negative control: asserts our unchanged logits of ``prompt`` are within LOGIT_ATOL of transformers', then
    returns max |changed - unchanged| (the caller asserts it exceeds 100 x LOGIT_ATOL)."""
    on = our_logits(path, prompt)
    assert (on - hf_forward(model, prompt)).abs().max().item() <= LOGIT_ATOL
    return (our_logits(path, prompt, change) - on).abs().max().item()
