"""Policy losses: per-token values, to be reduced by `yatt_ray.algos.aggregation.aggregate`."""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import POLICY_LOSSES

__all__ = ["RATIO_LOG_CLAMP", "ppo_clip_loss"]

RATIO_LOG_CLAMP = 20.0
"""The log importance ratio is clamped to [-20, 20] before ``exp``, so the ratio lies in [2e-9, 4.9e8]."""


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate objective, negated to a loss, per token (Schulman et al. 2017).

    Shapes: ``logp`` (current policy, carries the gradient), ``old_logp`` (the policy that sampled, treated as
    data) and ``advantages`` are all [B, T] -> ``(loss [B, T], stats)``.

    Formula::

        ratio  = exp(clamp(logp - old_logp, -20, 20))
        loss   = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
               =  max(-ratio * A, -clip(ratio, 1 - clip_low, 1 + clip_high) * A)

    ``clip_low`` and ``clip_high`` may differ (asymmetric "clip-higher", as in DAPO). The clamp on the log-ratio
    (`RATIO_LOG_CLAMP`) only guards against overflow; inside it the loss is exact. Where the clipped term is
    the smaller objective the token's gradient is 0. Computed in at least float32. Padding positions are not
    masked here.

    ``stats`` holds detached per-token [B, T] tensors: ``"ratio"`` (the clamped importance ratio) and
    ``"clipped"`` (1.0 where the clipped term is strictly the smaller objective, i.e. the token gets no
    gradient, else 0.0). Average them with the response mask for logging.
    """
    if not (logp.shape == old_logp.shape == advantages.shape):
        raise ValueError(
            f"logp, old_logp and advantages must share one shape [B, T], got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)} and {tuple(advantages.shape)}; broadcast sequence advantages with "
            f"broadcast_to_tokens(seq_adv, response_mask)"
        )
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}; the usual value is 0.2")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}; the usual value is 0.2 (0.28 in DAPO)")

    dtype = torch.promote_types(torch.promote_types(logp.dtype, old_logp.dtype), torch.float32)
    dtype = torch.promote_types(dtype, advantages.dtype)
    adv = advantages.to(dtype)
    log_ratio = (logp.to(dtype) - old_logp.to(dtype)).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped": (clipped < unclipped).to(dtype).detach(),
    }
    return loss, stats
