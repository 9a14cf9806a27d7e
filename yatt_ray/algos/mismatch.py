"""Rollout / trainer mismatch: truncated importance sampling (TIS) weights and mismatch statistics.

The rollout engine (vLLM, with its own kernels, precision and sometimes quantisation) and the trainer
(Megatron) compute slightly different probabilities for the same tokens and weights. PPO-style losses take
the ratio against ``old_logp``, recomputed by the *trainer*, while the tokens were sampled from the *rollout
engine*'s distribution, so the gradient is off-policy by ``pi_old / pi_rollout``. Truncated importance
sampling corrects for it with a capped weight per token (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training")::

    per_token_loss = tis_weights(old_logp, rollout_logp, cap) * policy_loss(...)[0]

Shapes are [B, T] throughout; the log-probabilities are of the sampled tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.kl import kl_k3

__all__ = ["TIS_LOG_RATIO_CLAMP", "mismatch_stats", "tis_weights"]

TIS_LOG_RATIO_CLAMP = 20.0
"""``old_logp - rollout_logp`` is clamped to [-20, 20] before ``exp`` (no overflow, even in fp32)."""


def _check(old_logp: Tensor, rollout_logp: Tensor) -> torch.dtype:
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(
            f"old_logp and rollout_logp must share one shape [B, T], got {tuple(old_logp.shape)} and "
            f"{tuple(rollout_logp.shape)}"
        )
    return torch.promote_types(torch.promote_types(old_logp.dtype, rollout_logp.dtype), torch.float32)


def tis_weights(old_logp: Tensor, rollout_logp: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance weights ``min(exp(clamp(old_logp - rollout_logp, -20, 20)), cap)``, [B, T] -> [B, T].

    Detached (a weight, not a path for the gradient), in at least float32. ``cap`` > 0 bounds the variance;
    2 is a common choice. Weights at padding positions are whatever the padding log-probs give: the
    aggregation masks them. Multiply the per-token policy loss by these weights before aggregating.
    """
    dtype = _check(old_logp, rollout_logp)
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}; the usual value is 2")
    log_ratio = (old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)).clamp(
        -TIS_LOG_RATIO_CLAMP, TIS_LOG_RATIO_CLAMP
    )
    return torch.exp(log_ratio).clamp_max(cap)


def mismatch_stats(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the trainer's and the rollout engine's log-probabilities disagree, over the mask-1 tokens.

    Shapes: [B, T] each -> a dict of detached 0-d tensors (``float(v)`` gives a number)::

        "logp_abs_diff_mean"  mean |old_logp - rollout_logp|
        "logp_abs_diff_max"   max  |old_logp - rollout_logp|
        "kl_k3_mean"          mean k3 estimate of KL(pi_rollout || pi_old) (tokens were sampled by the rollout
                              engine; k3 with its log-ratio clamped to [-20, 20], see `kl_k3`)
        "tokens"              number of mask-1 tokens (to combine controllers: weight the means by it, take
                              the max of the maxima)

    With no mask-1 token every value is 0. Computed in at least float32.
    """
    dtype = _check(old_logp, rollout_logp)
    if mask.shape != old_logp.shape:
        raise ValueError(f"mask must have shape {tuple(old_logp.shape)}, got {tuple(mask.shape)}")
    with torch.no_grad():
        m = mask.bool()
        zero = torch.zeros((), dtype=dtype, device=old_logp.device)
        old = torch.where(m, old_logp.to(dtype), zero)
        rollout = torch.where(m, rollout_logp.to(dtype), zero)
        count = m.sum().to(dtype)
        diff = (old - rollout).abs()
        denom = count.clamp_min(1)
        return {
            "logp_abs_diff_mean": diff.sum() / denom,
            "logp_abs_diff_max": diff.max() if diff.numel() else zero,
            "kl_k3_mean": torch.where(m, kl_k3(rollout, old), zero).sum() / denom,
            "tokens": count,
        }
