"""Packing rollouts into tensors, GRPO advantages per token, and the loss closure's sharing convention."""

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
