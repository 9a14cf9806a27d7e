"""PPO with a critic end to end (the headline example's config), and the rarer algorithm paths in one short run.

The PPO run is the demo of examples/ppo.py (Megatron policy + Megatron value model, GAE, value clipping,
critic warm-up, KL as a reward penalty), shortened only in steps; it must learn.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.runs import run

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def ppo_result(ray_cluster, demo_cache, tmp_path_factory):
    return run("ppo", tmp_path_factory.mktemp("ppo"), "algo.dual_clip=3.0", quiet=False)


def test_ppo_learns(ppo_result):
    evals = ppo_result.metric("eval/accuracy")
    assert evals[0] < 0.5 and evals[1] > evals[0] + 0.1, evals
    rewards = ppo_result.metric("reward_mean")
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, (first, last)


def test_critic_warms_up_then_both_train(ppo_result):
    rows = [r for r in ppo_result.history if "reward_mean" in r]
    warmup = 5
    assert all("value_loss" in r for r in rows)
    assert not any("pg_loss" in r for r in rows[:warmup])  # the policy waits for the critic
    assert all("pg_loss" in r for r in rows[warmup:])
    assert rows[warmup - 1]["value_loss"] < rows[0]["value_loss"]  # the critic fits before the policy moves
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] != 0.0  # k1 to the reference: 0 until the policy moves
    assert any(r["clipfrac"] > 0 for r in rows[warmup:])  # two mini-batches: the PPO clip binds


def test_critic_is_saved_with_the_policy(ppo_result):
    from transformers import AutoModelForTokenClassification

    critic_dir = Path(ppo_result.output_dir) / "final_critic"  # beside final_hf in the run folder
    critic = AutoModelForTokenClassification.from_pretrained(critic_dir)
    assert critic.config.num_labels == 1


def test_remax_cispo_seq_aggregation_and_token_budget(ray_cluster, demo_cache, tmp_path):
    """Greedy baselines (ReMax), CISPO, a sequence-level aggregation, token-budget micro-batches and trainer
    offload while generating, dp 1."""
    result = run(
        "grpo", tmp_path, "algo.name=remax", "algo.policy_loss=cispo", "algo.clip_low=1.0",
        "algo.loss_agg=seq-mean-token-sum-norm", "train.max_tokens_per_micro_batch=64",
        "train.offload_during_rollout=true", "train.dp_size=1", "train.steps=2", "train.prompts_per_step=8",
        "rollout.n=2", quiet=False,
    )  # fmt: skip
    rows = [r for r in result.history if "reward_mean" in r]
    assert len(rows) == 2
    assert all(0 <= r["greedy_reward_mean"] <= 1 and r["grad_norm"] > 0 for r in rows)
    assert all(r["rollout_logp_diff"] < 1e-3 and r["time/offload"] > 0 for r in rows)  # weights came back
