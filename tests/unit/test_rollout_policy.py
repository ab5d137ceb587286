"""Canary analysis rules (actors/rollout/policy.py): pure, no I/O."""

from __future__ import annotations

import pytest

from bus.messages import CompletionRecord
from control.state.routing import RoutingTable, start_rollout
from actors.rollout.policy import (PolicyConfig, Sample, VersionWindow, analyse, itl_ms, next_weight, percentile,
                                    sample_from_record, summarise, ttft_ms)

T0 = 1_000_000.0
CFG = PolicyConfig(window_s=30, min_samples=20, step_interval_s=10)


def table(weight: float = 5.0, started: float = T0, **kw) -> RoutingTable:
    return start_rollout(RoutingTable(), stable="1", canary="2", weight=weight, now=started, **kw)


def samples(n: int, *, t: float = T0 + 5, errors: int = 0, cancelled: int = 0, ttft: float = 100.0,
            itl: float = 20.0) -> list[Sample]:
    out = [Sample(t + i * 0.01, "error", ttft, None) for i in range(errors)]
    out += [Sample(t + i * 0.01, "cancelled", None, None) for i in range(cancelled)]
    out += [Sample(t + i * 0.01, "ok", ttft, itl) for i in range(n - errors - cancelled)]
    return out


# --- config ---------------------------------------------------------------------------------------


def test_config_defaults_and_validation():
    c = PolicyConfig()
    assert (c.window_s, c.min_samples, c.step_interval_s, c.max_error_rate_delta) == (30.0, 20, 10.0, 0.05)
    assert (c.max_ttft_p95_ratio, c.max_itl_p95_ratio, c.ttft_slack_ms, c.itl_slack_ms) == (1.5, 1.5, 50.0, 20.0)
    for bad in ({"window_s": 0}, {"min_samples": 0}, {"min_samples": 2.5}, {"max_error_rate_delta": 1.5},
                {"max_ttft_p95_ratio": 0.9}, {"itl_slack_ms": -1}, {"step_interval_s": "10"}, {"auto": "no"},
                {"window_s": float("nan")}, {"min_samples": True}):
        with pytest.raises(ValueError, match="analysis."):
            PolicyConfig(**bad)


def test_config_from_analysis():
    c = PolicyConfig.from_analysis({"min_samples": 5, "window_s": 2})
    assert c.min_samples == 5 and c.window_s == 2.0 and c.max_itl_p95_ratio == 1.5
    with pytest.raises(ValueError, match="unknown analysis setting"):
        PolicyConfig.from_analysis({"min_sample": 5})
    assert PolicyConfig.from_analysis({"min_sample": 5, "window_s": 3}, strict=False).window_s == 3.0
    assert PolicyConfig.from_analysis(None) == PolicyConfig()


# --- samples --------------------------------------------------------------------------------------


def test_ttft_and_itl_from_timing():
    assert ttft_ms({"queue_ms": 10, "prefill_ms": 40, "decode_ms": 500}) == 50.0
    assert ttft_ms({"queue_ms": 10, "prefill_ms": 40, "validation_ms": 3, "gateway_ms": 2}) == 55.0
    assert ttft_ms({"decode_ms": 5}) is None
    assert itl_ms({"decode_ms": 90}, 10) == 10.0
    assert itl_ms({"decode_ms": 90}, 1) is None
    assert itl_ms({}, 10) is None


def test_sample_from_completion_record():
    rec = CompletionRecord("r", "t", "m", "2", "ok", "stop", 3, 5, {"queue_ms": 1.0, "prefill_ms": 9.0,
                                                                     "decode_ms": 40.0}, ts=T0)
    s = sample_from_record(rec)
    assert s == Sample(T0, "ok", 10.0, 10.0)
    assert sample_from_record(rec.__dict__ | {"ts": 0.0}, received_at=T0 + 1).ts == T0 + 1
    assert sample_from_record({"status": "weird"}).status == "error"


def test_percentile_nearest_rank():
    assert percentile([], 95) is None
    assert percentile([5.0], 95) == 5.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0
    assert percentile([float(i) for i in range(1, 21)], 95) == 19.0


def test_summarise_excludes_cancelled_and_out_of_window():
    s = summarise(samples(10, errors=2, cancelled=3) + [Sample(T0 - 100, "error")], since=T0, until=T0 + 60)
    assert (s.ok, s.errors, s.cancelled, s.n) == (5, 2, 3, 7)
    assert s.error_rate == pytest.approx(2 / 7)
    assert s.ttft_count == 5 and s.itl_count == 5


def test_window_prunes_old_samples():
    w = VersionWindow(maxlen=3)
    for i in range(5):
        w.add(Sample(T0 + i, "ok"))
    assert len(w) == 3
    w.prune(T0 + 4)
    assert [s.ts for s in w.samples] == [T0 + 4]


def test_next_weight():
    assert next_weight((5, 25, 50, 100), 5) == 25
    assert next_weight((5, 25, 50, 100), 10) == 25
    assert next_weight((5, 25, 50, 100), 50) == 100
    assert next_weight((5, 25, 50, 100), 100) == 100


# --- decisions ------------------------------------------------------------------------------------


