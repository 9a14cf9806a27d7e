"""Advantage estimators.

Outcome level: one scalar advantage per sampled response, from one scalar reward per response (and, for some
estimators, its group or a greedy baseline). Token level ("gae"): one advantage per response token, from
per-token rewards and a critic's values.

Layout convention: a batch of ``B = P * G`` responses holds ``G`` samples for each of ``P`` prompts, stored
prompt-major (sample ``g`` of prompt ``p`` is row ``p * G + g``), so ``rewards_flat.view(P, G)`` gives the
groups and ``advantages.reshape(-1)`` goes back. A prompt's whole group must live in one controller.

Registry entries are `AdvantageEstimator` descriptors (callable; ``.fn`` is the function below) whose flags
say what the controller must supply:

==========================  =====================  ==========================================================
name                        needs                  advantage
==========================  =====================  ==========================================================
"grpo"                      n >= 2                 (r - group mean) / (group std + eps)
"grpo_no_std"               n >= 2                 r - group mean  (Dr. GRPO)
"rloo"                      n >= 2                 r - mean of the *other* samples of the group
"reinforce_pp"              -                      r whitened over the batch (REINFORCE++)
"reinforce_pp_baseline"     n >= 2                 (r - group mean) whitened over the batch
"remax"                     greedy_rewards [P]     r - r(greedy response of the prompt)
"gae"                       critic values [B, T]   token-level GAE(gamma, lambda); see `gae_advantages`
==========================  =====================  ==========================================================

Std convention, everywhere in this module: the *unbiased* sample std (``correction=1``) with ``eps`` added to
the std (not inside the square root); a group (or batch) whose values are all equal gets advantages exactly 0.
"Batch" means the tensor passed in, i.e. the batch one controller holds; see the package docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from yatt_ray.algos.registry import ADVANTAGE_ESTIMATORS, AdvantageEstimator

__all__ = [
    "AdvantageEstimator",
    "broadcast_to_tokens",
    "estimate_advantages",
    "gae_advantages",
    "grpo_advantages",
    "grpo_no_std_advantages",
    "masked_whiten",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "token_rewards_from_outcome",
]

F = TypeVar("F", bound=Callable[..., Any])


def _register(
    name: str,
    *,
    needs_group: bool = False,
    needs_critic: bool = False,
    needs_greedy_baseline: bool = False,
    token_level: bool = False,
) -> Callable[[F], F]:
    """Register the decorated function as an `AdvantageEstimator` named ``name``; return it unchanged."""
    register = ADVANTAGE_ESTIMATORS.register(name)  # raises DuplicateNameError at once for a taken name

    def decorator(fn: F) -> F:
        register(
            AdvantageEstimator(
                name=name,
                fn=fn,
                needs_group=needs_group,
                needs_critic=needs_critic,
                needs_greedy_baseline=needs_greedy_baseline,
                token_level=token_level,
            )
        )
        return fn

    return decorator


def _check_group_rewards(rewards: Tensor, min_group: int = 2, min_batch: int = 1) -> Tensor:
    """Validate ``rewards`` [P, G] (G >= ``min_group``, P * G >= ``min_batch``, finite); return them as float.

    ``min_batch = 2`` is for estimators that take a std over the whole batch (the std of one value is
    undefined); estimators without batch statistics ("remax") keep the default 1.
    """
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor of shape [P, G], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must have shape [P, G] (prompts x samples per prompt), got shape {tuple(rewards.shape)}; "
            f"reshape a flat [P * G] tensor with rewards.view(-1, G)"
        )
    if rewards.shape[1] < min_group:
        if min_group < 2:
            raise ValueError(f"rewards need at least 1 sample per prompt, got shape {tuple(rewards.shape)}")
        raise ValueError(
            f"group-relative advantages need at least 2 samples per prompt, got G={rewards.shape[1]} "
            f"(every advantage would be 0); raise the number of samples per prompt to 2 or more"
        )
    if rewards.numel() < min_batch:
        raise ValueError(
            f"batch-whitened advantages need at least 2 rewards in the batch, got shape {tuple(rewards.shape)} "
            f"(the std of one value is undefined); pass more prompts or samples"
        )
    if not bool(torch.isfinite(rewards).all()):
        bad = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(
            f"rewards contain a non-finite value ({rewards[bad[0], bad[1]].item()} at [prompt {bad[0]}, "
            f"sample {bad[1]}]); check the reward function for NaN / inf outputs"
        )
    # Integers (0/1 rule rewards) and half precision are promoted to float32; float64 stays float64.
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32))


@_register("grpo", needs_group=True)
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
    return _zero_where_all_equal(r, adv, dim=1)


def _zero_where_all_equal(values: Tensor, adv: Tensor, dim: int | None) -> Tensor:
    """``adv`` with exact zeros wherever ``values`` are all equal along ``dim`` (``None``: the whole tensor)."""
    if dim is None:
        return torch.zeros_like(adv) if bool((values == values.reshape(-1)[0]).all()) else adv
    all_equal = (values == values.narrow(dim, 0, 1)).all(dim=dim, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(adv), adv)


@_register("grpo_no_std", needs_group=True)
def grpo_no_std_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Mean-only group advantages (Dr. GRPO): ``A[p, g] = r[p, g] - mean_g r[p, :]``, shapes [P, G] -> [P, G].

    Same as ``grpo_advantages(rewards, normalize_std=False)``; ``eps`` is accepted (and unused) so that
    every registered estimator takes the same arguments. Equal-reward groups give exactly 0.
    """
    del eps
    return grpo_advantages(rewards, normalize_std=False)


