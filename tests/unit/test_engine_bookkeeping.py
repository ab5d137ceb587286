"""``LLMEngine``'s request bookkeeping against every runner (actors/worker/engine/runner.py): admission, prefix
cache hits and ``num_cached_tokens``, preemption, stop strings and ids, usage counts and cancel behave the same
over the torch runner (tiny random GGUF) and the zero-compute runner, since both share one engine."""

from __future__ import annotations

import pytest

from actors.worker.engine.engine import EngineConfig, LLMEngine
from actors.worker.engine.types import EngineRequest, SamplingParams
from actors.worker.zero_compute import ZeroComputeConfig, ZeroComputeEngine
from tests.engine_fixtures import write_tiny_llama_gguf

BLOCK = 16
PROMPT = [1] + [40 + (i * 7) % 200 for i in range(39)]  # 40 tokens: two full blocks and a part


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("tinybk") / "tiny.gguf"))


def torch_engine(path, **kw):
    return LLMEngine(EngineConfig(model_path=path, dtype="float32", kv_cache_bytes=2 * 2**20, block_size=BLOCK, **kw))


def zero_engine(path, **kw):
    return ZeroComputeEngine(ZeroComputeConfig(path, kv_cache_bytes=2 * 2**20, block_size=BLOCK, **kw))


@pytest.fixture(params=[torch_engine, zero_engine], ids=["torch", "zero-compute"])
def make(request, tiny_path):
    return lambda **kw: request.param(tiny_path, **kw)


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def run_all(engine, max_steps=500):
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def text(outs):
    return "".join(o.text for o in outs)


def test_admission_refuses_bad_requests_and_counts_credits(make):
    e = make(max_num_seqs=2)
    for bad, match in [((), "empty"), ((e.vocab_size,), "vocabulary"), (tuple([1] * e.max_model_len), "fit")]:
        with pytest.raises(ValueError, match=match):
            e.add_request(EngineRequest("bad", bad, greedy(2)))
    e.add_request(EngineRequest("a", tuple(PROMPT), greedy(2)))
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request(EngineRequest("a", tuple(PROMPT), greedy(2)))
    e.add_request(EngineRequest("b", (1, 2, 3), greedy(2)))
    e.add_request(EngineRequest("c", (1, 2, 4), greedy(2)))  # over max_num_seqs: waits
    free_blocks, free_slots = e.credits()
    assert free_slots == 0 and free_blocks == e.stats().num_total_blocks
    e.step()
    assert e.is_running("a") and e.is_running("b") and not e.is_running("c") and e.has_request("c")
    outs = run_all(e)
    assert {r: o[-1].finish_reason for r, o in outs.items()} == {"a": "length", "b": "length", "c": "length"}
    assert e.credits() == (e.stats().num_total_blocks, 2)


def test_prefix_cache_hits_set_num_cached_tokens(make):
    e = make()
    first = run_all_one(e, "a", PROMPT, tenant="t1")
    second = run_all_one(e, "b", PROMPT, tenant="t1")
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 2 * BLOCK  # the two full prompt blocks
    assert ids(first) == ids(second)
    extra = e.stats().extra
    assert extra["prefix_cache_hit_tokens"] == 2 * BLOCK
    assert extra["prefix_hits_by_tenant"] == {"t1": 2 * BLOCK}
    assert extra["num_kv_reclaims"] == 0


def run_all_one(e, rid, prompt, n=4, **kw):
    e.add_request(EngineRequest(rid, tuple(prompt), greedy(n), **kw))
    return run_all(e)[rid]


def test_preempted_request_resumes_as_if_uninterrupted(make):
    solo = run_all_one(make(), "a", PROMPT, n=8)
    e = make()
    e.add_request(EngineRequest("a", tuple(PROMPT), greedy(8)))
    got = [o for _ in range(3) for o in e.step()]
    assert e.preempt_request("a") and not e.is_running("a") and "a" in e.stats().paused
    got += run_all(e)["a"]
    assert ids(got) == ids(solo) and got[-1].finish_reason == "length"
    assert e.stats().extra["num_preemptions"] == 1


def test_stop_token_id_and_stop_string(make):
    solo = run_all_one(make(), "a", PROMPT, n=8)
    toks, full = ids(solo), text(solo)
    k = 2
    e = make()
    e.add_request(EngineRequest("id", tuple(PROMPT), greedy(8, stop_token_ids=(toks[k],))))
    out = run_all(e)["id"]
    first = toks.index(toks[k])
    assert ids(out) == toks[:first + 1] and out[-1].finish_reason == "stop"
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), repr(full)
    e.add_request(EngineRequest("str", tuple(PROMPT), greedy(8, stop=(stop,))))
    out = run_all(e)["str"]
    assert text(out) == full[:full.index(stop)] and out[-1].finish_reason == "stop"


def test_usage_counts_prompt_generated_and_served(make):
    e = make()
    run_all_one(e, "a", PROMPT, n=5, tenant="t1")
    run_all_one(e, "b", PROMPT[:10], n=3, tenant="t2")
    s = e.stats()
    assert s.num_generated_tokens == 8
    assert s.num_prompt_tokens == len(PROMPT) + 10
    assert s.served == {"t1": [len(PROMPT), 5], "t2": [10, 3]}
    assert s.num_running == s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks


def test_recomputed_prompt_counts_as_prompt_tokens_not_as_service(make):
    e = make()
    e.add_request(EngineRequest("a", tuple(PROMPT), greedy(6), tenant="t"))
    e.step()
    e.step()
    e.reset_prefix_cache()
    assert e.preempt_request("a")
    run_all(e)
    s = e.stats()
    assert s.served == {"t": [len(PROMPT), 6]}
    assert s.num_prompt_tokens == 2 * len(PROMPT)  # the recomputation is prompt compute again


def test_cancel_reports_abort_once_and_frees_blocks(make):
    e = make()
    e.add_request(EngineRequest("a", tuple(PROMPT), greedy(50)))
    e.add_request(EngineRequest("b", tuple(PROMPT[:5]), greedy(3)))
    e.step()
    e.abort_request("a")
    assert not e.has_request("a") and e.has_unfinished()
    outs = run_all(e)
    assert [o.finish_reason for o in outs["a"]] == ["abort"] and outs["a"][0].new_token_ids == ()
    assert outs["b"][-1].finish_reason == "length"
    e.abort_request("a")  # unknown now: nothing
    assert not e.has_unfinished() and e.credits()[0] == e.stats().num_total_blocks


def test_detached_request_resumes_in_another_engine(make):
    solo = run_all_one(make(), "a", PROMPT, n=6)
    e = make()
    e.add_request(EngineRequest("a", tuple(PROMPT), greedy(6)))
    got = [o for _ in range(3) for o in e.step()]
    done, rng = e.detach_request("a")
    assert not e.has_unfinished() and isinstance(rng, bytes)
    other = make()
    other.add_request(EngineRequest("a", tuple(PROMPT), greedy(6), resumed_output_ids=done, rng_state=rng or None))
    got += run_all(other)["a"]
    assert ids(got) == ids(solo)
