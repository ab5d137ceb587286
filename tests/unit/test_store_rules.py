"""Pure rules of the KV-backed stores: quota windows and slots, usage records, idempotency records,
job status transitions (no bucket, no clock: every ``now`` is given)."""

from __future__ import annotations

import pytest

from actors import job_store as jobs
from bus.messages import CompletionRecord
from gateway import idempotency as idem
from gateway import quotas as q
from gateway import usage


# -- quotas ----------------------------------------------------------------------------------------

def test_window_add_prunes_what_left_the_window():
    v = q.window_add(None, 5, 1000.2)
    v = q.window_add(v, 2, 1000.9)
    assert v == {"b": {"1000": 7}}
    v = q.window_add(v, 1, 1059.0)
    assert q.window_sum(v["b"], 1059.5) == (8, v["b"], 1000)
    v = q.window_add(v, 1, 1060.0)  # second 1000 is out of [1001, 1060]
    assert v == {"b": {"1059": 1, "1060": 1}}


def test_rpm_take_refuses_at_the_limit_without_writing():
    v = None
    for i in range(3):
        v = q.rpm_take(v, 3, 500.0 + i)
    assert q.window_sum(v["b"], 502.0)[0] == 3
    assert q.rpm_take(v, 3, 502.5) is None
    assert q.rpm_take(v, 3, 560.0) == {"b": {"501": 1, "502": 1, "560": 1}}


def test_slots_take_release_refresh_and_lapse():
    v = q.slot_take(None, "r1", 2, 100.0)
    v = q.slot_take(v, "r2", 2, 101.0)
    assert v == {"s": {"r1": 100.0 + q.SLOT_TTL_S, "r2": 101.0 + q.SLOT_TTL_S}}
    assert q.slot_take(v, "r3", 2, 102.0) is None  # full
    assert q.slot_take(v, "r3", 2, 100.0 + q.SLOT_TTL_S) == {"s": {"r2": 101.0 + q.SLOT_TTL_S,
                                                                   "r3": 100.0 + 2 * q.SLOT_TTL_S}}  # r1 lapsed
    assert q.slot_release(v, "nope") is None
    assert q.slot_release(v, "r1") == {"s": {"r2": 101.0 + q.SLOT_TTL_S}}
    later = 101.0 + q.SLOT_TTL_S + 5  # both leases ran out; only ours (r2) is renewed
    assert q.slot_refresh(v, {"r2"}, later) == {"s": {"r2": later + q.SLOT_TTL_S}}


def test_daily_tokens_and_day_keys():
    assert q.day_add(q.day_add(None, 5), 7) == {"t": 12}
    assert q.day(0) == "19700101" and q.day(86399.9) == "19700101" and q.day(86400) == "19700102"


# -- usage -----------------------------------------------------------------------------------------

def _rec(rid="r", status="ok", prompt=10, completion=5, choice=0, name="m", version="1") -> CompletionRecord:
    return CompletionRecord(rid, "t", name, version, status, "stop", prompt, completion, {}, choice_index=choice)


def test_apply_record_counts_a_fanned_out_request_once():
    u = usage.apply_record(None, _rec("a", choice=0))
    u = usage.apply_record(u, _rec("a", choice=1))
    u = usage.apply_record(u, _rec("b", status="cancelled", prompt=3, completion=0, version="2"))
    assert u == {"m@1": {"requests": 1, "prompt_tokens": 10, "completion_tokens": 10, "by_status": {"ok": 1}},
                 "m@2": {"requests": 1, "prompt_tokens": 3, "completion_tokens": 0, "by_status": {"cancelled": 1}}}
    assert [r["total_tokens"] for r in usage.usage_rows(u)] == [20, 3] and usage.usage_rows(None) == []
    assert usage.charged_tokens(_rec(choice=0)) == 15 and usage.charged_tokens(_rec(choice=2)) == 5


def test_apply_record_does_not_mutate_its_input():
    before = usage.apply_record(None, _rec())
    snapshot = {k: {**v, "by_status": dict(v["by_status"])} for k, v in before.items()}
    usage.apply_record(before, _rec())
    assert before == snapshot


# -- idempotency -----------------------------------------------------------------------------------

def test_idempotency_claim_heartbeat_and_stale_takeover():
    rec = idem.running_record("h", "gw1", deadline=200.0, now=100.0)
    assert rec == {"state": "running", "body_hash": "h", "gateway": "gw1", "heartbeat": 100.0, "deadline": 200.0}
    assert not idem.is_stale(rec, 100.0 + idem.STALE_S)
    assert idem.is_stale(rec, 100.0 + idem.STALE_S + 0.1)
    assert idem.heartbeat(rec, "gw1", 105.0)["heartbeat"] == 105.0 and rec["heartbeat"] == 100.0
    assert idem.heartbeat(rec, "gw2", 105.0) is None  # taken over: the old owner stops beating
    assert idem.heartbeat(None, "gw1", 105.0) is None


def test_idempotency_results_stick_or_not():
    assert [idem.sticky(s) for s in (200, 400, 404, 408, 429, 500, 503)] == [True, True, True, False, False,
                                                                              False, False]
    running = idem.running_record("h", "gw1", 200.0, 100.0)
    assert idem.finish_action(running, "h", 200) == "store" and idem.finish_action(running, "h", 429) == "delete"
    assert idem.finish_action(running, "other", 200) is None and idem.finish_action(None, "h", 200) is None
    done = idem.done_record("h", "gw1", 200, {"a": "b"}, None, [b"x", b"y"], 150.0)
    assert done["state"] == "done" and done["events"] == ["x", "y"] and done["finished"] == 150.0
    assert not idem.is_stale(done, 10_000.0)


# -- jobs ------------------------------------------------------------------------------------------

def _job(status: str, **kw) -> dict:
    return {"id": "job_1", "status": status, "expires_at": 1000.0, **kw}


def test_job_begin():
    assert jobs.begin(_job("validating"), 10.0) == _job("in_progress", in_progress_at=10.0, attempts=1)
    again = jobs.begin(_job("in_progress", in_progress_at=10.0, attempts=1), 20.0)  # redelivered
    assert (again["in_progress_at"], again["attempts"]) == (10.0, 2)
    assert jobs.begin(_job("cancelling"), 20.0) == _job("cancelled", cancelled_at=20.0)
    assert jobs.begin(_job("validating"), 1001.0) == _job("expired", expired_at=1001.0)
    assert all(jobs.begin(_job(s), 1.0) is None for s in jobs.TERMINAL)


def test_job_cancel_finalize_finish():
    assert jobs.cancel(_job("validating"), 5.0) == _job("cancelled", cancelled_at=5.0)
    assert jobs.cancel(_job("finalizing"), 5.0)["status"] == "cancelling"
    assert jobs.cancel(_job("completed"), 5.0) is None and jobs.cancel(_job("cancelling"), 5.0) is None
    assert jobs.finalizing(_job("in_progress"))["status"] == "finalizing"
    assert jobs.finalizing(_job("cancelling")) is None
    done = jobs.finish(_job("finalizing"), "completed", {"request_counts": {"total": 1}}, 9.0)
    assert done == _job("completed", completed_at=9.0, request_counts={"total": 1})
    assert jobs.finish(_job("cancelled"), "completed", {}, 9.0) is None
    late = jobs.finish(_job("cancelling"), "completed", {"request_counts": {"total": 1, "completed": 1}}, 9.0)
    assert late == _job("cancelled", cancelled_at=9.0, request_counts={"total": 1, "completed": 1})
    with pytest.raises(ValueError, match="final status"):
        jobs.finish(_job("in_progress"), "finalizing", {}, 9.0)