@_register("rloo", needs_group=True)
def rloo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    r"""REINFORCE leave-one-out advantages (RLOO; Kool et al. 2019, Ahmadian et al. 2024).

    Shapes: ``rewards`` [P, G] (G >= 2) -> [P, G]. Each sample's baseline is the mean reward of the *other*
    G - 1 samples of its group, so the baseline does not depend on the sample itself (unbiased)::

        A[p, g] = r[p, g] - (sum_j r[p, j] - r[p, g]) / (G - 1)
                = G / (G - 1) * (r[p, g] - mean_p)

    No std scaling, no ``eps`` (accepted and unused, so every estimator takes the same arguments). Computed in
    float32 (float64 stays float64); equal-reward groups give exactly 0; G = 1 raises (no other sample).
    """
    del eps
    r = _check_group_rewards(rewards)
    g = r.shape[1]
    adv = r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)
    return _zero_where_all_equal(r, adv, dim=1)


def _whiten_all(x: Tensor, eps: float) -> Tensor:
    """``(x - mean(x)) / (std(x) + eps)`` over every element; unbiased std; all-equal -> exact 0."""
    adv = (x - x.mean()) / (x.std(correction=1) + eps)
    return _zero_where_all_equal(x, adv, dim=None)


@_register("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    r"""REINFORCE++ outcome advantages without a group baseline (Hu 2025): rewards whitened over the batch.

    Shapes: ``rewards`` [P, G] (any G >= 1; P * G >= 2) -> [P, G]. With ``N = P * G`` and all samples ``i``::

        mean = (1 / N) * sum_i r_i
        std  = sqrt( sum_i (r_i - mean)^2 / (N - 1) )        # unbiased, over the whole batch
        A_i  = (r_i - mean) / (std + eps)                     # eps = 1e-6, added to the std

    The statistics are those of the tensor passed in (one controller's batch). A batch whose rewards are all
    equal gives exactly 0. With a per-token KL penalty in the reward (the REINFORCE++ paper's setting) build
    token rewards with `token_rewards_from_outcome`, accumulate them (`gae_advantages` with gamma = lam = 1
    and zero values gives the reward-to-go) and whiten with `masked_whiten` instead.
    """
    return _whiten_all(_check_group_rewards(rewards, min_group=1, min_batch=2), eps)


@_register("reinforce_pp_baseline", needs_group=True)
def reinforce_pp_baseline_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    r"""REINFORCE++ with a group baseline: subtract each group's mean, then whiten over the whole batch.

    Shapes: ``rewards`` [P, G] (G >= 2) -> [P, G]::

        c[p, g] = r[p, g] - mean_g r[p, :]
        A[p, g] = (c[p, g] - mean(c)) / (std(c) + eps)       # mean / unbiased std over all P * G values

    (``mean(c)`` is 0 up to rounding; it is subtracted anyway.) Unlike "grpo", the scale is one batch-wide std,
    so a group with little reward spread is not blown up to unit scale. All-equal ``c`` (every group
    constant) gives exactly 0.
    """
    r = _check_group_rewards(rewards)
    centred = _zero_where_all_equal(r, r - r.mean(dim=1, keepdim=True), dim=1)
    return _whiten_all(centred, eps)


@_register("remax", needs_greedy_baseline=True)
def remax_advantages(rewards: Tensor, greedy_rewards: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    r"""ReMax advantages (Li et al. 2024): the reward of the prompt's greedy response is the baseline.

    Shapes: ``rewards`` [P, G] (any P >= 1, G >= 1), ``greedy_rewards`` [P] (the reward of one greedy,
    temperature-0 response per prompt, decoded by the controller and scored like the samples) -> [P, G]::

        A[p, g] = r[p, g] - greedy_rewards[p]

    No group or batch statistic (no mean, no std, no whitening), no scaling and no ``eps`` (accepted and
    unused), as in the ReMax paper: each advantage depends only on its own reward and its prompt's greedy
    reward, so any batch size works, a single response included (``[[1.0]]`` with greedy ``[0.5]`` -> ``[[0.5]]``).
    The greedy responses are only a baseline: they are not trained on. Raises `ValueError` if
    ``greedy_rewards`` is missing, mis-shaped or not finite.
    """
    del eps
    r = _check_group_rewards(rewards, min_group=1)
    if greedy_rewards is None:
        raise ValueError(
            "remax needs greedy_rewards [P]: the reward of one greedy (temperature 0) response per prompt; the "
            "controller must decode and score it, or pick another estimator (e.g. 'rloo')"
        )
    if greedy_rewards.shape != (r.shape[0],):
        raise ValueError(
            f"greedy_rewards must have shape [P] = ({r.shape[0]},), one per prompt, got "
            f"{tuple(greedy_rewards.shape)}"
        )
    if not bool(torch.isfinite(greedy_rewards).all()):
        raise ValueError("greedy_rewards contain a non-finite value; check the reward function")
    return r - greedy_rewards.to(r.dtype).unsqueeze(1)


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _check_token_shapes(**named: Tensor) -> tuple[int, int]:
    shapes = {k: tuple(v.shape) for k, v in named.items()}
    first = next(iter(named.values()))
    if first.dim() != 2 or any(v.shape != first.shape for v in named.values()):
        raise ValueError(f"{', '.join(named)} must share one shape [B, T], got {shapes}")
    return first.shape[0], first.shape[1]


@_register("gae", needs_critic=True, token_level=True)
def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    r"""Generalised advantage estimation (Schulman et al. 2016) over response tokens.

    Shapes: ``token_rewards``, ``values`` (the critic's V(s_t) for each response token) and ``response_mask``
    (bool or 0/1; 1 = a generated token the loss sees) are [B, T] -> ``(advantages [B, T], returns [B, T])``.

    Recursion, from the last token backwards, over the *real* (mask-1) tokens of each row::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        return_t = A_t + V_t                  # the critic's regression target

    where ``V_next`` / ``A_next`` belong to the next real token of the row and are 0 after the row's last
    real token (the episode ends with the response: V beyond it is 0). Masked positions are skipped as if
    absent: their rewards and values are ignored, they do not advance the discount, and their advantage and
    return are exactly 0. That covers right padding and also holes, e.g. tool or environment tokens of a
    multi-turn rollout that the policy did not generate. With ``gamma = lam = 1`` and zero values, ``A_t`` is
    the reward-to-go ``sum_{k >= t} r_k``.

    Implementation: a reverse scan over T vectorised across B (T steps of [B]-sized operations), run under
    ``torch.no_grad`` (advantages and returns are data). Computed in at least float32. To whiten the
    advantages over the batch's tokens (PPO's usual step) call ``masked_whiten(advantages, response_mask)``
    afterwards; whiten the advantages only, never the returns.
    """
    _check_token_shapes(token_rewards=token_rewards, values=values, response_mask=response_mask)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(
            f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}; LLM PPO uses gamma=1"
        )
    dtype = _float_dtype(token_rewards, values)
    with torch.no_grad():
        mask = response_mask.bool()
        val = values.to(dtype)
        # time-major copies, so that each step of the scan reads and writes contiguous [B] rows
        mask_tm = mask.t().contiguous()
        rew_tm = token_rewards.to(dtype).t().contiguous()
        val_tm = val.t().contiguous()
        width, batch = rew_tm.shape
        adv_tm = torch.empty(width, batch, dtype=dtype, device=rew_tm.device)
        next_value = torch.zeros(batch, dtype=dtype, device=rew_tm.device)
        next_adv = torch.zeros(batch, dtype=dtype, device=rew_tm.device)
        for t in range(width - 1, -1, -1):
            m = mask_tm[t]
            a_t = rew_tm[t] + gamma * next_value - val_tm[t] + (gamma * lam) * next_adv
            next_adv = torch.where(m, a_t, next_adv)
            next_value = torch.where(m, val_tm[t], next_value)
            adv_tm[t] = torch.where(m, a_t, 0.0)
        adv = adv_tm.t().contiguous()
        returns = torch.where(mask, adv + val, 0.0)
    return adv, returns


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    shift_mean: bool = True,
    eps: float = 1e-6,
    all_reduce: Callable[[Tensor], None] | None = None,
) -> Tensor:
    r"""Whiten ``x`` over its mask-1 elements: ``(x - mean) / (std + eps)``; shapes [B, T] -> [B, T].

    ``mean`` and ``std`` are taken over the ``N = mask.sum()`` selected elements of the whole tensor (every
    row together, so a long response weighs more than a short one); std is *unbiased* (divides by N - 1),
    ``eps`` = 1e-6 is added to the std. With ``shift_mean=False`` the mean is added back,
    ``(x - mean) / (std + eps) + mean``: the spread is normalised but the sign and offset are kept (the usual
    choice for rewards, as opposed to advantages). Masked positions are exactly 0. If all selected values are
    equal the centred part is exactly 0. Raises `ValueError` for N < 2. Statistics are computed in float64
    in two passes (mean, then squared deviations); the result is in at least float32, and not detached (call
    it on data, or under ``torch.no_grad``).

    ``all_reduce``, when given, sums a float64 tensor in place across data-parallel ranks (e.g.
    ``lambda t: dist.all_reduce(t, group=dp_group)``): the statistics then cover every rank's elements, so
    the result does not depend on how the batch is split. Every rank must call it.
    """
    _check_token_shapes(x=x, mask=mask)
    m = mask.bool()
    sel = x[m].to(torch.float64)
    reduce = all_reduce or (lambda t: None)
    totals = torch.stack([sel.sum(), torch.tensor(float(sel.numel()), dtype=torch.float64)])
    reduce(totals)
    total, n = totals.tolist()
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 selected elements, got {int(n)}; check the mask")
    mean = total / n
    spread = torch.stack([((sel - mean) ** 2).sum(), (sel != mean).sum().to(torch.float64)])
    reduce(spread)
    squares, differing = spread.tolist()
    xf = x.to(_float_dtype(x))
    if differing == 0:  # all selected values equal
        centred = torch.zeros_like(xf)
    else:
        centred = (xf - mean) / ((squares / (n - 1)) ** 0.5 + eps)
    out = centred + mean if not shift_mean else centred
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def token_rewards_from_outcome(
    seq_rewards: Tensor, response_mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    r"""Per-token rewards from one outcome reward per response, with an optional KL-as-reward penalty.

    Shapes: ``seq_rewards`` [B], ``response_mask`` [B, T], ``kl`` [B, T] or None -> token rewards [B, T]::

        out[b, t] = seq_rewards[b] * [t == last real token of row b]  -  kl_coef * kl[b, t]     (mask-1 t)
        out[b, t] = 0                                                                          (mask-0 t)

    The "last real token" is the largest t with ``response_mask[b, t] = 1``. ``kl`` is a per-token estimate of
    KL(pi || ref) (e.g. ``kl_estimate(old_logp, ref_logp, "k1")``); it is detached here, because a reward is
    data (the penalty shapes the return that the critic or the reward-to-go sees, it is not differentiated).
    This is where PPO (Ziegler et al. 2019; Ouyang et al. 2022) and REINFORCE++ put the KL term; the
    alternative is a KL term in the loss. Computed in at least float32. Raises `ValueError` for a row with no
    mask-1 token (an outcome reward would have nowhere to go).
    """
    batch, width = _check_token_shapes(response_mask=response_mask)
    if seq_rewards.shape != (batch,):
        raise ValueError(f"seq_rewards must have shape [B] = ({batch},), got {tuple(seq_rewards.shape)}")
    mask = response_mask.bool()
    has_token = mask.any(dim=1)
    if not bool(has_token.all()):
        row = int((~has_token).nonzero()[0, 0])
        raise ValueError(
            f"response {row} has no response token (mask row all 0); its outcome reward cannot be placed; drop "
            f"empty responses before building token rewards"
        )
    dtype = _float_dtype(seq_rewards, *([kl] if kl is not None else []))
    # index of the last mask-1 token: argmax finds the first 1 of the flipped row
    last = width - 1 - mask.flip(1).to(torch.uint8).argmax(dim=1)
    out = torch.zeros(batch, width, dtype=dtype, device=seq_rewards.device)
    out[torch.arange(batch, device=out.device), last] = seq_rewards.detach().to(dtype)
    if kl is not None:
        if kl.shape != response_mask.shape:
            raise ValueError(
                f"kl must have shape [B, T] = {tuple(response_mask.shape)}, got {tuple(kl.shape)}"
            )
        out = out - kl_coef * torch.where(mask, kl.detach().to(dtype), 0.0)
    return out


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


def estimate_advantages(
    estimator: AdvantageEstimator,
    rewards: Tensor,
    response_mask: Tensor,
    *,
    group_size: int,
    values: Tensor | None = None,
    greedy_rewards: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    r"""Any registered estimator through one signature: per-token advantages [N, R] and returns [N, R] (GAE)
    or None.

    Shapes: ``rewards`` [N] (one outcome reward per response, a prompt's ``group_size`` samples adjacent),
    ``response_mask`` [N, R], ``values`` [N, R] (token-level estimators), ``greedy_rewards`` [N / group_size]
    (ReMax), ``kl`` [N, R]: a per-token KL estimate used as a reward penalty with ``kl_coef`` (None: none).

    * token level (GAE): token rewards ``r_t = R * [t = last] - kl_coef * KL_t``, then ``fn(r, values, mask,
      gamma, lam)``; the advantages are returned unwhitened (the caller whitens over every group);
    * outcome level: ``R' = R - kl_coef * sum_t KL_t``, reshaped to groups [N / group_size, group_size],
      ``fn(groups)`` (ReMax: ``fn(groups, greedy_rewards)``), broadcast over each response's tokens.
    """
    if estimator.token_level:
        token_rewards = token_rewards_from_outcome(rewards, response_mask, kl, kl_coef)
        if values is None:
            raise ValueError(f"advantage estimator {estimator.name!r} needs the critic's values [N, R]")
        return estimator.fn(token_rewards, values, response_mask, gamma, lam)
    if kl is not None:
        rewards = rewards - kl_coef * (kl * response_mask).sum(-1)
    groups = rewards.reshape(-1, group_size)
    if estimator.needs_greedy_baseline:
        seq_adv = estimator.fn(groups, greedy_rewards)
    else:
        seq_adv = estimator.fn(groups)
    return broadcast_to_tokens(seq_adv.reshape(-1), response_mask), None
