"""Packing rollouts into tensors, GRPO advantages per token, and the loss closure's sharing convention."""

import pytest
import torch

from yatt_ray.batch import RolloutBatch, pack
from yatt_ray.config import Config
from yatt_ray.step import compute_advantages, policy_loss_fn


def test_pack_layout():
    batch = pack([[1, 5], [1, 6, 7]], [[9, 2], [8]], [[-0.5, -0.1], [-0.3]], pad_id=0)
    assert batch.prompt_width == 3 and batch.size == 2
    assert batch.input_ids.tolist() == [[0, 1, 5, 9, 2], [1, 6, 7, 8, 0]]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.response_mask.tolist() == [[1, 1], [1, 0]]
    torch.testing.assert_close(batch.rollout_logp, torch.tensor([[-0.5, -0.1], [-0.3, 0.0]]))


def test_response_slice_rows_and_tensors():
    batch = pack([[1, 5], [1, 6, 7], [2]], [[9, 2], [8], [3, 4]], [[0.0, 0.0], [0.0], [0.0, 0.0]], pad_id=0)
    per_position = torch.arange(3 * 4).reshape(3, 4)  # [N, P + R - 1]: position t scores token t + 1
    assert batch.response(per_position).tolist() == [[2, 3], [6, 7], [10, 11]]
    batch.rewards, batch.greedy_rewards = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5])
    picked = batch.rows(torch.tensor([2, 0]))
    assert picked.size == 2 and picked.rewards.tolist() == [2.0, 1.0] and picked.greedy_rewards is None
    assert picked.input_ids.tolist() == [batch.input_ids[2].tolist(), batch.input_ids[0].tolist()]
    assert sorted(batch.tensors()) == [
        "attention_mask",
        "input_ids",
        "response_mask",
        "rewards",
        "rollout_logp",
    ]


def inputs_for(rewards, mask, **fields):
    n = mask.shape[0]
    ids = torch.ones(n, 1 + mask.shape[1], dtype=torch.long)
    batch = RolloutBatch(ids, torch.ones_like(ids), mask, torch.zeros_like(mask), 1, 2, rewards=rewards)
    for name, value in fields.items():
        setattr(batch, name, value)
    return batch


def advantages_of(batch, cfg, kl_coef):
    compute_advantages(batch, cfg.algo, kl_coef=kl_coef)
    return {"advantages": batch.advantages, "returns": batch.returns}


def test_group_advantages_are_per_prompt_and_masked():
    cfg = Config()
    cfg.rollout.n = 2
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # prompt 0: one right one wrong; prompt 1: both right
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    adv = advantages_of(inputs_for(rewards, mask), cfg, kl_coef=0.0)["advantages"]
    # prompt 0: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071 = +-0.7071; prompt 1: all equal -> 0
    expected = torch.tensor([[0.70710, 0.70710], [-0.70710, 0.0], [0.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_loss_shares_sum_to_full_batch_loss():
    torch.manual_seed(0)
    cfg = Config()
    cfg.algo.tis_cap = None  # no truncated-IS weights in this micro-batch
    n, width_p, width_r = 4, 3, 5
    logp = torch.randn(n, width_p + width_r - 1, requires_grad=True)
    entropy = torch.rand(n, width_p + width_r - 1)
    mask = (torch.rand(n, width_r) > 0.3).float()
    mb = {
        "response_mask": mask,
        "old_logp": logp[:, width_p - 1 :].detach() + 0.1 * torch.randn(n, width_r),
        "ref_logp": torch.randn(n, width_r),
        "advantages": torch.randn(n, width_r),
    }
    fn = policy_loss_fn(cfg.algo, width_p, float(mask.sum()), float(n), kl_coef=0.001, norm_len=width_r)
    full, full_metrics = fn(logp, entropy, mb)
    halves = [
        fn(logp[i : i + 2], entropy[i : i + 2], {k: v[i : i + 2] for k, v in mb.items()}) for i in (0, 2)
    ]
    torch.testing.assert_close(halves[0][0] + halves[1][0], full)
    for key in ("pg_loss", "entropy", "clipfrac"):
        assert abs(halves[0][1][key] + halves[1][1][key] - full_metrics[key]) < 1e-6


def test_kl_as_reward_penalty_lowers_outcome_rewards():
    """rloo with KL in the reward: r_i - kl_coef * sum_t KL_t, then the leave-one-out baseline."""
    cfg = Config()
    cfg.rollout.n, cfg.algo.name, cfg.algo.kl_in_reward, cfg.algo.kl_estimator = 2, "rloo", True, "k1"
    mask = torch.ones(2, 2)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -2.0], [-1.0, -1.0]])  # k1 = old - ref: row 0 has KL 1 per token, row 1 none
    out = advantages_of(inputs_for(torch.tensor([1.0, 1.0]), mask, old_logp=old, ref_logp=ref), cfg, 0.5)
    # rewards become [1 - 0.5 * 2, 1 - 0] = [0, 1]; rloo: [0 - 1, 1 - 0] = [-1, 1]
    torch.testing.assert_close(out["advantages"], torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))


