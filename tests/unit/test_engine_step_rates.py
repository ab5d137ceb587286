"""StepRates: decode step time per batch size (EWMA, interpolated between measured sizes) and prefill
speed net of the decodes that rode along (pure)."""

import pytest

from actors.worker.engine.step_rates import StepRates


def test_zero_until_measured_then_ewma_per_batch_size():
    r = StepRates(alpha=0.5)
    assert r.step_ms(4) == 0.0 and r.prefill_tokens_per_s == 0.0
    r.observe(4, 0, 0.040)
    r.observe(4, 0, 0.060)  # EWMA: 40 + 0.5 * (60 - 40)
    r.observe(1, 0, 0.020)
    assert r.step_ms(4) == pytest.approx(50.0) and r.step_ms(1) == pytest.approx(20.0)
    assert r.step_ms(0) == pytest.approx(20.0)  # an idle engine predicts a batch of one


def test_unmeasured_sizes_interpolate_and_extrapolate_along_the_nearest_sizes():
    r = StepRates()
    r.observe(2, 0, 0.020)
    assert r.step_ms(8) == pytest.approx(20.0)  # one size known: its time
    r.observe(4, 0, 0.030)
    assert r.step_ms(3) == pytest.approx(25.0) and r.step_ms(8) == pytest.approx(50.0)
    assert r.step_ms(1) == pytest.approx(20.0)  # below every size: never less than the smallest measured


def test_prefill_rate_subtracts_the_predicted_decode_time_of_a_mixed_step():
    r = StepRates(alpha=1.0)
    r.observe(0, 100, 0.050)
    assert r.prefill_tokens_per_s == pytest.approx(2000.0)
    r.observe(4, 0, 0.030)
    r.observe(4, 90, 0.060)  # 60 ms less 30 ms for the 4 decodes: 90 tokens in 30 ms
    assert r.prefill_tokens_per_s == pytest.approx(3000.0)
    r.observe(4, 10, 0.020)  # faster than the decodes alone (noise): prefill share floored at 10 %
    assert r.prefill_tokens_per_s == pytest.approx(10 / 0.002)


def test_bad_alpha_and_empty_steps():
    with pytest.raises(ValueError):
        StepRates(alpha=0.0)
    r = StepRates()
    r.observe(0, 0, 0.01)
    r.observe(3, 0, 0.0)
    assert r.decode_ms == {} and r.prefill_tokens_per_s == 0.0


def test_module_is_pure():
    import actors.worker.engine.step_rates as m
    src = open(m.__file__).read()
    assert "import torch" not in src and "import time" not in src and "nats" not in src
