"""Off-policy correction: importance weights and masks between the policy that sampled and the one that trains.

Three policies meet in one step. The *behaviour* policy sampled the tokens: its log-probabilities are those
the rollout engine reported (``rollout_logp``). The *proximal* policy is the trainer's weights at the start of
the train step: its log-probabilities are the "old" ones the trainer computes (``old_logp``, or on-policy the
detached log-probs of the training forward). The *current* policy carries the gradient (``logp``). PPO's ratio
``r_t = exp(logp_t - old_logp_t)`` is taken against the proximal policy; the corrections here act on the
behaviour -> proximal gap, through the per-token importance ratio::

    rho_t = exp(clamp(old_logp_t - rollout_logp_t, -20, 20))           [B, T]

In the synchronous loop that gap is only the rollout/trainer mismatch (different kernels, precision); with
asynchronous rollout it also holds the staleness of the weights that generated. ``algo.off_policy`` picks the
correction (`off_policy_weights` dispatches by name, `OFF_POLICY_CORRECTIONS` lists the names); each gives a
weight ``w_t`` and a keep-mask ``k_t`` over the response tokens, and the trainer's per-token policy loss becomes
``w_t * pg_t`` (entropy and KL terms are not weighted)::

    ============  ===================================================  =================================
    name          w_t                                                  k_t (1 = the token's pg counts)
    ============  ===================================================  =================================
    "none"        min(rho_t, cap) with algo.tis_cap set, else 1        1     (today's behaviour, exactly)
    "tis"         min(rho_t, cap)                                      1
    "mis"         rho_t * [low <= rho_t <= high]                       [low <= rho_t <= high]
    "icepop"      [low <= rho_t <= high]                               [low <= rho_t <= high]
    "decoupled"   min(rho_t, cap)  (see `decoupled_ppo_loss`)          1
    ============  ===================================================  =================================

``cap`` is ``algo.tis_cap``; ``[low, high]`` is ``[algo.is_band_low, algo.is_band_high]`` (0.5, 2.0), bounds
included. Notes on each:

* "none" with ``algo.tis_cap`` set is truncated importance sampling (TIS) against the rollout/trainer
  mismatch (`yatt_ray.algos.mismatch.tis_weights`), which is what the trainer has always done; "tis" is that
  same weight (the same function), named as an off-policy mode and requiring a cap. The two give equal
  numbers.
* "decoupled" is AReaL's decoupled PPO objective (Fu et al. 2025): the clipped ratio is taken against the
  proximal policy and the loss is multiplied by the proximal/behaviour weight. In this trainer PPO's ratio is
  *always* taken against the trainer-computed ``old_logp`` (the proximal policy), so "decoupled" and "tis"
  compute the same per-token loss; the name says which objective is meant, and stays correct when the
  asynchronous path starts to distinguish them. Here the weight is *truncated* at the cap; AReaL's own code
  (``behav_imp_weight_cap``) instead drops tokens whose weight exceeds the cap (weight 0).
* "mis" (masked importance sampling) and "icepop" zero the tokens whose ratio leaves the band: "mis" keeps the
  weight rho_t inside it, "icepop" the weight 1. The IcePop objective as published (Ring-1T, 2025) writes
  ``M(k) = k`` inside ``[alpha, beta]``, 0 outside, i.e. it keeps the ratio: that is "mis" here; "icepop" is
  the pure mask (also called token-level rejection sampling). ``algo.tis_cap`` is not used by either (the
  band bounds the weight).

Normalisation. A masked token (k_t = 0) contributes 0 to the policy-gradient term and gets no gradient from
it, but it *stays in the loss normaliser* (the global token / sequence counts of
`yatt_ray.algos.aggregation`). Two reasons: IcePop's objective averages ``M(.) * min(...)`` over all ``|y_i|``
tokens, masked ones included; and the trainer fixes the global denominators before the forward (on-policy the
ratio is only known inside it), which keeps micro-batch shares summing to the full-batch loss. The masked
fraction therefore scales the policy-gradient term down by (1 - masked fraction); it is logged.

Shapes are [B, T] throughout (log-probabilities of the sampled tokens; ``mask`` 1 = a real response token).
Weights are detached and computed in at least float32; values at mask-0 positions are whatever the padding
log-probs give (the aggregation masks them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.losses import ppo_clip_loss
from yatt_ray.algos.mismatch import TIS_LOG_RATIO_CLAMP, tis_weights
from yatt_ray.algos.registry import OFF_POLICY_CORRECTIONS

__all__ = [
    "OFF_POLICY_CORRECTIONS",
    "decoupled_ppo_loss",
    "importance_ratio",
    "importance_weight_stats",
    "off_policy_weights",
    "staleness_stats",
]


def _dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_shapes(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> None:
    if not (old_logp.dim() == 2 and old_logp.shape == rollout_logp.shape == mask.shape):
        raise ValueError(
            f"old_logp, rollout_logp and mask must share one shape [B, T], got {tuple(old_logp.shape)}, "
            f"{tuple(rollout_logp.shape)} and {tuple(mask.shape)}"
        )


def _check_band(low: float, high: float) -> None:
    if not 0 <= low < 1 < high:
        raise ValueError(
            f"the importance-ratio band must satisfy 0 <= low < 1 < high, got [{low}, {high}]; the usual band "
            f"is [0.5, 2]"
        )


def _check_cap(cap: float | None) -> float:
    if cap is None or not cap > 0:
        raise ValueError(
            f"off-policy corrections 'tis' and 'decoupled' need a cap > 0 (algo.tis_cap), got {cap}; the usual "
            "is 2"
        )
    return cap


def importance_ratio(old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """``rho = exp(clamp(old_logp - rollout_logp, -20, 20))``, [B, T] -> [B, T]: proximal over behaviour
    probability of each sampled token. Detached, in at least float32 (the clamp only prevents overflow)."""
    if old_logp.shape != rollout_logp.shape:
        raise ValueError(
            f"old_logp and rollout_logp must share one shape [B, T], got {tuple(old_logp.shape)} and "
            f"{tuple(rollout_logp.shape)}"
        )
    dtype = _dtype(old_logp, rollout_logp)
    log_ratio = old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype)
    return torch.exp(log_ratio.clamp(-TIS_LOG_RATIO_CLAMP, TIS_LOG_RATIO_CLAMP))


def _band(old_logp: Tensor, rollout_logp: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(rho, whether rho lies in [low, high]), each [B, T]."""
    _check_band(low, high)
    ratio = importance_ratio(old_logp, rollout_logp)
    return ratio, (ratio >= low) & (ratio <= high)


