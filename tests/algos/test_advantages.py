import math
import statistics

import pytest
import torch

from yatt_ray.algos import ADVANTAGE_ESTIMATORS, broadcast_to_tokens, grpo_advantages, grpo_no_std_advantages

F64 = torch.float64


def test_grpo_hand_computed_unbiased_std():
    # row 0: r = [1, 0, 0]; mean = 1/3; deviations = [2/3, -1/3, -1/3]
    #        sum of squares = 4/9 + 1/9 + 1/9 = 2/3; unbiased var = (2/3) / (3 - 1) = 1/3; std = 1/sqrt(3)
    #        A = [2/3, -1/3, -1/3] * sqrt(3) = [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)]
    # row 1: r = [3, 1, 2]; mean = 2; deviations = [1, -1, 0]; sum sq = 2; var = 2 / 2 = 1; std = 1
    rewards = torch.tensor([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]], dtype=F64)
    s3 = math.sqrt(3.0)
    expected = torch.tensor([[2 / s3, -1 / s3, -1 / s3], [1.0, -1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grpo_advantages(rewards, eps=0.0), expected, rtol=0, atol=1e-15)
    # eps is added to the std: row 1 becomes [1, -1, 0] / (1 + 1e-6)
    out = grpo_advantages(rewards, eps=1e-6)
    torch.testing.assert_close(
        out[1], torch.tensor([1.0, -1.0, 0.0], dtype=F64) / (1 + 1e-6), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(out[0], expected[0] * (1 / s3) / (1 / s3 + 1e-6), rtol=0, atol=1e-15)


def test_grpo_no_std_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]], dtype=F64)
    expected = torch.tensor([[2 / 3, -1 / 3, -1 / 3], [1.0, -1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grpo_no_std_advantages(rewards), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS.get("grpo_no_std")(rewards), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(grpo_advantages(rewards, normalize_std=False), expected, rtol=0, atol=1e-15)


def test_equal_rewards_give_exact_zero():
    # In float32 the mean of seven 0.7s is not exactly 0.7 (on x86 CPU torch): the naive
    # (r - mean) / (std + eps) gives |A| ~ 0.056 for a group with no signal. The estimator must return exact 0.
    rewards = torch.tensor([[0.7] * 7, [0.1] * 7, [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    out = grpo_advantages(rewards)
    assert torch.equal(out[:2], torch.zeros(2, 7))
    assert (out[2] != 0).all()
    assert torch.equal(grpo_no_std_advantages(rewards)[:2], torch.zeros(2, 7))


def test_loop_matches_vectorised():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 4, generator=gen, dtype=F64)
    eps = 1e-6
    expected = torch.empty_like(rewards)
    for p in range(rewards.shape[0]):
        group = rewards[p].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)  # stdev: the unbiased (n - 1) form
        for g, r in enumerate(group):
            expected[p, g] = (r - mean) / (std + eps)
    torch.testing.assert_close(grpo_advantages(rewards, eps=eps), expected, rtol=0, atol=1e-13)


def test_dtypes():
    assert grpo_advantages(torch.tensor([[1, 0], [0, 0]])).dtype == torch.float32  # int rule rewards
    assert grpo_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.bfloat16)).dtype == torch.float32
    assert grpo_advantages(torch.tensor([[1.0, 0.0]], dtype=F64)).dtype == F64


@pytest.mark.parametrize(
    ("rewards", "match"),
    [
        (torch.zeros(6), r"shape \[P, G\].*got shape \(6,\)"),
        (torch.zeros(3, 1), "at least 2 samples per prompt, got G=1"),
        (torch.tensor([[1.0, float("nan")]]), r"non-finite value \(nan at \[prompt 0, sample 1\]\)"),
    ],
)
def test_bad_rewards_raise(rewards, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards)


def test_broadcast_to_tokens():
    seq_adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    expected = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    assert torch.equal(broadcast_to_tokens(seq_adv, mask), expected)
    assert torch.equal(broadcast_to_tokens(seq_adv, mask.bool()), expected)
    with pytest.raises(ValueError, match="B = 2"):
        broadcast_to_tokens(seq_adv, torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        broadcast_to_tokens(seq_adv.view(1, 2), mask)
