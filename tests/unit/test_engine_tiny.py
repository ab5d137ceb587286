"""LLMEngine on the tiny random GGUF (fast): batching invariants, stopping, aborts, preemption.

Also a reference check of the tiny model against Hugging Face transformers (GQA with 4 query /
2 KV heads exercises the Q/K un-permutation; one Q8_0 tensor exercises dequantization).
"""

from __future__ import annotations

import pytest
import torch

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from tests.engine_fixtures import load_hf_llama, prefill_logits, write_tiny_llama_gguf

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))


def make_engine(path, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model_path=path, kv_cache_bytes=kw.pop("kv_cache_bytes", 4 * 2**20), **kw))


def req(rid, prompt, **params) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(**params))


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until done; returns {request_id: [StepOutput, ...]}."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


PROMPTS = [[1, 40 + i, 50 + 2 * i, 60, 70 + i, 80] * (1 + i % 3) for i in range(6)]


def solo_tokens(path, prompt, n=12, **kw):
    e = make_engine(path, **kw)
    e.add_request(req("x", prompt, max_tokens=n, **GREEDY))
    return tokens(run_all(e)["x"])


def test_matches_transformers_logits_and_greedy(tiny_path):
    hf = load_hf_llama(tiny_path)
    prompt = [1, 50, 60, 70, 80, 90, 100, 110]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
        ref_gen = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    e = make_engine(tiny_path)
    e.add_request(req("a", prompt, max_tokens=16, **GREEDY))
    assert tokens(run_all(e)["a"]) == ref_gen[0, len(prompt):].tolist()
    ours = prefill_logits(e, prompt)[-1]
    assert (ours - ref).abs().max().item() < 1e-4


def test_batched_equals_solo_and_chunked_prefill(tiny_path):
    solo = [solo_tokens(tiny_path, p) for p in PROMPTS]
    e = make_engine(tiny_path, max_num_batched_tokens=7)  # forces chunked prefills
    for i, p in enumerate(PROMPTS):
        e.add_request(req(f"r{i}", p, max_tokens=12, **GREEDY))
    outs = run_all(e)
    assert [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == solo
    assert all(len(o.new_token_ids) == 1 for v in outs.values() for o in v)


def test_preemption_under_tiny_kv_budget_gives_same_tokens(tiny_path):
    solo = [solo_tokens(tiny_path, p, n=20) for p in PROMPTS]
    e = make_engine(tiny_path, kv_cache_bytes=12 * 8192, block_size=16)  # 12 blocks = 192 slots
    for i, p in enumerate(PROMPTS):
        e.add_request(req(f"r{i}", p, max_tokens=20, **GREEDY))
    outs = run_all(e)
    assert [tokens(outs[f"r{i}"]) for i in range(len(PROMPTS))] == solo
    assert e.stats().extra["num_preemptions"] > 0
    assert e.credits()[0] == e.stats().num_total_blocks


def test_max_tokens_length_and_counters(tiny_path):
    e = make_engine(tiny_path)
    e.add_request(req("a", [1, 2, 3], max_tokens=5, **GREEDY))
    outs = run_all(e)["a"]
    assert len(outs) == 5 and outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    assert [o.num_generated_tokens for o in outs] == [1, 2, 3, 4, 5]
    assert outs[0].num_prompt_tokens == 3
    s = e.stats()
    assert s.num_steps == 5 and s.num_generated_tokens == 5 and s.num_prompt_tokens == 3


def test_stop_token_ids_and_eos(tiny_path):
    first = solo_tokens(tiny_path, PROMPTS[0], n=20)
    k = next(i for i, t in enumerate(first) if t not in first[:i] and i > 0)
    e = make_engine(tiny_path)
    e.add_request(req("a", PROMPTS[0], max_tokens=30, temperature=0.0, stop_token_ids=(first[k],)))
    outs = run_all(e)["a"]
    assert tokens(outs) == first[: k + 1] and outs[-1].finish_reason == "stop"
    assert outs[-1].text == ""  # the stop token's text is not emitted


def test_stop_string_truncates_text(tiny_path):
    params = dict(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    e = make_engine(tiny_path)
    e.add_request(req("a", PROMPTS[1], **params))
    full = "".join(o.text for o in run_all(e)["a"])
    stop = full[10:12]
    cut = full.index(stop)
    e.add_request(req("b", PROMPTS[1], stop=(stop,), **params))
    outs = run_all(e)["b"]
    assert "".join(o.text for o in outs) == full[:cut]
    assert outs[-1].finish_reason == "stop"


def test_seeded_sampling_reproducible_across_batches(tiny_path):
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=10)
    e = make_engine(tiny_path)
    e.add_request(req("a", PROMPTS[2], **params))
    alone = tokens(run_all(e)["a"])
    for i, p in enumerate(PROMPTS):
        e.add_request(req(f"o{i}", p, temperature=1.0, max_tokens=10))
    e.add_request(req("b", PROMPTS[2], **params))
    assert tokens(run_all(e)["b"]) == alone


def test_abort_reports_and_frees(tiny_path):
    e = make_engine(tiny_path)
    total = e.credits()[0]
    e.add_request(req("a", PROMPTS[3], max_tokens=50, **GREEDY))
    e.add_request(req("b", PROMPTS[4], max_tokens=3, **GREEDY))
    e.step()
    e.abort_request("a")
    e.abort_request("nope")  # unknown ids are ignored
    outs = e.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    run_all(e)
    assert not e.has_unfinished() and e.credits() == (total, 32)


def test_add_request_validation(tiny_path):
    e = make_engine(tiny_path, max_model_len=16)
    with pytest.raises(ValueError):
        e.add_request(req("a", []))
    with pytest.raises(ValueError):
        e.add_request(req("a", [1] * 16))
    with pytest.raises(ValueError):
        e.add_request(req("a", [e.vocab_size]))
    e.add_request(req("a", [1] * 10, max_tokens=100, **GREEDY))
    with pytest.raises(ValueError):
        e.add_request(req("a", [1]))
    outs = run_all(e)["a"]
    assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 6


@pytest.mark.parametrize(
    "kw",
    [dict(model_path=""), dict(dtype="float16"), dict(kv_cache_bytes=0), dict(block_size=0),
     dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(max_model_len=1)],
)
def test_engine_config_validation(kw):
    with pytest.raises(ValueError):
        EngineConfig(**{"model_path": "x.gguf", **kw})


def test_engine_properties_and_bfloat16(tiny_path):
    e = make_engine(tiny_path, dtype="bfloat16", max_num_seqs=4)
    assert e.eos_token_ids == (2,) and e.vocab_size == 269 and e.max_model_len == 512
    e.add_request(req("a", PROMPTS[0], max_tokens=4, **GREEDY))
    assert len(tokens(run_all(e)["a"])) == 4
    assert e.credits()[1] == 4


def test_eos_stops_unless_ignore_eos(tiny_path):
    first = solo_tokens(tiny_path, PROMPTS[0], n=20)
    k = next(i for i, t in enumerate(first) if t not in first[:i] and i > 0)
    e = make_engine(tiny_path)
    e.eos_token_ids = (first[k],)  # pretend this token is EOS
    e.add_request(req("a", PROMPTS[0], max_tokens=20, temperature=0.0))
    e.add_request(req("b", PROMPTS[0], max_tokens=20, **GREEDY))
    outs = run_all(e)
    assert tokens(outs["a"]) == first[: k + 1] and outs["a"][-1].finish_reason == "stop"
    assert tokens(outs["b"]) == first and outs["b"][-1].finish_reason == "length"