def test_waits_for_min_samples_on_both_sides():
    d = analyse(table(), samples(50), samples(19), CFG, T0 + 20)
    assert d.action == "wait" and "canary has 19/20" in d.reasons[0]
    d = analyse(table(), samples(5), samples(30), CFG, T0 + 20)
    assert d.action == "wait" and "stable has 5/20" in d.reasons[0]
    assert d.weight == 5.0


def test_healthy_canary_steps_after_the_interval_then_promotes():
    t = table()
    d = analyse(t, samples(40), samples(20), CFG, T0 + 8)
    assert d.action == "wait" and "healthy; next step" in d.reasons[0]
    d = analyse(t, samples(40), samples(20), CFG, T0 + 11)
    assert d.action == "step" and d.weight == 25.0
    assert any("error rate: canary 0.0%" in r for r in d.reasons)
    assert any(r.startswith("TTFT p95: canary 100.0 ms") for r in d.reasons)
    t50 = table(weight=50.0)
    d = analyse(t50, samples(40), samples(40), CFG, T0 + 11)
    assert d.action == "promote" and d.weight == 100.0 and "promoting canary 2" in d.reasons[0]


def test_step_interval_counts_from_the_last_decision():
    from control.state.routing import set_weight
    t = set_weight(table(), 25.0, by="controller", now=T0 + 12)
    assert analyse(t, samples(40, t=T0 + 13), samples(40, t=T0 + 13), CFG, T0 + 20).action == "wait"
    assert analyse(t, samples(40, t=T0 + 13), samples(40, t=T0 + 13), CFG, T0 + 22.5).weight == 50.0


def test_error_rate_beyond_delta_rolls_back_with_figures():
    d = analyse(table(), samples(100, errors=1), samples(40, errors=4), CFG, T0 + 11)
    assert d.action == "rollback" and d.weight == 0.0
    assert d.reasons[0].startswith("error rate: canary 10.0% (4/40) vs stable 1.0% (1/100), delta 9.0% (max 5.0%)")
    # within the delta: fine
    d = analyse(table(), samples(100, errors=1), samples(40, errors=2), CFG, T0 + 11)
    assert d.action == "step"


def test_cancelled_requests_are_not_errors():
    d = analyse(table(), samples(40), samples(40, cancelled=20), CFG, T0 + 11)
    assert d.action == "step"
    assert d.canary.cancelled == 20 and d.canary.errors == 0


def test_early_error_stop_before_min_samples():
    # 3 errors in the first 6 requests: >= 15% over 20 requests whatever follows -> rollback now
    d = analyse(table(), samples(40), samples(6, errors=3), CFG, T0 + 6)
    assert d.action == "rollback" and "first 6 requests" in d.reasons[0]
    # one error in 6 (5% over 20): not yet decided
    assert analyse(table(), samples(40), samples(6, errors=1), CFG, T0 + 6).action == "wait"
    # a stable side failing just as much raises the baseline
    assert analyse(table(), samples(40, errors=8), samples(6, errors=3), CFG, T0 + 6).action == "wait"


def test_slow_canary_ttft_rolls_back():
    d = analyse(table(), samples(40, ttft=100.0), samples(40, ttft=400.0), CFG, T0 + 11)
    assert d.action == "rollback"
    assert d.reasons[0] == "TTFT p95: canary 400.0 ms vs stable 100.0 ms (limit 200.0 ms = 1.5 x stable + 50 ms)"


def test_slow_canary_itl_rolls_back_but_slack_protects_tiny_latencies():
    d = analyse(table(), samples(40, itl=20.0), samples(40, itl=80.0), CFG, T0 + 11)
    assert d.action == "rollback" and d.reasons[0].startswith("ITL p95: canary 80.0 ms")
    # 3 ms vs 1 ms is a ratio of 3 but within the 20 ms slack
    assert analyse(table(), samples(40, ttft=2.0, itl=1.0), samples(40, ttft=6.0, itl=3.0), CFG,
                   T0 + 11).action == "step"


def test_latency_metric_without_enough_values_is_skipped():
    one_token = [Sample(T0 + 5, "ok", 100.0, None) for _ in range(40)]
    d = analyse(table(), one_token, one_token, CFG, T0 + 11)
    assert d.action == "step"
    assert any(r.startswith("ITL p95: not compared") for r in d.reasons)


def test_samples_before_the_rollout_or_outside_the_window_do_not_count():
    old = samples(40, t=T0 - 5, errors=40)  # before started_at
    d = analyse(table(), samples(40), old + samples(40), CFG, T0 + 11)
    assert d.action == "step" and d.canary.n == 40
    stale = samples(40, t=T0 + 1, errors=40)
    d = analyse(table(), samples(40, t=T0 + 40), stale + samples(40, t=T0 + 40), CFG, T0 + 45)
    assert d.action == "step" and d.canary.errors == 0


def test_no_rollout_means_wait():
    assert analyse(RoutingTable(), [], [], CFG, T0).action == "wait"


def test_analysis_is_pure():
    t, st, ca = table(), samples(40), samples(40, errors=10)
    assert analyse(t, st, ca, CFG, T0 + 11) == analyse(t, st, ca, CFG, T0 + 11)