def test_gae_advantages_are_whitened_and_returns_kept():
    cfg = Config()
    cfg.algo.name, cfg.critic.enable = "ppo", True
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 9.0], [0.0, 0.0, 0.0]])
    out = advantages_of(inputs_for(torch.tensor([1.0, 0.0]), mask, values=values), cfg, 0.0)
    # gamma = lam = 1: returns are the reward-to-go (1 on row 0, 0 on row 1), 0 on padding
    torch.testing.assert_close(out["returns"], torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    adv = out["advantages"][mask.bool()]
    assert abs(adv.mean().item()) < 1e-6 and abs(adv.std().item() - 1.0) < 1e-3
    assert out["advantages"][0, 2].item() == 0.0


def test_on_policy_loss_records_old_logp_and_matches_the_loss_with_given_old_logp():
    """`record_old_logp`: old = logp.detach() and IS weights against it give the loss (and gradient) of the
    off-policy form fed those same old log-probs; the detached values land in the buffer at `row`."""
    from yatt_ray.algos import tis_weights
    from yatt_ray.config import AlgoConfig
    from yatt_ray.step import policy_loss_fn

    algo = AlgoConfig(tis_cap=2.0)
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 5, generator=gen) - 2  # [b, T-1] with prompt width 2: response columns 1..4
    mb = {
        "response_mask": torch.ones(4, 4),
        "advantages": torch.randn(4, 4, generator=gen),
        "rollout_logp": logp[:, 1:] + 0.3 * torch.randn(4, 4, generator=gen),
        "row": torch.tensor([5, 1, 2, 7]),
    }
    buffer = torch.zeros(8, 4)
    a = logp.clone().requires_grad_(True)
    loss, _ = policy_loss_fn(algo, 2, 16.0, 4.0, 0.0, 4, record_old_logp=buffer)(a, torch.zeros_like(a), mb)
    loss.backward()
    old = logp[:, 1:]
    given = {**mb, "old_logp": old, "tis_weights": tis_weights(old, mb["rollout_logp"], 2.0)}
    b = logp.clone().requires_grad_(True)
    expected, _ = policy_loss_fn(algo, 2, 16.0, 4.0, 0.0, 4)(b, torch.zeros_like(b), given)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(buffer[[5, 1, 2, 7]], old)
    assert buffer[[0, 3, 4, 6]].abs().sum() == 0


def _one_row_loss(mode: str, band=(0.5, 2.0)):
    """policy_loss_fn on one row of 3 tokens with old_logp = logp (PPO ratio 1: pg = -A, d pg / d logp = -A),
    rho = pi_old / pi_rollout = [1, 4, 0.8], A = [1, 2, -1], token-mean over 3 tokens, no entropy or KL."""
    from yatt_ray.config import AlgoConfig

    algo = AlgoConfig(
        off_policy=mode, tis_cap=2.0, is_band_low=band[0], is_band_high=band[1], entropy_coef=0.0
    )
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)  # prompt width 1: all response columns
    mb = {
        "response_mask": torch.ones(1, 3),
        "advantages": torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64),
        "old_logp": logp.clone(),
        "rollout_logp": logp - torch.tensor([[1.0, 4.0, 0.8]], dtype=torch.float64).log(),
    }
    a = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss_fn(algo, 1, 3.0, 1.0, kl_coef=0.0, norm_len=3)(a, torch.zeros_like(a), mb)
    loss.backward()
    return loss.detach(), a.grad, metrics


def test_mis_masks_a_token_out_of_the_band_and_keeps_it_in_the_normaliser():
    # band [0.5, 2]: rho 4 is out -> w = [1, 0, 0.8]; pg = -A = [-1, -2, 1]
    # loss = (-1 * 1 + 0 + 1 * 0.8) / 3 (the masked token still counts) = -0.2 / 3; grad = w * -A / 3
    loss, grad, metrics = _one_row_loss("mis")
    torch.testing.assert_close(loss, torch.tensor(-0.2 / 3, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 0.0, 0.8 / 3]], dtype=torch.float64))
    assert metrics["off_policy/masked_frac"] == pytest.approx(1 / 3)
    assert metrics["off_policy/weight_mean"] == pytest.approx(1.8 / 3)
    assert metrics["off_policy/ratio_mean"] == pytest.approx(5.8 / 3)
    assert metrics["off_policy/clipped_frac"] == 0.0


