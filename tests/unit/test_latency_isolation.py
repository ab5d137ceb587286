"""Pure parts of latency isolation (issue [17]): priority-class victims, VTC ledger, output-length model,
completion-time prediction and the deadline check that uses it."""

from __future__ import annotations

import pytest

from actors.scheduler.fair_queue import ADMITTED, DEADLINE_UNMEETABLE, FairQueue, service_tokens
from actors.scheduler.policy import WorkerTable, priority_victim, same_class
from actors.scheduler.vtc import (MIN_SAMPLES, PRIOR_OUTPUT_TOKENS, OutputLengthModel, ServiceLedger,
                                  predict_service_s)

RUNNING = [("b1", "D", "batch"), ("i1", "C", "interactive"), ("b2", "D", "batch"), ("i2", "A", "interactive")]


def test_an_interactive_head_takes_the_newest_batch_request_whatever_its_tenant():
    assert priority_victim("interactive", RUNNING) == "b2"
    assert priority_victim("interactive", [r for r in RUNNING if r[2] == "interactive"]) is None


def test_a_batch_head_never_gets_a_priority_victim_and_only_sees_batch_work():
    assert priority_victim("batch", RUNNING) is None
    assert same_class("batch", RUNNING) == [("b1", "D"), ("b2", "D")]
    assert same_class("interactive", RUNNING) == [("i1", "C"), ("i2", "A")]


def test_service_tokens_weigh_a_completion_token_twice():
    assert service_tokens(10, 5) == 20


def test_ledger_counts_cumulative_tokens_and_windowed_shares():
    led = ServiceLedger(window_s=10.0)
    led.add_heartbeat(0.0, {"A": [30, 10], "B": [10, 0]})
    led.add_heartbeat(5.0, {"A": [0, 10], "bad": ["x"], "neg": [-1, 2]})
    assert led.prompt_tokens == {"A": 30, "B": 10} and led.completion_tokens == {"A": 20, "B": 0}
    assert led.shares(5.0) == pytest.approx({"A": 70 / 80, "B": 10 / 80})
    assert led.shares(12.0) == {"A": 1.0}  # the first heartbeat left the window; totals stay
    assert led.prompt_tokens["A"] == 30
    with pytest.raises(ValueError):
        led.add(0.0, "A", -1, 0)


def test_output_length_model_uses_the_prior_then_the_quantile_of_natural_ends():
    m = OutputLengthModel()
    assert m.expected(4096, ignore_eos=False) == PRIOR_OUTPUT_TOKENS
    assert m.expected(16, ignore_eos=False) == min(16, PRIOR_OUTPUT_TOKENS)
    assert m.expected(4096, ignore_eos=True) == 4096
    for i in range(MIN_SAMPLES):
        m.observe(10 + i, "stop")
        m.observe(4000, "length")  # cut by max_tokens: says nothing about natural length
    assert m.expected(4096, ignore_eos=False) == 10 + round(0.5 * (MIN_SAMPLES - 1))


def test_predicted_service_is_prefill_plus_decode_steps_and_unmeasured_rates_add_nothing():
    assert predict_service_s(1000, 50, 20.0, 2000.0) == pytest.approx(0.5 + 50.5 * 0.02)
    assert predict_service_s(1000, 50, 0.0, 0.0) == 0.0


def test_deadline_admission_counts_the_requests_own_cost_even_with_no_queue():
    q = FairQueue()
    assert q.can_admit("A", "interactive", 100, 10.0, 0.0, None, own_s=11.0) == DEADLINE_UNMEETABLE
    assert q.can_admit("A", "interactive", 100, 10.0, 0.0, None, own_s=9.0) == ADMITTED
    q.push("x", "A", 1.0, "interactive", 1000, 0, None)
    # A's own 1000 tokens ahead at 500 tokens/s = 2 s of wait, plus 9 s own: past a 10 s deadline
    assert q.can_admit("A", "interactive", 100, 10.0, 0.0, 500.0, own_s=9.0) == DEADLINE_UNMEETABLE
    assert q.can_admit("A", "interactive", 100, 12.0, 0.0, 500.0, own_s=9.0) == ADMITTED
    # fair share: another tenant waits only for A's share of the next 100 tokens (0.2 s)
    assert q.can_admit("B", "interactive", 100, 9.5, 0.0, 500.0, own_s=9.0) == ADMITTED


