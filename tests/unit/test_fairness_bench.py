"""Pure helpers of ``actorserve bench fairness``: request distribution, shares, latency fit, overload
figures, RSS parsing and the target table (no stack, no network; well under a second)."""

from __future__ import annotations

import math

import pytest

from bench import fairness_workload as wl
from bench.fairness_report import b_phase_keys, table_lines, targets
from bench.fairness_workload import Result, Workload


def test_spec_is_seeded_distinct_and_in_range():
    w = Workload(prompt_words_lo=3, prompt_words_hi=7, out_tokens_lo=2, out_tokens_hi=5, seed=4)
    specs = [wl.spec(w, "fair-b", i) for i in range(200)]
    assert specs == [wl.spec(w, "fair-b", i) for i in range(200)]  # same seed, same requests
    assert specs[0] != wl.spec(Workload(3, 7, 2, 5, seed=5), "fair-b", 0)
    assert len({s.prompt.split("]")[0] for s in specs}) == 200  # unique prefix per request
    assert {s.words for s in specs} == set(range(3, 8)) and {s.max_tokens for s in specs} == set(range(2, 6))
    for s in specs[:20]:
        body = s.prompt.split("] ", 1)[1].split()
        assert len(body) == s.words and set(body) <= set(wl.WORDS)
    with pytest.raises(ValueError):
        Workload(prompt_words_lo=5, prompt_words_hi=4)


def _ok(tenant="t", sent=0.0, e2e=100.0, deadline=1000, prompt=10, completion=5, ttft=20.0) -> Result:
    return Result(tenant, sent, deadline, 8, completion, status="ok", http_status=200, ttft_ms=ttft, e2e_ms=e2e,
                  prompt_tokens=prompt, completion_tokens=completion)


def test_service_tokens_and_window_sum():
    rs = [_ok(sent=1.0, e2e=500.0, prompt=10, completion=5), _ok(sent=9.0, e2e=2000.0),
          Result("t", 2.0, 1000, 8, 5, status="refused", e2e_ms=3.0)]
    assert rs[0].service == 10 + 2 * 5 and rs[2].service == 0
    assert wl.window_sum(rs, 0.0, 10.0) == 20  # the second one ends at 11 s
    assert wl.window_sum(rs, 0.0, 12.0, "completion_tokens") == 10


def test_share_errors():
    err = wl.share_errors({"a": 100.0, "b": 200.0, "c": 330.0}, {"a": 1, "b": 2, "c": 3})
    assert err["a"] == pytest.approx((100 / 630 - 1 / 6) * 6)
    assert err["c"] == pytest.approx((330 / 630 - 0.5) * 2)
    assert all(math.isnan(v) for v in wl.share_errors({}, {"a": 1}).values())


def test_fit_latency_recovers_a_linear_model_and_sets_deadlines():
    samples = [(w, t, 50 + 2 * w + 30 * t) for w in (8, 20, 40) for t in (4, 10, 24)]
    a, b, c = wl.fit_latency(samples)
    assert (a, b, c) == pytest.approx((50, 2, 30), abs=1e-6)
    assert wl.deadline_ms((a, b, c), 10, 10) == 2 * (50 + 20 + 300)
    assert wl.deadline_ms((0.0, 0.0, 0.0), 10, 10) == 100  # floor
    assert wl.fit_latency([(8, 4, 100.0), (8, 4, 300.0)]) == (100.0, 0.0, 0.0)  # too few: median


def test_overload_summary():
    rs = [_ok(sent=1.0, e2e=900.0), _ok(sent=2.0, e2e=1050.0), _ok(sent=3.0, e2e=1200.0),
          Result("t", 4.0, 1000, 8, 5, status="refused", e2e_ms=2.0),
          Result("t", 5.0, 1000, 8, 5, status="expired", e2e_ms=1001.0),
          Result("t", 6.0, 1000, 8, 5, status="hung", e2e_ms=6000.0)]
    s = wl.overload_summary(rs, 0.0, 10.0, capacity=0.5)
    assert s["goodput_req_s"] == pytest.approx(0.1) and s["goodput_fraction"] == pytest.approx(0.2)
    assert (s["ok"], s["refused"], s["expired"], s["hung"], s["answered"], s["accepted"]) == (3, 1, 1, 1, 5, 4)
    assert s["late_fraction"] == pytest.approx(1 / 4)  # 1.2 x deadline
    assert s["expired_fraction"] == pytest.approx(1 / 4)  # ended at its deadline: no answer, not a late one
    assert s["max_lateness_frac"] == pytest.approx(0.2) and s["max_lateness_ms"] == pytest.approx(200.0)


def test_refusal_status():
    assert wl.refusal_status(503, '{"error":{"code":"deadline_unmeetable"}}') == "refused"
    assert wl.refusal_status(429, '{"error":{"code":"queue_full_tenant"}}') == "refused"
    assert wl.refusal_status(503, '{"error":{"code":"deadline_exceeded"}}') == "expired"
    assert wl.refusal_status(504, "") == "expired" and wl.refusal_status(400, "bad") == "failed"


def test_rss_parse_and_growth():
    text = "Name:\tpython\nVmPeak:\t  9000 kB\nVmRSS:\t  123456 kB\nThreads:\t4\n"
    assert wl.vm_rss_kib(text) == 123456 and wl.vm_rss_kib("Name:\tkthreadd\n") is None
    assert wl.rss_growth_mib({"a": 1024, "b": 2048, "gone": 1}, {"a": 1024 + 51_200, "b": 1024}) == \
        {"a": 50.0, "b": -1.0}


def test_phase_keys_and_targets_table():
    b = [_ok(ttft=float(i)) for i in range(1, 301)] + [Result("b", 0.0, 1000, 8, 5, status="refused")]
    res = {"capacity_req_s": 3.0, "b_rate_req_s": 0.545, "workload": "w"}
    res.update(b_phase_keys("solo", b))
    assert (res["b_solo_n"], res["b_solo_refused"], res["b_solo_ttft_p50_ms"], res["b_solo_ttft_p99_ms"]) == \
        (300, 1, 151.0, 297.0)
    res.update(b_phase_keys("fair", [_ok(ttft=2.0 * i) for i in range(1, 301)]))
    res.update(weighted_split_ratio=3.4, overload_hung=0, overload_goodput_fraction=0.85)
    rows = {name: (v, met) for name, v, _, met in targets(res)}
    assert rows["B fair/solo TTFT p99"] == (pytest.approx(2.0, abs=0.01), True)
    assert rows["3:1 service-token split"][1] is False and rows["overload hung requests"] == (0, True)
    assert rows["1:2:3 max share error"][1] is None  # not measured in this run
    assert rows["B requests sent per phase (min)"] == (300, True)  # fair: 300 sent; solo: 301
    assert any("NO" in line and "3:1" in line for line in table_lines(res))
