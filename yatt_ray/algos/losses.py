"""Policy losses: per-token values, to be reduced by `yatt_ray.algos.aggregation.aggregate`.

Every registered loss has the signature::

    fn(logp, old_logp, advantages, clip_low, clip_high, *, response_mask=None, **options)
        -> (per_token_loss [B, T], stats)

``logp`` is the current policy's log-probability of each sampled token (it carries the gradient),
``old_logp`` that of the policy that the ratio is taken against (data), ``advantages`` the per-token
advantages (sequence advantages broadcast with `broadcast_to_tokens`). ``response_mask`` [B, T] (1 = a token
the loss sees) is accepted by every loss, so the trainer can always pass it; the sequence-level loss
("gspo") requires it. ``stats`` holds detached per-token [B, T] tensors, always including ``"ratio"`` and
``"clipped"``; average them with the response mask for logging. Padding positions of the loss are not
zeroed here: the aggregation masks them.

=============  ============================================================  ===================================
name           per-token loss                                                typical clip_low / clip_high
=============  ============================================================  ===================================
"ppo_clip"     -min(r A, clip(r) A), optional dual clip                       0.2 / 0.2 (0.2 / 0.28 in DAPO)
"gspo"         as ppo_clip with the sequence ratio s_i (GSPO-token form)      3e-4 / 4e-4
"cispo"        -sg(clip(r)) A logp                                            upper bound only (see `cispo_loss`)
=============  ============================================================  ===================================

The critic's loss, `clipped_value_loss`, lives here too (not registered: there is one form, with an option).
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import POLICY_LOSSES

__all__ = [
    "ADVANTAGE_PROPORTIONAL",
    "GSPO_LOG_RATIO_CLAMP",
    "RATIO_LOG_CLAMP",
    "cispo_loss",
    "clipped_value_loss",
    "gspo_loss",
    "ppo_clip_loss",
]

RATIO_LOG_CLAMP = 20.0
"""The log importance ratio is clamped to [-20, 20] before ``exp``, so the ratio lies in [2e-9, 4.9e8]."""

GSPO_LOG_RATIO_CLAMP = 10.0
"""GSPO's sequence log-ratio is clamped to [-10, 10] (ratio in [4.5e-5, 2.2e4]), value and gradient; see `gspo_loss`."""

ADVANTAGE_PROPORTIONAL = frozenset({"ppo_clip", "gspo", "cispo"})
"""The registered losses whose per-token value is the advantage times a factor: a row whose advantages are all
0 adds exactly 0 to the loss and to its gradient, so the trainer may skip it (`step.zero_gradient_rows`). A
loss registered elsewhere joins this set only when that holds for it too."""


