"""Sampler: greedy, temperature, top-k, top-p, per-request seeds; min-p and repetition penalty against
transformers' logits processors, logit bias."""

import pytest
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


# ----------------------------------------------------------------------------- min-p, repetition penalty, logit bias
def _kept(logits: torch.Tensor) -> list[bool]:
    return torch.isfinite(logits).tolist()


def test_min_p_matches_transformers_warper_chain():
    """Our temperature -> top-k -> top-p -> min-p chain keeps exactly what transformers' warpers keep, with the
    same renormalized distribution, on random logits (reference: transformers MinPLogitsWarper et al.)."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from actors.worker.engine.sampler import filtered_logits

    torch.manual_seed(0)
    cases = [(1.0, 0, 1.0, 0.05), (0.7, 0, 1.0, 0.1), (1.3, 40, 1.0, 0.02), (0.9, 0, 0.9, 0.05), (1.0, 0, 1.0, 0.5)]
    for temperature, top_k, top_p, min_p in cases:
        for _ in range(5):
            logits = torch.randn(1, 500) * 3
            ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
            if top_k:
                ref = TopKLogitsWarper(top_k)(None, ref)
            if top_p < 1:
                ref = TopPLogitsWarper(top_p)(None, ref)
            ref = MinPLogitsWarper(min_p)(None, ref)[0]
            ours = filtered_logits(logits[0], SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                             min_p=min_p))
            assert _kept(ours) == _kept(ref), (temperature, top_k, top_p, min_p)
            assert torch.allclose(ours.softmax(-1), ref.softmax(-1), atol=1e-6)
            assert 0 < sum(_kept(ours)) < 500 or min_p == 0


def test_min_p_keeps_the_top_token_and_zero_is_off():
    from actors.worker.engine.sampler import apply_min_p

    logits = torch.log(torch.tensor([0.6, 0.25, 0.1, 0.05]))
    assert _kept(apply_min_p(logits, 0.2)) == [True, True, False, False]  # 0.1 < 0.2 * 0.6
    assert _kept(apply_min_p(logits, 1.0)) == [True, False, False, False]
    assert apply_min_p(logits, 0.0) is logits


def test_min_p_sampling_never_draws_a_filtered_token():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p, g = SamplingParams(temperature=1.0, min_p=0.4, seed=1), make_generator(1)
    assert {sample_one(logits, p, g) for _ in range(300)} == {0, 1}  # 0.15 < 0.4 * 0.5


def test_repetition_penalty_matches_transformers():
    """Reference: transformers RepetitionPenaltyLogitsProcessor over prompt + generated ids (repeats included)."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from actors.worker.engine.sampler import adjusted_logits

    torch.manual_seed(1)
    for penalty in (1.3, 0.8, 2.0):
        logits = torch.randn(1, 300) * 4
        ids = torch.randint(0, 300, (40,)).tolist() + [7, 7, 7]
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits.clone())[0]
        ours = adjusted_logits(logits[0], SamplingParams(repetition_penalty=penalty), ids[30:], ids)
        assert torch.allclose(ours, ref, atol=0, rtol=0), penalty
        assert not torch.equal(ours, logits[0])


def test_repetition_penalty_changes_greedy_in_sample_batch_and_one_is_off():
    logits = torch.tensor([[3.0, 2.9, -1.0], [3.0, 2.9, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.2), SamplingParams(temperature=0)]
    gens = [make_generator(0)] * 2
    # row 0 has token 0 in its prompt: 3.0 / 1.2 < 2.9; row 1 (penalty 1 = off) keeps argmax 0
    assert sample_batch(logits, params, gens, [[], []], [[0, 2], [0, 2]]) == [1, 0]
    assert sample_batch(logits, params, gens, [[], []], None) == [0, 0]  # no ids: nothing to penalize


def test_logit_bias_is_added_to_raw_logits_greedy_and_sampled():
    from actors.worker.engine.sampler import adjusted_logits

    logits = torch.tensor([[5.0, 1.0, 0.0, -2.0]])
    assert adjusted_logits(logits[0], SamplingParams(logit_bias={"3": 4.5, "0": -1}), [], []).tolist() == [
        4.0, 1.0, 0.0, 2.5]
    force = SamplingParams(temperature=0, logit_bias={"2": 100})
    ban = SamplingParams(temperature=0, logit_bias={"0": -100})
    assert sample_batch(logits.repeat(2, 1), [force, ban], [make_generator(0)] * 2) == [2, 1]
    g = make_generator(2)
    hot = SamplingParams(temperature=2.0, logit_bias={"0": -100})
    assert 0 not in {sample_batch(logits, [hot], [g])[0] for _ in range(300)}  # banned under sampling too


def test_rows_without_new_features_keep_the_batched_path(monkeypatch):
    from actors.worker.engine import sampler

    monkeypatch.setattr(sampler, "adjusted_logits", lambda *a: pytest.fail("plain rows must not be adjusted"))
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1),
              SamplingParams(temperature=0, min_p=0.3)]
    out = sample_batch(logits, params, [make_generator(i) for i in range(3)], [[1], [2], [3]], [[0, 1], [0, 2], [0, 3]])
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())  # min-p never drops argmax
