import math
import statistics

import pytest
import torch

from yatt_ray.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    grpo_no_std_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_rewards_from_outcome,
)

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


# --- registry descriptors --------------------------------------------------------------------------------------


def test_registered_descriptors_and_flags():
    rewards = torch.tensor([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]], dtype=F64)
    grpo = ADVANTAGE_ESTIMATORS.get("grpo")
    assert isinstance(grpo, AdvantageEstimator) and grpo.fn is grpo_advantages and grpo.name == "grpo"
    assert torch.equal(grpo(rewards), grpo_advantages(rewards))  # the old call form still works
    flags = {
        name: (e.needs_group, e.needs_critic, e.needs_greedy_baseline, e.token_level)
        for name in ADVANTAGE_ESTIMATORS
        for e in [ADVANTAGE_ESTIMATORS.get(name)]
    }
    assert flags == {
        "gae": (False, True, False, True),
        "grpo": (True, False, False, False),
        "grpo_no_std": (True, False, False, False),
        "reinforce_pp": (False, False, False, False),
        "reinforce_pp_baseline": (True, False, False, False),
        "remax": (False, False, True, False),
        "rloo": (True, False, False, False),
    }
    assert ADVANTAGE_ESTIMATORS.get("gae").requirements == ["needs critic", "token-level"]
    # every outcome estimator that needs no extra input takes rewards [P, n] alone
    for name, (_, critic, greedy, _) in flags.items():
        if not (critic or greedy):
            assert ADVANTAGE_ESTIMATORS.get(name)(rewards).shape == (2, 3)


# --- RLOO -----------------------------------------------------------------------------------------------------