def _check_inputs(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor | None
) -> torch.dtype:
    """Shape checks; the computation dtype (at least float32)."""
    if not (logp.shape == old_logp.shape == advantages.shape):
        raise ValueError(
            f"logp, old_logp and advantages must share one shape [B, T], got {tuple(logp.shape)}, "
            f"{tuple(old_logp.shape)} and {tuple(advantages.shape)}; broadcast sequence advantages with "
            f"broadcast_to_tokens(seq_adv, response_mask)"
        )
    if response_mask is not None and response_mask.shape != logp.shape:
        raise ValueError(
            f"response_mask must have the shape of logp {tuple(logp.shape)}, got {tuple(response_mask.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(logp.dtype, old_logp.dtype), torch.float32)
    return torch.promote_types(dtype, advantages.dtype)


_USUAL_CLIPS = {
    "ppo_clip": "0.2 (clip_high 0.28 in DAPO)",
    "gspo": "3e-4 / 4e-4 (GSPO paper)",
    "cispo": "clip_low 1 (no lower bound); tune clip_high",
}


def check_clip(clip_low: float, clip_high: float, policy_loss: str = "ppo_clip") -> None:
    """The clip range's domain, one source for the losses and the config: ``clip_low`` in [0, 1) (CISPO also
    takes 1, no lower bound), ``clip_high`` > 0. `ValueError` naming the value and the usual one."""
    usual = _USUAL_CLIPS.get(policy_loss, _USUAL_CLIPS["ppo_clip"])
    allow_low_one = policy_loss == "cispo"
    if not (0.0 <= clip_low < 1.0 or (allow_low_one and clip_low == 1.0)):
        bound = "[0, 1]" if allow_low_one else "[0, 1) (1, no lower bound, suits cispo only)"
        raise ValueError(f"clip_low must be in {bound}, got {clip_low}; the usual value is {usual}")
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}; the usual value is {usual}")


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    *,
    dual_clip: float | None = None,
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate objective, negated to a loss, per token (Schulman et al. 2017).

    Shapes: ``logp`` (current policy, carries the gradient), ``old_logp`` (the policy that sampled, treated as
    data) and ``advantages`` are all [B, T] -> ``(loss [B, T], stats)``.

    Formula::

        ratio  = exp(clamp(logp - old_logp, -20, 20))
        loss   = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
               =  max(-ratio * A, -clip(ratio, 1 - clip_low, 1 + clip_high) * A)

    Dual clip (Ye et al. 2020), when ``dual_clip = c`` (c > 1) is given: for A < 0 the loss is also capped at
    ``-c * A`` (> 0), i.e. ``loss = min(loss, -c * A)``, so a token whose ratio has grown far above 1 + clip_high
    while its advantage is negative cannot produce an unbounded loss and gradient; it gets no gradient
    instead. Tokens with A >= 0 are unchanged. The usual value is c = 3.

    ``clip_low`` and ``clip_high`` may differ (asymmetric "clip-higher", as in DAPO). The clamp on the log-ratio
    (`RATIO_LOG_CLAMP`) only guards against overflow; inside it the loss is exact. Where the clipped term is
    the smaller objective the token's gradient is 0. Computed in at least float32. Padding positions are not
    masked here; ``response_mask`` is accepted (for a uniform call) and unused.

    ``stats`` holds detached per-token [B, T] tensors: ``"ratio"`` (the clamped importance ratio),
    ``"clipped"`` (1.0 where the clipped term is strictly the smaller objective, i.e. the token gets no
    gradient, else 0.0) and ``"dual_clipped"`` (1.0 where the dual-clip cap is strictly below the PPO loss;
    all 0 without ``dual_clip``). Average them with the response mask for logging.
    """
    dtype = _check_inputs(logp, old_logp, advantages, response_mask)
    check_clip(clip_low, clip_high, "ppo_clip")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}; the usual value is 3")

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
    if dual_clip is None:
        stats["dual_clipped"] = torch.zeros_like(stats["ratio"])
        return loss, stats
    cap = -dual_clip * adv
    capped = (adv < 0) & (cap < loss)
    loss = torch.where(capped, cap, loss)
    stats["dual_clipped"] = capped.to(dtype).detach()
    return loss, stats


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    *,
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Group sequence policy optimisation (GSPO, Zheng et al. 2025), in its token form ("GSPO-token").

    Shapes: ``logp``, ``old_logp``, ``advantages`` and ``response_mask`` (required) are [B, T] ->
    ``(loss [B, T], stats)``.

    GSPO clips one importance ratio per *sequence*, the length-normalised (geometric-mean) ratio::

        s_i = exp( (1 / |y_i|) * sum_{t in y_i} (logp[i, t] - old_logp[i, t]) )    |y_i| = mask-1 tokens of row i
        J   = (1 / G) * sum_i min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i)

    What is computed here is the per-token form whose value *and* gradient equal that::

        m_i     = sg( (1 / |y_i|) * sum_{t in y_i} (logp[i, t] - old_logp[i, t]) )     # log s_i, detached
        s[i, t] = exp( clamp(m_i + logp[i, t] - sg(logp[i, t]), -10, 10) )      # value exp(clamp(m_i))
        loss[i, t] = -min(s[i, t] * A[i, t], clip(s[i, t], 1 - clip_low, 1 + clip_high) * A[i, t])

    Inside the clamp (|m_i| <= 10) ``s[i, t]`` has value s_i and ``d s[i, t] / d logp[i, t] = s_i``.

    (``sg`` = stop-gradient / ``detach``.) When ``A[i, t] = A_i`` on every token of row i (an outcome
    advantage broadcast with `broadcast_to_tokens`), averaging ``loss`` over each sequence's tokens and then
    over sequences -- aggregation "seq-mean-token-mean" -- gives exactly ``-J`` and its gradient, because
    ``d s_i / d logp[i, t] = s_i / |y_i|``. With other aggregations the sequences are weighted differently
    (e.g. "token-mean" weights a sequence by its length), which departs from the paper. A per-token advantage
    (e.g. from "gae") is used token by token, which is the paper's GSPO-token.

    Clip ranges: the ratio is a per-token geometric mean, so it stays very close to 1; the GSPO paper uses
    clip_low = 3e-4 and clip_high = 4e-4 (the defaults here), two to three orders of magnitude below PPO's
    0.2. Numerics: mask-0 positions are excluded from the mean (their logp may be anything, even inf); a row
    with no mask-1 token gets s = 1. Computed in at least float32.

    Clamp (`GSPO_LOG_RATIO_CLAMP` = 10): ``torch.clamp`` is applied to the log-ratio *with* its gradient path
    (``m_i + logp - sg(logp)``), so it bounds the gradient as well as the value: a row with |m_i| > 10 has
    ratio exp(+-10) and zero gradient, and its per-token loss is bounded by ``exp(10) * |A| = 22026.47 |A|``.
    (Clamping only the detached ``m_i`` would bound the value while still passing the gradient s_i of the
    unclamped ratio.) The paper states no clamp; a geometric-mean ratio beyond e^10 is ~10^7 times outside
    its clip range, and with A < 0 PPO-style clipping never caps it (the unclipped term is the minimum), so
    without the clamp such a row's loss and gradient grow as e^{m_i}. 10 is also the clamp verl's GSPO uses
    (on the upper side; here it is symmetric, which changes the loss by at most e^-10 |A| per token).

    ``stats`` (detached, [B, T]): ``"ratio"`` (s_i on every token of row i) and ``"clipped"`` (1.0 where the
    clipped term is strictly the smaller objective: no gradient).
    """
    dtype = _check_inputs(logp, old_logp, advantages, response_mask)
    if response_mask is None:
        raise ValueError(
            "gspo needs response_mask [B, T] to average the log-ratio over each sequence's tokens; pass "
            "response_mask=mask"
        )
    check_clip(clip_low, clip_high, "gspo")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    lp = torch.where(mask, logp.to(dtype), zero)
    old = torch.where(mask, old_logp.to(dtype), zero)
    n_tokens = mask.sum(dim=1, keepdim=True).clamp_min(1).to(dtype)
    seq_log_ratio = ((lp - old).sum(dim=1, keepdim=True) / n_tokens).detach()
    # clamp *after* adding the gradient path, so that outside the bounds the gradient is 0, not s_i
    log_ratio = torch.clamp(seq_log_ratio + (lp - lp.detach()), -GSPO_LOG_RATIO_CLAMP, GSPO_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # value exp(clamp(m_i)); gradient s_i * d logp inside the clamp, else 0
    adv = advantages.to(dtype)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    stats = {
        "ratio": torch.exp(seq_log_ratio.clamp(-GSPO_LOG_RATIO_CLAMP, GSPO_LOG_RATIO_CLAMP))
        .expand_as(loss)
        .detach(),
        "clipped": (clipped < unclipped).to(dtype).detach(),
    }
    return loss, stats


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.2,
    *,
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Clipped importance-sampling policy optimisation (CISPO, MiniMax-M1, 2025), per token.

    Shapes: ``logp``, ``old_logp``, ``advantages`` [B, T] -> ``(loss [B, T], stats)``::

        ratio = exp(clamp(logp - old_logp, -20, 20))
        w     = sg( clip(ratio, 1 - clip_low, 1 + clip_high) )      # clipped IS weight, detached
        loss  = -w * A * logp

    PPO clips the *objective*, so a token whose ratio left the trust region gets no gradient at all (often the
    rare, high-information tokens). CISPO clips only the importance weight and keeps every token's policy
    gradient ``-w * A * d logp``; the weight bound caps its size. At ``logp == old_logp`` the gradient equals
    PPO's. The loss *value* is a surrogate (its gradient is what matters): it shifts with ``logp``, so don't
    compare it across losses. The MiniMax-M1 report bounds the weight from above only (their lower epsilon is
    set large enough to be inactive); ``clip_low = 1`` (the default here, allowed for this loss only) gives
    the bound ``w >= 0``, i.e. none. Computed in at least float32; ``response_mask`` is accepted and unused.

    ``stats`` (detached, [B, T]): ``"ratio"`` and ``"clipped"`` (1.0 where the weight was clipped, i.e. the
    ratio lies outside [1 - clip_low, 1 + clip_high]; unlike PPO these tokens still get a gradient).
    """
    dtype = _check_inputs(logp, old_logp, advantages, response_mask)
    check_clip(clip_low, clip_high, "cispo")
    lp = logp.to(dtype)
    ratio = torch.exp((lp - old_logp.to(dtype)).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)).detach()
    low, high = 1.0 - clip_low, 1.0 + clip_high
    weight = ratio.clamp(low, high)
    loss = -weight * advantages.to(dtype) * lp
    stats = {"ratio": ratio, "clipped": ((ratio < low) | (ratio > high)).to(dtype)}
    return loss, stats


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's regression loss with PPO-style value clipping, per token.

    Shapes: ``values`` (current critic, carries the gradient), ``old_values`` (the critic's values when the
    batch was made, data) and ``returns`` (GAE returns, the targets, data) are [B, T] -> ``(loss [B, T],
    stats)``::

        V_clip = old_values + clamp(values - old_values, -value_clip, value_clip)
        loss   = 0.5 * max((values - returns)^2, (V_clip - returns)^2)        with value_clip = c > 0
        loss   = 0.5 * (values - returns)^2                                    with value_clip = None

    The max makes the clip pessimistic: a value that moved more than ``c`` away from its old value is
    penalised as if it had moved only ``c`` whenever that is worse, and then gets no gradient. ``c`` is in
    the units of the returns (0.2 is common). The 0.5 makes the gradient ``values - returns``. Computed in at
    least float32; padding positions are not masked (the aggregation does).

    ``stats`` (detached, [B, T]): ``"clipped"``, 1.0 where the clipped term is strictly the larger (no
    gradient), else 0.0 (all 0 without ``value_clip``).
    """
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError(
            f"values, old_values and returns must share one shape [B, T], got {tuple(values.shape)}, "
            f"{tuple(old_values.shape)} and {tuple(returns.shape)}"
        )
    if value_clip is not None and not value_clip > 0:
        raise ValueError(f"value_clip must be > 0 (or None to disable), got {value_clip}; e.g. 0.2")
    dtype = torch.promote_types(torch.promote_types(values.dtype, old_values.dtype), torch.float32)
    dtype = torch.promote_types(dtype, returns.dtype)
    v, target = values.to(dtype), returns.to(dtype)
    unclipped = (v - target).square()
    if value_clip is None:
        return 0.5 * unclipped, {"clipped": torch.zeros_like(unclipped).detach()}
    old = old_values.to(dtype)
    v_clip = old + (v - old).clamp(-value_clip, value_clip)
    clipped = (v_clip - target).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, {"clipped": (clipped > unclipped).to(dtype).detach()}
