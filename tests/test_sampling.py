"""Guidance and sampling semantics, on hand-made logits."""

import math

import torch

from cubeserve.engine.sampling import apply_guidance, counter_uniform, guidance_weights, sample


def _sample(logits, top_p=1.0, temperature=1.0, seeds=range(2000), step=3):
    b = len(seeds)
    logits = logits.expand(b, -1)
    return sample(logits, torch.zeros(b, dtype=torch.bool), torch.full((b,), temperature),
                  torch.full((b,), top_p), torch.tensor(list(seeds)), torch.full((b,), step))


def test_guidance_matches_reference_formula():
    n = 512
    scale = torch.tensor([3.0, 0.0, 1.5])
    for step in (0, 1, 255, 511):
        g = guidance_weights(scale, torch.full((3,), step), n)
        assert torch.allclose(g, scale * (n - step) / n)
    cond, uncond = torch.randn(3, 10), torch.randn(3, 10)
    g = torch.tensor([3.0, 0.0, 0.5])
    out = apply_guidance(cond, uncond, g)
    assert torch.allclose(out, (1 + g[:, None]) * cond - g[:, None] * uncond)
    assert torch.equal(out[1], cond[1])


def test_top_p_drops_the_token_that_crosses_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ids = _sample(torch.log(probs)[None], top_p=0.85)
    assert set(ids.tolist()) == {0, 1}  # cumulative 0.5, 0.8 <= 0.85; 0.95 crosses and is dropped
    share = (ids == 0).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.05


def test_top_p_keeps_the_top_token_even_below_p():
    ids = _sample(torch.log(torch.tensor([0.6, 0.4]))[None], top_p=0.1)
    assert set(ids.tolist()) == {0}


def test_full_sampling_follows_the_distribution_and_temperature():
    probs = torch.tensor([0.7, 0.2, 0.1])
    ids = _sample(torch.log(probs)[None], seeds=range(4000))
    freq = torch.bincount(ids, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    hot = _sample(torch.log(probs)[None], temperature=1e6, seeds=range(4000))
    assert torch.allclose(torch.bincount(hot, minlength=3).float() / 4000, torch.full((3,), 1 / 3), atol=0.03)


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, 0.0, 0.0]])
    out = sample(logits, torch.tensor([True, True]), torch.ones(2), torch.ones(2), torch.zeros(2, dtype=torch.int64),
                 torch.zeros(2, dtype=torch.int64))
    assert out.tolist() == [1, 0]


def test_counter_noise_is_a_function_of_seed_and_step_only():
    a = counter_uniform(torch.tensor([5, 6]), torch.tensor([2, 2]), 1000)
    b = counter_uniform(torch.tensor([6]), torch.tensor([2]), 1000)
    assert torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    assert 0.0 < a.min().item() and a.max().item() < 1.0
    assert abs(a.mean().item() - 0.5) < 0.03
    big = counter_uniform(torch.tensor([2**63 - 1]), torch.tensor([1023]), 16384)
    assert math.isfinite(big.sum().item())


def test_32_bit_products_are_exact_without_int64_overflow():
    from cubeserve.engine.sampling import _mul32

    x = torch.cat([torch.randint(0, 2**32, (500,), dtype=torch.int64), torch.tensor([2**32 - 1, 0, 1])])
    for c in (0x7FEB352D, 0x846CA68B, 0x9E3779B1, 0x85EBCA77):
        assert _mul32(x, c).tolist() == [(int(v) * c) % 2**32 for v in x]