@OFF_POLICY_CORRECTIONS.register("none")
def _none(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float | None, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """No correction beyond the trainer's usual TIS: w = min(rho, cap) with a cap, else 1; nothing masked."""
    del low, high
    if cap is None:
        return torch.ones(mask.shape, dtype=_dtype(old_logp, rollout_logp), device=mask.device), mask.bool()
    return tis_weights(old_logp, rollout_logp, cap), mask.bool()


@OFF_POLICY_CORRECTIONS.register("tis")
@OFF_POLICY_CORRECTIONS.register("decoupled")
def _truncated(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float | None, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling, w = min(rho, cap) (the same weight as `tis_weights`); nothing masked.
    Also decoupled PPO's behaviour weight: its PPO ratio is taken against old_logp (the proximal policy), as
    the trainer always does. Unlike AReaL's own code, which drops a token whose weight exceeds the cap
    (weight 0, `behav_imp_weight_cap`), "decoupled" here caps it (weight = cap) and keeps it."""
    del low, high
    return tis_weights(old_logp, rollout_logp, _check_cap(cap)), mask.bool()


@OFF_POLICY_CORRECTIONS.register("mis")
def _mis(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float | None, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Masked importance sampling: w = rho inside [low, high], 0 outside (those tokens masked). This is the
    IcePop objective as published (Ring-1T: ``M(k) = k`` inside the band), not "icepop" here."""
    del cap
    ratio, inside = _band(old_logp, rollout_logp, low, high)
    weights = torch.where(inside, ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device))
    return weights, mask.bool() & inside


@OFF_POLICY_CORRECTIONS.register("icepop")
def _icepop(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float | None, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """Band mask: w = 1 inside [low, high], 0 outside (those tokens masked); no reweighting (token-level
    rejection sampling). Not the published IcePop, which keeps the ratio inside the band: that is "mis"."""
    del cap
    ratio, inside = _band(old_logp, rollout_logp, low, high)
    return inside.to(ratio.dtype), mask.bool() & inside


def importance_weight_stats(
    ratio: Tensor,
    weights: Tensor,
    mask: Tensor,
    keep: Tensor | None = None,
    cap: float | None = None,
) -> dict[str, Tensor]:
    """Statistics of the importance ratio and the weights applied, over the mask-1 tokens.

    Shapes: ``ratio`` (rho, `importance_ratio`), ``weights`` (w), ``mask`` (1 = a real response token) and
    ``keep`` (the correction's keep-mask, None = every token kept) are [B, T] -> a dict of detached 0-d
    tensors (``float(v)`` gives a number), with ``n = sum(mask)``::

        "ratio_mean"    sum_{mask} rho / n
        "ratio_max"     max_{mask} rho
        "weight_mean"   sum_{mask} w / n                      (masked tokens count with w = 0)
        "clipped_frac"  #{mask, rho > cap} / n                (truncated by the cap; 0 without a cap)
        "masked_frac"   #{mask, keep = 0} / n                 (excluded from the policy gradient)
        "tokens"        n   (to combine shards: weight the means and fractions by it, take the max of maxima)

    With no mask-1 token every value is 0. Computed in at least float32.
    """
    if not (ratio.shape == weights.shape == mask.shape and (keep is None or keep.shape == mask.shape)):
        raise ValueError(
            f"ratio, weights, mask and keep must share one shape [B, T], got {tuple(ratio.shape)}, "
            f"{tuple(weights.shape)}, {tuple(mask.shape)} and {None if keep is None else tuple(keep.shape)}"
        )
    dtype = _dtype(ratio, weights)
    with torch.no_grad():
        m = mask.bool()
        zero = torch.zeros((), dtype=dtype, device=ratio.device)
        count = m.sum().to(dtype)
        denom = count.clamp_min(1)
        rho = torch.where(m, ratio.to(dtype), zero)
        clipped = m & (ratio > cap) if cap is not None else torch.zeros_like(m)
        masked = m & ~keep.bool() if keep is not None else torch.zeros_like(m)
        return {
            "ratio_mean": rho.sum() / denom,
            "ratio_max": rho.max() if bool(m.any()) else zero,
            "weight_mean": torch.where(m, weights.to(dtype), zero).sum() / denom,
            "clipped_frac": clipped.sum().to(dtype) / denom,
            "masked_frac": masked.sum().to(dtype) / denom,
            "tokens": count,
        }


def off_policy_weights(
    mode: str,
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    cap: float | None = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The correction ``mode`` (``algo.off_policy``) as ``(weights [B, T], keep [B, T] bool, stats)``.

    ``old_logp`` (proximal), ``rollout_logp`` (behaviour) and ``mask`` are [B, T]; ``cap`` = ``algo.tis_cap``,
    ``[low, high]`` = the band. The per-token policy loss becomes ``weights * pg`` (weights are already 0
    where ``keep`` is 0); the formulas are in the module docstring. ``keep`` is ``mask`` with the masked tokens
    removed; ``stats`` is `importance_weight_stats` (``clipped_frac`` counted against the cap for the modes that
    truncate: "none" with a cap, "tis", "decoupled"). An unknown ``mode`` raises `UnknownNameError` listing the
    valid names.

    "none" returns exactly ``tis_weights(old_logp, rollout_logp, cap)`` (all ones when ``cap`` is None), so a
    caller that multiplied by `tis_weights` may call this instead and keep its numbers bit for bit.
    """
    correction = OFF_POLICY_CORRECTIONS.get(mode)
    _check_shapes(old_logp, rollout_logp, mask)
    weights, keep = correction(old_logp, rollout_logp, mask, cap, low, high)
    truncates = mode in ("tis", "decoupled") or (mode == "none" and cap is not None)
    stats = importance_weight_stats(
        importance_ratio(old_logp, rollout_logp), weights, mask, keep, cap if truncates else None
    )
    return weights, keep, stats


def decoupled_ppo_loss(
    logp: Tensor,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cap: float = 2.0,
    *,
    response_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """AReaL's decoupled PPO objective, negated to a per-token loss (Fu et al. 2025, "AReaL").

    Shapes: ``logp`` (current policy, carries the gradient), ``proximal_logp`` (the trainer's weights at the
    start of the train step: ``old_logp``), ``behaviour_logp`` (the policy that sampled: ``rollout_logp``) and
    ``advantages`` are [B, T] -> ``(loss [B, T], stats)``::

        r_t    = exp(clamp(logp_t - proximal_logp_t, -20, 20))
        w_t    = min(exp(clamp(proximal_logp_t - behaviour_logp_t, -20, 20)), cap)       (detached)
        loss_t = -w_t * min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)

    i.e. `ppo_clip_loss` against the proximal policy times the truncated proximal/behaviour weight (AReaL's
    own code drops the tokens whose weight exceeds the cap instead of truncating them). The trainer
    computes the same thing as "ppo_clip" with ``algo.off_policy=decoupled`` (or "tis"). ``stats``: those of
    `ppo_clip_loss` ("ratio", "clipped", "dual_clipped") and ``"behaviour_weight"`` (w, [B, T]).
    ``response_mask`` is accepted for a uniform call and unused (the aggregation masks padding).
    """
    pg, stats = ppo_clip_loss(
        logp, proximal_logp, advantages, clip_low, clip_high, response_mask=response_mask
    )
    weights = tis_weights(proximal_logp, behaviour_logp, cap)
    return pg * weights, {**stats, "behaviour_weight": weights}


def staleness_stats(
    versions_per_token: Tensor, trainer_version: int, mask: Tensor, bins: int | None = None
) -> dict[str, Tensor]:
    """How old the weights were that generated each sample (asynchronous rollout), over the mask-1 tokens.

    Shapes: ``versions_per_token`` [B, T] integer (the weight version that generated each token: a sample may
    span several when weights change mid-generation), ``mask`` [B, T] (1 = a real response token);
    ``trainer_version`` the version being trained now. A sample's staleness is
    ``s_b = trainer_version - min_{t: mask} versions[b, t]`` (its oldest token). Samples with no mask-1 token
    are left out. Returns detached tensors::

        "staleness_hist"          [S] int64: count of samples with staleness s at index s; S = max s + 1
                                  (0 samples: S = 0), or S = ``bins`` with the last bin counting s >= bins - 1
                                  (a fixed length, to sum histograms over controllers)
        "staleness_mean"          0-d: mean s over the samples
        "staleness_max"           0-d int64: max s (0 with no sample)
        "distinct_versions_mean"  0-d: mean over the samples of the number of distinct versions among its tokens
        "samples"                 0-d int64: samples counted

    Raises `ValueError` for a version newer than ``trainer_version`` (a token from the future), for non-integer
    versions, or for ``bins`` < 1.
    """
    _check_versions(versions_per_token, trainer_version, mask, bins)
    m = mask.bool()
    versions = versions_per_token.to(torch.int64)
    has_token = m.any(dim=1)
    big = torch.iinfo(torch.int64).max
    # ascending per row, the mask-0 positions (filled with `big`) last
    ordered = versions.masked_fill(~m, big).sort(dim=1).values
    oldest = ordered[:, 0][has_token]
    staleness = trainer_version - oldest
    real = m.sum(dim=1)
    position = torch.arange(versions.shape[1], device=versions.device)
    changes = (ordered[:, 1:] != ordered[:, :-1]) & (position[1:] < real.unsqueeze(1))
    distinct = (changes.sum(dim=1) + 1)[has_token]
    samples = int(has_token.sum())
    if bins is None:
        hist = torch.bincount(staleness) if samples else staleness.new_zeros(0)
    else:
        hist = torch.bincount(staleness.clamp_max(bins - 1), minlength=bins)
    denom = max(samples, 1)
    return {
        "staleness_hist": hist.to(torch.int64),
        "staleness_mean": staleness.sum().to(torch.float32) / denom,
        "staleness_max": staleness.max() if samples else staleness.new_zeros(()),
        "distinct_versions_mean": distinct.sum().to(torch.float32) / denom,
        "samples": torch.tensor(samples, dtype=torch.int64),
    }


def _check_versions(versions_per_token: Tensor, trainer_version: int, mask: Tensor, bins: int | None) -> None:
    """`staleness_stats`' checks of its arguments (ValueError naming the one at fault)."""
    if versions_per_token.dim() != 2 or versions_per_token.shape != mask.shape:
        raise ValueError(
            f"versions_per_token and mask must share one shape [B, T], got {tuple(versions_per_token.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if versions_per_token.dtype.is_floating_point or versions_per_token.dtype == torch.bool:
        raise ValueError(f"versions_per_token must be an integer tensor, got {versions_per_token.dtype}")
    if bins is not None and bins < 1:
        raise ValueError(f"bins must be >= 1 (or None: as many as the largest staleness needs), got {bins}")
    real = versions_per_token[mask.bool()].to(torch.int64)
    if bool((real > trainer_version).any()):
        raise ValueError(
            f"a token was generated by weight version {int(real.max())}, newer than "
            f"trainer_version={trainer_version}; pass the version being trained"
        )
