"""Advantage estimators: one scalar advantage per sampled response, from the rewards of its group.

Layout convention: a batch of ``B = P * G`` responses holds ``G`` samples for each of ``P`` prompts, stored
prompt-major (sample ``g`` of prompt ``p`` is row ``p * G + g``), so ``rewards_flat.view(P, G)`` gives the
groups and ``advantages.reshape(-1)`` goes back. A prompt's whole group must live in one controller.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import ADVANTAGE_ESTIMATORS

__all__ = ["broadcast_to_tokens", "grpo_advantages", "grpo_no_std_advantages"]


def _check_group_rewards(rewards: Tensor) -> Tensor:
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor of shape [P, G], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape [P, G] (prompts x samples per prompt), got shape {tuple(rewards.shape)}; "
            f"reshape a flat [P * G] tensor with rewards.view(-1, G)"
        )
    if rewards.shape[1] < 2:
        raise ValueError(
            f"group-relative advantages need at least 2 samples per prompt, got G={rewards.shape[1]} "
            f"(every advantage would be 0); raise the number of samples per prompt to 2 or more"
        )
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(
            f"rewards contain a non-finite value ({rewards[bad[0], bad[1]].item()} at [prompt {bad[0]}, "
            f"sample {bad[1]}]); check the reward function for NaN / inf outputs"
        )
    # Integers (0/1 rule rewards) and half precision are promoted to float32; float64 stays float64.
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32))


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: Tensor, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    r"""Group-relative advantages (GRPO, Shao et al. 2024, outcome supervision).

    Shapes: ``rewards`` [P, G] (P prompts, G >= 2 samples each) -> advantages [P, G].

    Formula, per group (row) ``p``::

        mean_p = (1 / G) * sum_g r[p, g]
        std_p  = sqrt( sum_g (r[p, g] - mean_p)^2 / (G - 1) )          # unbiased (Bessel), ddof = 1
        A[p, g] = (r[p, g] - mean_p) / (std_p + eps)    if normalize_std
        A[p, g] =  r[p, g] - mean_p                     otherwise (Dr. GRPO, Liu et al. 2025)

    Numerical convention:

    * std is the *unbiased* sample std (``torch.std``'s default, ``correction=1``). This is what the widely
      used open GRPO implementations compute, so published hyper-parameters carry over; the biased std
      would scale every advantage by ``sqrt(G / (G - 1))`` (1.15x at G=4).
    * ``eps`` is added to the std (not inside the square root), default 1e-6.
    * A group whose rewards are all equal gets advantage exactly 0 (it carries no learning signal), even where
      floating-point rounding of the mean would leave a residue of order 1e-16 / eps.
    * Computed in float32, or float64 if the rewards are float64; integer rewards are promoted. Rewards must
      be finite (raises `ValueError` otherwise); G = 1 raises, since every advantage would be 0.

    The result carries no gradient to anything that matters (rewards are data); it is not detached here.
    """
    r = _check_group_rewards(rewards)
    centred = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = centred / (r.std(dim=1, keepdim=True, correction=1) + eps)
    else:
        adv = centred
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(adv), adv)


@ADVANTAGE_ESTIMATORS.register("grpo_no_std")
def grpo_no_std_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Mean-only group advantages (Dr. GRPO): ``A[p, g] = r[p, g] - mean_g r[p, :]``, shapes [P, G] -> [P, G].

    Same as ``grpo_advantages(rewards, normalize_std=False)``; ``eps`` is accepted (and unused) so that
    every registered estimator takes the same arguments. Equal-reward groups give exactly 0.
    """
    del eps
    return grpo_advantages(rewards, normalize_std=False)


def broadcast_to_tokens(seq_adv: Tensor, response_mask: Tensor) -> Tensor:
    """Copy each sequence's advantage onto its response tokens: ``out[b, t] = seq_adv[b] * mask[b, t]``.

    Shapes: ``seq_adv`` [B], ``response_mask`` [B, T] (bool or 0/1 numbers; 1 = a generated token that the
    loss sees) -> [B, T] in ``seq_adv``'s dtype, exactly 0 at masked-out positions.
    """
    if seq_adv.dim() != 1:
        raise ValueError(
            f"seq_adv must have shape [B], got {tuple(seq_adv.shape)}; flatten [P, G] advantages with "
            f".reshape(-1)"
        )
    if response_mask.dim() != 2 or response_mask.shape[0] != seq_adv.shape[0]:
        raise ValueError(
            f"response_mask must have shape [B, T] with B = {seq_adv.shape[0]} (len(seq_adv)), "
            f"got {tuple(response_mask.shape)}"
        )
    expanded = seq_adv.unsqueeze(1).expand(-1, response_mask.shape[1])
    return torch.where(
        response_mask.bool(), expanded, torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device)
    )
