"""Sampler: greedy, temperature, top-k, top-p, per-request seeds."""

import torch

from actors.worker.engine.sampler import apply_top_k, apply_top_p, make_generator, sample_batch, sample_one
from actors.worker.engine.types import SamplingParams


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0)] * 2
    assert sample_batch(logits, params, [make_generator(0)] * 2) == [1, 0]


def test_top_k_keeps_k_largest():
    out = apply_top_k(torch.tensor([1.0, 4.0, 3.0, 2.0]), 2)
    assert torch.isinf(out[[0, 3]]).all() and torch.isfinite(out[[1, 2]]).all()


def test_top_p_keeps_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(apply_top_p(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]
    assert torch.isfinite(apply_top_p(logits, 0.01)).sum() == 1


def test_seed_reproducible_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = [sample_one(logits[1], p, g) for g in [make_generator(123)] for _ in range(1)]
    other = SamplingParams(temperature=0.7, seed=7)
    batched = sample_batch(logits, [other, p, other], [make_generator(7), make_generator(123), make_generator(8)])
    assert batched[1] == alone[0]


def test_seeded_sequence_repeats():
    logits = torch.randn(100)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=5)
    g1, g2 = make_generator(5), make_generator(5)
    assert [sample_one(logits, p, g1) for _ in range(10)] == [sample_one(logits, p, g2) for _ in range(10)]


def test_low_temperature_concentrates_on_argmax():
    logits = torch.tensor([1.0, 2.0, 1.5])
    g = make_generator(0)
    p = SamplingParams(temperature=0.01)
    assert {sample_one(logits, p, g) for _ in range(20)} == {1}


def test_top_k_one_is_greedy():
    logits = torch.randn(30)
    g = make_generator(1)
    assert sample_one(logits, SamplingParams(temperature=2.0, top_k=1), g) == int(logits.argmax())


def test_draw_follows_the_distribution_and_never_draws_zero_probability_tokens():
    import torch

    from actors.worker.engine.sampler import draw, make_generator

    probs = torch.tensor([0.1, 0.0, 0.6, 0.0, 0.3])
    g = make_generator(3)
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(20_000)]), minlength=5)
    freq = counts.float() / counts.sum()
    assert counts[1] == 0 and counts[3] == 0
    assert (freq - probs).abs().max() < 0.015  # 20k draws: binomial sd <= 0.0035
    g1, g2 = make_generator(9), make_generator(9)
    assert [draw(probs, g1) for _ in range(50)] == [draw(probs, g2) for _ in range(50)]  # seeded: reproducible
