"""The mathematics of one GRPO step around the trainer: advantages, the loss closure and metric reduction.

Kept apart from the controller so that each piece is a small function with tensors in and tensors out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from yatt_ray.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, aggregate, broadcast_to_tokens, kl_estimate
from yatt_ray.config import AlgoConfig, Config


@dataclass
class StepInputs:
    """One group's rollout: the packed batch (see yatt_ray.batch), decoded texts and their rewards [N]."""

    batch: dict[str, torch.Tensor]
    prompt_width: int
    texts: list[str]
    ground_truths: list[str]
    sources: list[str]
    n: int
    truncated: int = 0
    prompts_clipped: int = 0
    rewards: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def scoring_inputs(self):
        return zip(self.texts, self.ground_truths, self.sources)


def group_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, config: Config) -> torch.Tensor:
    """Rewards [N] (N = prompts x n, a prompt's samples adjacent) -> per-token advantages [N, R]."""
    n = config.rollout.n
    per_prompt = rewards.reshape(-1, n)  # [P, n]
    seq_adv = ADVANTAGE_ESTIMATORS.get(config.algo.advantage)(per_prompt).reshape(-1)  # [N]
    return broadcast_to_tokens(seq_adv, response_mask)


def grpo_loss_fn(algo: AlgoConfig, prompt_width: int, global_tokens: float):
    """The per-micro-batch loss for MegatronPolicy.train_step.

    loss = agg( pg(ratio, A) + kl_coef * KL_k(logp || ref) - entropy_coef * H ), aggregated with
    `algo.loss_agg` over the *global* token count, so micro-batch and data-parallel shares sum to the
    full-batch loss. Logged values are returned as shares too (they sum to batch means).
    """
    policy_loss = POLICY_LOSSES.get(algo.policy_loss)

    def loss_fn(logp: torch.Tensor, entropy: torch.Tensor, mb: dict[str, torch.Tensor]):
        lp, ent = logp[:, prompt_width - 1 :], entropy[:, prompt_width - 1 :]
        mask = mb["response_mask"]
        pg, stats = policy_loss(lp, mb["old_logp"], mb["advantages"], algo.clip_low, algo.clip_high)
        per_token = pg - algo.entropy_coef * ent
        share = {"pg_loss": pg.detach(), "entropy": ent.detach(), "clipfrac": stats["clipped"]}
        if algo.kl_coef > 0:
            kl = kl_estimate(lp, mb["ref_logp"], algo.kl_estimator)
            per_token = per_token + algo.kl_coef * kl
            share["kl"] = kl.detach()
        loss = aggregate(per_token, mask, algo.loss_agg, global_tokens=global_tokens)
        metrics = {
            k: float(aggregate(v, mask, "token-mean", global_tokens=global_tokens)) for k, v in share.items()
        }
        return loss, metrics

    return loss_fn


_SUMS = (
    "reward", "correct", "samples", "response_tokens", "prompt_tokens", "truncated", "logp_diff", "prompts_clipped"
)  # fmt: skip


def local_sums(inputs: StepInputs) -> torch.Tensor:
    """This group's additive statistics, in the order of _SUMS."""
    b = inputs.batch
    mask = b["response_mask"]
    prompt_tokens = b["attention_mask"][:, : inputs.prompt_width].sum()
    diff = ((b["old_logp"] - b["rollout_logp"]).abs() * mask).sum()
    values: list[float | int | torch.Tensor] = [
        inputs.rewards.sum(),
        (inputs.rewards >= 1.0).sum(),
        len(inputs.texts),
        mask.sum(),
        prompt_tokens,
        inputs.truncated,
        diff,
        inputs.prompts_clipped,
    ]
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def reduce_metrics(
    step: int, inputs: StepInputs, train_stats: dict[str, float], times: dict[str, float], is_controller: bool
) -> dict[str, float]:
    """All-reduce the step's statistics over every worker: sums over controllers, max of times.

    `times` holds each phase's seconds, "step" (the step's wall time on this worker), "other" (the part of
    the step outside every phase: batching, broadcasts, bookkeeping) and "orchestration" (the step less
    rollout, reward, log-prob and train compute: weight sync plus "other").
    Every rank must call it. Non-controller ranks hold copies of their group's batch and add zeros.
    """
    sums = local_sums(inputs) if is_controller else torch.zeros(len(_SUMS), dtype=torch.float64)
    dist.all_reduce(sums)
    s = dict(zip(_SUMS, sums.tolist()))
    phase_names = sorted(times)
    phase = torch.tensor([times[k] for k in phase_names], dtype=torch.float64)
    dist.all_reduce(phase, op=dist.ReduceOp.MAX)
    maxima = dict(zip(phase_names, phase.tolist()))
    step_time = maxima.pop("step")
    samples, tokens = max(s["samples"], 1.0), max(s["response_tokens"], 1.0)
    metrics = {
        "step": float(step),
        "reward_mean": s["reward"] / samples,
        "accuracy": s["correct"] / samples,
        "response_length": s["response_tokens"] / samples,
        "truncated_fraction": s["truncated"] / samples,
        "prompts_clipped": s["prompts_clipped"],
        "rollout_logp_diff": s["logp_diff"] / tokens,
        "tokens_per_s": (s["response_tokens"] + s["prompt_tokens"]) / max(step_time, 1e-9),
        "time/step": step_time,
    }
    metrics.update({f"time/{k}": v for k, v in maxima.items()})
    metrics.update(train_stats)
    return metrics
