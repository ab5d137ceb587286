"""One record per request (issue [19] item 5, docs/decisions/0050-one-record-per-request.md).

Engine: a request's ``RequestState`` is the very object the iteration scheduler queues and runs (no copy of its
scheduling keys kept elsewhere), and every exit (finished, aborted, detached for a migration) takes it out of the
book and the scheduler together. Worker: ``Live`` holds the abort asked for, the pending add's placement and a
hand-over's resume state, so cancelling and migrating read and write that one record. The zero-compute engine
(the real bookkeeping behind a runner without a model) keeps these tests fast.
"""

from __future__ import annotations

import pytest

from actors.worker.engine.types import EngineRequest, SamplingParams
from actors.worker.live import Live
from actors.worker.migration_state import ResumeState
from actors.worker.zero_compute import ZeroComputeConfig, ZeroComputeEngine
from bus.messages import GenerateRequest
from tests.engine_fixtures import write_tiny_llama_gguf


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama_gguf(str(tmp_path_factory.mktemp("rec") / "tiny.gguf"))


def engine(path) -> ZeroComputeEngine:
    return ZeroComputeEngine(ZeroComputeConfig(path, kv_cache_bytes=2 * 2**20, block_size=16))


def req(rid: str, n: int = 4, **kw) -> EngineRequest:
    return EngineRequest(rid, tuple(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                         **kw)


def test_the_engine_keeps_one_object_per_request_shared_by_the_book_and_the_scheduler(tiny_path):
    e = engine(tiny_path)
    e.add_request(req("a", priority="batch", tenant="t1", tenant_weight=2.0, cache_salt=b"s", urgent=True))
    r = e.book.get("a")
    assert len(e.scheduler.waiting) == 1 and e.scheduler.waiting[0] is r
    # its scheduling keys come from the request it holds
    assert (r.batch, r.urgent, r.tenant, r.weight, r.salt, r.adapter) == (True, True, "t1", 2.0, b"s", "")
    assert r.req.request_id == r.seq_id == "a" and r.token_ids is not None and r.num_tokens == len(r.token_ids)
    e.step()
    assert e.scheduler.running[0] is r and r.num_computed_tokens == 20 and len(r.output_ids) == 1
    assert r.num_tokens == len(r.token_ids) == 21  # one token list, one counter, on one object
    while e.has_unfinished():
        e.step()
    assert not e.has_request("a") and not e.scheduler.has_unfinished()  # finished: out of both at once


@pytest.mark.parametrize("exit_", ["abort", "detach"])
def test_every_exit_takes_the_record_out_of_the_book_and_the_scheduler(tiny_path, exit_):
    e = engine(tiny_path)
    e.add_request(req("x", 8))
    e.add_request(req("y", 8))
    e.step()
    if exit_ == "abort":
        e.abort_request("x")
        assert [o.finish_reason for o in e.step() if o.request_id == "x"] == ["abort"]
    else:
        output_ids, _ = e.detach_request("x")
        assert len(output_ids) == 1
    assert not e.has_request("x") and [s.seq_id for s in e.scheduler.running] == ["y"]
    with pytest.raises(KeyError):  # its blocks were freed with it
        e.block_manager.block_table("x")


def test_a_migrated_sequence_starts_from_its_generated_tokens_in_its_one_record(tiny_path):
    e = engine(tiny_path)
    e.add_request(req("m", 6, resumed_output_ids=(40, 41)))
    r = e.book.get("m")
    assert r.output_ids == [40, 41] and r.token_ids[-2:] == [40, 41] and r.num_tokens == 22
    assert r.prompt_served == 20  # served (and counted) by the worker it came from


def gen(rid="r", resume=None) -> GenerateRequest:
    return GenerateRequest(rid, "t", "m", "1", "inbox.x", (1, 2), SamplingParams(), resume=resume)


def test_live_keeps_the_abort_asked_for_until_it_is_applied():
    lv = Live(gen(), 1.0)
    lv.request_abort("client", step=7)
    lv.request_abort("deadline", step=9)  # the first reason and the first cancel's step win
    assert (lv.abort_pending, lv.cancel_step, lv.aborted) == ("client", 7, "")
    assert lv.take_abort() == "client" and (lv.aborted, lv.abort_pending) == ("client", "")
    lv.request_abort("drain")
    assert lv.take_abort() == "" and lv.aborted == "client"  # aborted once
    assert Live(gen(), 1.0).take_abort() == ""


def test_live_builds_the_resume_state_of_a_hand_over_from_its_own_stream_position():
    prev = ResumeState("w0", (5, 6), seq=2, t_in=1.0, t_first=2.0, echo_pending=False, migrations=2)
    lv = Live(gen(resume=prev.to_json()), 3.0)
    lv.resume(lv.req, None)
    assert lv.migrations == 2 and (lv.seq, lv.num_generated, lv.t_in) == (2, 2, 1.0)
    lv.seq += 3  # three chunks sent here
    st = lv.resume_state("w1", (5, 6, 7, 8, 9), b"rng", 10.0)
    assert st == ResumeState("w1", (5, 6, 7, 8, 9), 5, b"rng", 1.0, 2.0, False, 3, 10.0)
    assert ResumeState.from_json(st.to_json()) == st
    assert Live(gen(), 1.0).migrations == 0