def test_rloo_hand_computed():
    # row 0: r = [1, 0, 0]; leave-one-out means: (0 + 0)/2 = 0, (1 + 0)/2 = 0.5, 0.5  ->  A = [1, -0.5, -0.5]
    #        (= G/(G-1) * (r - mean) = 1.5 * [2/3, -1/3, -1/3])
    # row 1: r = [3, 1, 2]; baselines (1+2)/2 = 1.5, (3+2)/2 = 2.5, (3+1)/2 = 2  ->  A = [1.5, -1.5, 0]
    rewards = torch.tensor([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]], dtype=F64)
    expected = torch.tensor([[1.0, -0.5, -0.5], [1.5, -1.5, 0.0]], dtype=F64)
    torch.testing.assert_close(rloo_advantages(rewards), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(ADVANTAGE_ESTIMATORS.get("rloo")(rewards), expected, rtol=0, atol=1e-15)
    assert torch.equal(rloo_advantages(torch.tensor([[0.7] * 7])), torch.zeros(1, 7))
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        rloo_advantages(torch.zeros(3, 1))


def test_rloo_loop_matches_vectorised():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.rand(4, 5, generator=gen, dtype=F64)
    expected = torch.empty_like(rewards)
    for p in range(4):
        group = rewards[p].tolist()
        for g, r in enumerate(group):
            others = group[:g] + group[g + 1 :]
            expected[p, g] = r - sum(others) / len(others)
    torch.testing.assert_close(rloo_advantages(rewards), expected, rtol=0, atol=1e-14)


# --- REINFORCE++ ------------------------------------------------------------------------------------------------


def test_reinforce_pp_hand_computed():
    # r = [1, 0, 0, 0] over the batch: mean = 0.25; deviations [0.75, -0.25, -0.25, -0.25]
    # sum of squares = 0.5625 + 3 * 0.0625 = 0.75; unbiased var = 0.75 / 3 = 0.25; std = 0.5
    # A = deviations / 0.5 = [1.5, -0.5, -0.5, -0.5]
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=F64)
    expected = torch.tensor([[1.5, -0.5], [-0.5, -0.5]], dtype=F64)
    torch.testing.assert_close(reinforce_pp_advantages(rewards, eps=0.0), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(  # eps is added to the std: / (0.5 + 1e-6)
        reinforce_pp_advantages(rewards), expected * 0.5 / (0.5 + 1e-6), rtol=0, atol=1e-15
    )
    # n = 1 is allowed (no group): r = [1, 3]: mean 2, std = sqrt((1 + 1) / 1) = sqrt(2)
    s2 = math.sqrt(2.0)
    torch.testing.assert_close(
        reinforce_pp_advantages(torch.tensor([[1.0], [3.0]], dtype=F64), eps=0.0),
        torch.tensor([[-1 / s2], [1 / s2]], dtype=F64),
        rtol=0,
        atol=1e-15,
    )
    assert torch.equal(reinforce_pp_advantages(torch.full((3, 2), 0.7)), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="at least 2 rewards in the batch"):
        reinforce_pp_advantages(torch.ones(1, 1))


def test_reinforce_pp_baseline_hand_computed():
    # r = [[1, 0], [3, 3], [2, 0]];  minus group means (0.5, 3, 1): c = [[0.5, -0.5], [0, 0], [1, -1]]
    # mean(c) = 0; sum of squares = 0.25 + 0.25 + 0 + 0 + 1 + 1 = 2.5; unbiased var = 2.5 / 5 = 0.5
    # A = c / sqrt(0.5) = c * sqrt(2)
    rewards = torch.tensor([[1.0, 0.0], [3.0, 3.0], [2.0, 0.0]], dtype=F64)
    s2 = math.sqrt(2.0)
    expected = torch.tensor([[s2 / 2, -s2 / 2], [0.0, 0.0], [s2, -s2]], dtype=F64)
    out = reinforce_pp_baseline_advantages(rewards, eps=0.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    assert torch.equal(out[1], torch.zeros(2, dtype=F64))
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS.get("reinforce_pp_baseline")(rewards, eps=0.0), expected, rtol=0, atol=1e-15
    )
    assert torch.equal(
        reinforce_pp_baseline_advantages(torch.tensor([[1.0, 1.0], [0.0, 0.0]])), torch.zeros(2, 2)
    )


def test_batch_whitening_loop_matches_vectorised():
    gen = torch.Generator().manual_seed(4)
    rewards = torch.rand(3, 4, generator=gen, dtype=F64)
    eps = 1e-6
    flat = rewards.reshape(-1).tolist()
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    expected = torch.tensor([(r - mean) / (std + eps) for r in flat], dtype=F64).view(3, 4)
    torch.testing.assert_close(reinforce_pp_advantages(rewards, eps=eps), expected, rtol=0, atol=1e-13)
    centred = [r - statistics.mean(rewards[i // 4].tolist()) for i, r in enumerate(flat)]
    mean, std = statistics.mean(centred), statistics.stdev(centred)
    expected = torch.tensor([(c - mean) / (std + eps) for c in centred], dtype=F64).view(3, 4)
    torch.testing.assert_close(
        reinforce_pp_baseline_advantages(rewards, eps=eps), expected, rtol=0, atol=1e-13
    )


# --- ReMax ------------------------------------------------------------------------------------------------------


def test_remax_hand_computed_and_errors():
    # A = r - greedy: row 0 greedy 1 -> [0, -1, 0]; row 1 greedy 0.5 -> [0, -0.3, 0.4]
    rewards = torch.tensor([[1.0, 0.0, 1.0], [0.5, 0.2, 0.9]], dtype=F64)
    greedy = torch.tensor([1.0, 0.5], dtype=F64)
    expected = torch.tensor([[0.0, -1.0, 0.0], [0.0, -0.3, 0.4]], dtype=F64)
    torch.testing.assert_close(remax_advantages(rewards, greedy), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(
        ADVANTAGE_ESTIMATORS.get("remax")(rewards, greedy_rewards=greedy), expected, rtol=0, atol=1e-15
    )
    assert remax_advantages(torch.tensor([[1.0], [0.0]]), torch.tensor([0.0, 0.0])).shape == (
        2,
        1,
    )  # n = 1 ok
    with pytest.raises(ValueError, match="remax needs greedy_rewards"):
        ADVANTAGE_ESTIMATORS.get("remax")(rewards)
    with pytest.raises(ValueError, match=r"shape \[P\] = \(2,\)"):
        remax_advantages(rewards, torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        remax_advantages(rewards, torch.tensor([0.0, float("nan")]))


def test_remax_single_response_needs_no_batch_statistic():
    # one prompt, one sample: A = r - greedy = 1.0 - 0.5 = 0.5 (exact in binary floating point)
    for dtype in (torch.float32, F64):
        adv = remax_advantages(torch.tensor([[1.0]], dtype=dtype), torch.tensor([0.5], dtype=dtype))
        torch.testing.assert_close(adv, torch.tensor([[0.5]], dtype=dtype), rtol=0, atol=0)
    via_registry = ADVANTAGE_ESTIMATORS.get("remax")(
        torch.tensor([[1.0]]), greedy_rewards=torch.tensor([0.5])
    )
    torch.testing.assert_close(via_registry, torch.tensor([[0.5]]), rtol=0, atol=0)
    # integer rule rewards are promoted; -1 - 2 = -3
    adv = remax_advantages(torch.tensor([[-1]]), torch.tensor([2.0]))
    assert adv.dtype == torch.float32 and adv.tolist() == [[-3.0]]
    # the batch-std guard still applies to the estimator that does whiten over the batch
    with pytest.raises(ValueError, match="at least 2 rewards in the batch"):
        reinforce_pp_advantages(torch.tensor([[1.0]]))


# --- GAE --------------------------------------------------------------------------------------------------------


def test_gae_hand_computed_with_padding_and_a_hole():
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72
    # row 0: mask [1, 1, 1, 0], r = [0, 0, 1, (7)], V = [0.5, 0.6, 0.7, (9)]   (parenthesised: masked, ignored)
    #   t=2: delta = 1 + 0.9 * 0 - 0.7 = 0.3;            A2 = 0.3
    #   t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03;         A1 = 0.03 + 0.72 * 0.3 = 0.246
    #   t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04;         A0 = 0.04 + 0.72 * 0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0, 0]
    # row 1: mask [1, 0, 1, 0] (a hole at t=1): the masked token is skipped, as if the row were [t0, t2]
    #   t=2: delta = 1 - 0.7 = 0.3;                      A2 = 0.3
    #   t=0: delta = 0 + 0.9 * 0.7 - 0.5 = 0.13;         A0 = 0.13 + 0.72 * 0.3 = 0.346
    #   returns = [0.846, 0, 1.0, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0], [0.0, 5.0, 1.0, 7.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [0.5, 9.0, 0.7, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(
        adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0], [0.346, 0.0, 0.3, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0], [0.846, 0.0, 1.0, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )
    same, _ = ADVANTAGE_ESTIMATORS.get("gae")(rewards, values, mask.bool(), 0.9, 0.8)
    assert torch.equal(same, adv)


def _gae_naive(rewards, values, mask, gamma, lam):
    """Per row, per real token, with python floats: the textbook backward recursion over the real tokens."""
    batch, width = rewards.shape
    adv = [[0.0] * width for _ in range(batch)]
    ret = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        real = [t for t in range(width) if mask[b, t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(real):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t].item()
            adv[b][t], ret[b][t] = next_adv, next_adv + next_value
    return torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_loop_matches_vectorised(gamma, lam):
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(5, 9, generator=gen, dtype=F64)
    values = torch.randn(5, 9, generator=gen, dtype=F64)
    mask = torch.rand(5, 9, generator=gen) < 0.7  # holes anywhere, not only right padding
    mask[3] = False  # an empty row
    adv, ret = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_ret = _gae_naive(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, expected_adv, rtol=0, atol=1e-13)
    torch.testing.assert_close(ret, expected_ret, rtol=0, atol=1e-13)
    assert not adv.requires_grad


def test_gae_unit_discount_zero_values_is_reward_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, torch.zeros(1, 4, dtype=F64), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[6.0, 5.0, 3.0, 0.0]] and torch.equal(adv, ret)  # suffix sums over real tokens
    with pytest.raises(ValueError, match="gamma and lam must be in"):
        gae_advantages(rewards, rewards, mask, gamma=1.1, lam=1.0)
    with pytest.raises(ValueError, match=r"must share one shape \[B, T\]"):
        gae_advantages(rewards, torch.zeros(1, 3), mask, gamma=1.0, lam=1.0)


def test_masked_whiten_hand_computed():
    # selected x = [2, 4, 6]: mean 4; unbiased var = (4 + 0 + 4) / 2 = 4; std 2 -> centred [-1, 0, 1]
    x = torch.tensor([[2.0, 4.0, 99.0], [6.0, -5.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = masked_whiten(x, mask, eps=0.0)
    torch.testing.assert_close(
        out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=0
    )
    # shift_mean=False adds the mean back: [3, 4, 5]
    out = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(
        out, torch.tensor([[3.0, 4.0, 0.0], [5.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=0
    )
    # eps is added to the std: [-1, 0, 1] * 2 / (2 + 1e-6)
    torch.testing.assert_close(masked_whiten(x, mask)[0, 0].item(), -2 / (2 + 1e-6), rtol=0, atol=1e-15)
    assert torch.equal(masked_whiten(torch.full((2, 3), 0.7), mask), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least 2 selected"):
        masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_token_rewards_from_outcome_hand_computed():
    # last real tokens: row 0 -> t=1, row 1 -> t=2 (t=1 is a hole)
    # row 0: [-0.5*0.1, 1 - 0.5*0.2, 0 (masked)] = [-0.05, 0.9, 0]
    # row 1: [-0.5*0.4, 0 (masked), 2 - 0.5*0.6] = [-0.2, 0, 1.7]
    seq_rewards = torch.tensor([1.0, 2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=F64, requires_grad=True)
    out = token_rewards_from_outcome(seq_rewards, mask, kl, kl_coef=0.5)
    torch.testing.assert_close(
        out, torch.tensor([[-0.05, 0.9, 0.0], [-0.2, 0.0, 1.7]], dtype=F64), rtol=0, atol=1e-15
    )
    assert not out.requires_grad  # a reward is data: the KL is detached
    assert token_rewards_from_outcome(seq_rewards, mask).tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]]
    with pytest.raises(ValueError, match="response 1 has no response token"):
        token_rewards_from_outcome(seq_rewards, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"seq_rewards must have shape \[B\]"):
        token_rewards_from_outcome(torch.zeros(3), mask)


def test_masked_whiten_across_ranks_equals_the_whole_batch():
    """Two simulated data-parallel ranks (threads exchanging sums) whiten with the whole batch's statistics."""
    import threading

    torch.manual_seed(0)
    x = torch.randn(6, 5, dtype=F64)
    mask = (torch.rand(6, 5) > 0.3).to(F64)
    box: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(2)

    def sum_with_peer(rank):
        def all_reduce(t):
            box[rank] = t.clone()
            barrier.wait()
            t.copy_(box[0] + box[1])
            barrier.wait()

        return all_reduce

    halves: dict[int, torch.Tensor] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: halves.__setitem__(
                r, masked_whiten(x[3 * r : 3 * r + 3], mask[3 * r : 3 * r + 3], all_reduce=sum_with_peer(r))
            )
        )
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    torch.testing.assert_close(torch.cat([halves[0], halves[1]]), masked_whiten(x, mask), rtol=0, atol=1e-12)
    assert not torch.allclose(halves[0], masked_whiten(x[:3], mask[:3]))  # local statistics would differ