def test_worker_table_speed_is_the_median_of_fresh_measured_workers():
    t = WorkerTable(stale_after_s=2.0)
    for wid, step, pf in (("a", 10.0, 1000.0), ("b", 30.0, 0.0), ("c", 20.0, 3000.0)):
        t.on_lease(wid, True)
        t.on_credits(wid, 10, 1, 16, False, 0.0, 10, 1, step, pf)
    assert t.speed(1.0) == (20.0, 3000.0)
    t.on_credits("a", 10, 1, 16, False, 0.5, 10, 1, 0.0, 0.0)  # 0 keeps the last measurement
    assert t.workers["a"].step_ms == 10.0
    assert t.speed(10.0) == (0.0, 0.0)  # all stale: no prediction


def test_cannot_finish_only_with_a_deadline_and_a_prediction():
    from actors.scheduler.vtc import cannot_finish
    assert cannot_finish(10.0, 5.0, 6.0) and not cannot_finish(10.0, 5.0, 4.0)
    assert not cannot_finish(0.0, 5.0, 60.0) and not cannot_finish(10.0, 9.0, 0.0)


def test_service_time_calibration_is_a_high_quantile_of_actual_minus_predicted_within_bounds():
    from actors.scheduler.vtc import ServiceTimeCalibration
    cal = ServiceTimeCalibration(quantile=0.9, window=20, min_samples=10, max_margin_s=4.0)
    for i in range(9):
        cal.observe(1.0, 1.0 + i / 10)
    assert cal.margin_s == 0.0  # too few samples
    cal.observe(1.0, 1.9)
    assert cal.margin_s == pytest.approx(0.8)  # the 90th percentile of 0.0 .. 0.9 s
    for _ in range(20):
        cal.observe(1.0, 100.0)  # clamped; the old residuals leave the window
    assert cal.margin_s == pytest.approx(4.0)
    cal.observe(0.0, 1.0)  # no prediction: ignored
    assert cal.margin_s == pytest.approx(4.0)


def test_slot_wait_is_the_earliest_predicted_finish_when_every_slot_is_taken():
    from actors.scheduler.vtc import slot_wait_s
    assert slot_wait_s(10.0, [12.0, 11.0], free_slots=0) == pytest.approx(1.0)
    assert slot_wait_s(10.0, [12.0, 11.0], free_slots=1) == 0.0
    assert slot_wait_s(10.0, [9.0], free_slots=0) == 0.0 and slot_wait_s(10.0, [], free_slots=0) == 0.0


def test_a_finished_request_gives_its_slot_back_before_the_next_heartbeat():
    t = WorkerTable()
    t.on_lease("w", True)
    t.on_credits("w", 10, 0, 16, False, 0.0, 10, 2, sent_ts=100.0)
    t.workers["w"].inflight.update({"a": True, "b": True})
    t.on_done("a", finished_ts=99.0)  # finished before the heartbeat was sent: already counted free
    assert t.workers["w"].free_slots == 0
    t.on_done("b", finished_ts=100.5)
    assert t.workers["w"].free_slots == 1
    t.on_done("zz", finished_ts=101.0)  # not in flight there: nothing
    assert t.workers["w"].free_slots == 1


def test_the_engine_lists_preempted_sequences_waiting_to_resume():
    from actors.worker.engine.block_manager import BlockManager
    from actors.worker.engine.iteration_scheduler import IterationScheduler
    s = IterationScheduler(BlockManager(100, 4), 2, 64)
    s.add("a", 8)
    s.add("b", 8)
    s.commit(s.schedule())
    s.add("c", 8, front=True)
    assert s.paused_ids() == [] and s.preempt("b")
    assert s.paused_ids() == ["b"]  # "c" waits too, but was never preempted
    s.commit(s.schedule())  # "c" takes the freed slot; "b" still waits
    assert s.paused_ids() == ["b"]