def test_icepop_masks_without_reweighting_and_tis_truncates():
    # icepop: w = [1, 0, 1] -> loss (-1 + 0 + 1) / 3 = 0, grad [-1/3, 0, 1/3]
    loss, grad, metrics = _one_row_loss("icepop")
    assert abs(float(loss)) < 1e-15
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, 0.0, 1 / 3]], dtype=torch.float64))
    # tis (cap 2): w = [1, 2, 0.8] -> loss (-1 - 4 + 0.8) / 3 = -4.2 / 3; one token of three truncated
    loss, grad, metrics = _one_row_loss("tis")
    torch.testing.assert_close(loss, torch.tensor(-4.2 / 3, dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, -4 / 3, 0.8 / 3]], dtype=torch.float64))
    assert metrics["off_policy/clipped_frac"] == pytest.approx(1 / 3)
    assert metrics["off_policy/masked_frac"] == 0.0


def test_decoupled_mode_is_the_token_mean_of_decoupled_ppo_loss_and_tis_equals_none():
    from yatt_ray.algos import aggregate, decoupled_ppo_loss, tis_weights
    from yatt_ray.config import AlgoConfig

    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(4, 6, generator=gen) - 2  # prompt width 2: response columns 1..5
    mask = (torch.rand(4, 5, generator=gen) > 0.2).float()
    old = logp[:, 1:] + 0.2 * torch.randn(4, 5, generator=gen)
    rollout = old + 0.6 * torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen)
    mb = {"response_mask": mask, "advantages": adv, "old_logp": old, "rollout_logp": rollout}
    tokens = float(mask.sum())

    def run(**algo):
        a = logp.clone().requires_grad_(True)
        fn = policy_loss_fn(AlgoConfig(tis_cap=2.0, **algo), 2, tokens, 4.0, kl_coef=0.0, norm_len=5)
        loss, _ = fn(a, torch.zeros_like(a), {**mb, "tis_weights": tis_weights(old, rollout, 2.0)})
        loss.backward()
        return loss.detach(), a.grad

    b = logp[:, 1:].clone().requires_grad_(True)
    per_token, _ = decoupled_ppo_loss(b, old, rollout, adv, 0.2, 0.2, cap=2.0)
    expected = aggregate(per_token, mask, "token-mean", global_tokens=tokens)
    expected.backward()
    loss, grad = run(off_policy="decoupled")
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(grad[:, 1:], b.grad)
    for mode in ("tis", "none"):  # the same weight: bit for bit on one device
        other, other_grad = run(off_policy=mode)
        assert torch.equal(other, loss) and torch.equal(other_grad, grad), mode


def test_overlong_penalty_shapes_the_advantages_not_the_rewards():
    cfg = Config()
    cfg.rollout.n, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer = 2, 6, 2
    # both samples right (reward 1); sample 0 has 2 tokens, sample 1 hit the limit of 6:
    # penalty: 0 up to 6 - 2 = 4 tokens, (4 - 6) / 2 = -1 at 6 -> shaped rewards [1, 0]
    # grpo: mean 0.5, unbiased std sqrt(0.5) -> [+0.70711, -0.70711] (unshaped: all equal -> 0)
    mask = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [1.0] * 6])
    batch = inputs_for(torch.tensor([1.0, 1.0]), mask)
    compute_advantages(batch, cfg.algo, 0.0, max_new_tokens=6)
    assert batch.rewards.tolist() == [1.0, 1.0] and batch.overlong_penalty.tolist() == [0.0, -1.0]
    expected = torch.tensor([[0.70711, 0.70711, 0, 0, 0, 0], [-0.70711] * 6])
    torch.testing.assert_close(batch.advantages, expected, atol=1e-4, rtol=0)
    assert sorted(batch.rows(torch.tensor([1])).tensors()) == sorted(batch.tensors())  # a row field
    with pytest.raises(ValueError, match="pass max_new_tokens=config.rollout.max_new_tokens"):
        compute_advantages(inputs_for(torch.tensor([1.0, 1.0]), mask), cfg.algo, 0.0)


def test_without_a_buffer_the_advantages_are_unchanged():
    cfg = Config()
    cfg.rollout.n = 2
    mask = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [1.0] * 6])
    batch = inputs_for(torch.tensor([1.0, 0.0]), mask)
    compute_advantages(batch, cfg.algo, 0.0, max_new_tokens=6)
    plain = inputs_for(torch.tensor([1.0, 0.0]), mask)
    compute_advantages(plain, cfg.algo, 0.0)
    assert batch.overlong_penalty is None and torch.equal(batch.advantages, plain.advantages)
