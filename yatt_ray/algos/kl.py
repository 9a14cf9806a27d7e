"""Per-token estimators of KL(pi || ref) from tokens sampled from pi (J. Schulman, "Approximating KL
divergence", 2020).

With ``logp = log pi(x_t)`` and ``ref_logp = log ref(x_t)`` for sampled tokens ``x_t ~ pi`` and the log-ratio
``d = ref_logp - logp = log(ref / pi)``::

    k1 = -d                    = logp - ref_logp            unbiased, high variance, can be negative
    k2 = d^2 / 2               = 0.5 * (logp - ref_logp)^2  biased (low bias when pi ~ ref), always >= 0
    k3 = exp(d) - d - 1                                     unbiased, low variance, always >= 0
    low_var_kl = clamp(k3, -10, 10)                         k3 bounded (the name some frameworks use)

All take and return [B, T] tensors (any equal shapes work) and are computed in at least float32 (bf16 / fp16
inputs are promoted). Padding positions are not masked here; the loss aggregation masks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import KL_ESTIMATORS

__all__ = [
    "K3_LOG_RATIO_CLAMP",
    "LOW_VAR_KL_CLAMP",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_low_var",
]

K3_LOG_RATIO_CLAMP = 20.0
"""k3 clamps ``d = ref_logp - logp`` to [-20, 20] before ``exp`` (``exp(20) ~ 4.9e8`` is finite in fp32)."""


def _log_ratio(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """``ref_logp - logp`` in at least float32, after a shape check."""
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"logp and ref_logp must have the same shape [B, T], got {tuple(logp.shape)} and "
            f"{tuple(ref_logp.shape)}"
        )
    dtype = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    return ref_logp.to(dtype) - logp.to(dtype)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = logp - ref_logp, shape [B, T]. No clamp (no exp, cannot overflow). Its per-token values can be
    negative; only its expectation under pi is KL(pi || ref)."""
    return -_log_ratio(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2, shape [B, T]. No clamp. Always >= 0."""
    return 0.5 * _log_ratio(logp, ref_logp).square()


_K3_SERIES_BELOW = 0.5
"""Below this |d|, k3 is evaluated by its Taylor series instead of ``expm1(d) - d``."""


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 with d = ref_logp - logp, shape [B, T]. Always >= 0 (since e^d >= 1 + d).

    Numerical convention:

    * ``d`` is clamped to [-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP] = [-20, 20] before the exponential, so the
      value is at most ``exp(20) - 21`` and its gradient is 0 outside the clamp range.
    * For |d| < 0.5 it is evaluated as the Taylor series ``d^2/2 + d^3/6 + ... + d^7/5040`` (truncation error
      below 1e-6 relative), because ``exp(d) - d - 1`` (and even ``expm1(d) - d``) cancels catastrophically:
      in float32 at d = 1e-5 the direct form is wrong by 100% or more. Elsewhere it is ``expm1(d) - d``. So
      the logged KL stays accurate (about 1e-6 relative) when the policy is close to the reference.
    * The result is clamped at 0, so ``k3 >= 0`` holds exactly in floating point.
    """
    d = _log_ratio(logp, ref_logp).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    small = d.abs() < _K3_SERIES_BELOW
    d_small = torch.where(small, d, torch.zeros_like(d))  # keeps the unused branch of the series finite
    series = d_small.square() * (
        1 / 2
        + d_small * (1 / 6 + d_small * (1 / 24 + d_small * (1 / 120 + d_small * (1 / 720 + d_small / 5040))))
    )
    direct = torch.expm1(d) - d
    return torch.where(small, series, direct).clamp_min(0.0)


LOW_VAR_KL_CLAMP = 10.0
"""``low_var_kl`` clamps the k3 value to [-10, 10]."""


@KL_ESTIMATORS.register("low_var_kl")
def kl_low_var(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 clamped to [-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP] = [-10, 10], shape [B, T].

    Why: k3 = exp(d) - d - 1 grows exponentially in ``d = ref_logp - logp``, i.e. on a token that the policy
    has made much *less* likely than the reference does (k3 = 10 already at d ~ 2.6; up to exp(20) ~ 5e8 at
    the log-ratio clamp). One such token can then dominate the KL term of a whole batch, in value and in
    gradient. Capping the per-token value at 10 bounds that: beyond the cap the token contributes a constant
    10 and no gradient. (k3 >= 0, so only the upper bound acts; the lower bound keeps the name's usual
    definition.) The "low variance" in the name refers to k3 itself; other frameworks (verl, for one) use the
    same name for the same clamped k3. Inside the cap it equals `kl_k3` exactly, including its series form
    near 0.
    """
    return kl_k3(logp, ref_logp).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || ref) estimate of the registered ``kind`` ("k1", "k2", "k3" or "low_var_kl"), [B, T].

    Raises `UnknownNameError` listing the valid kinds for any other name. See `kl_k1`, `kl_k2`, `kl_k3`,
    `kl_low_var` for the formulas and clamps.
    """
    return KL_ESTIMATORS.get(kind)(logp, ref_logp)


class FixedKLController:
    """A constant KL coefficient: ``.value`` is ``coef`` forever; ``update`` does nothing.

    Same interface as `AdaptiveKLController`, so a trainer can hold either.
    """

    def __init__(self, coef: float) -> None:
        if not coef >= 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}; 0 disables the KL term")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient is fixed); the arguments are accepted for a uniform call."""
        del current_kl, n_steps

    def __repr__(self) -> str:
        return f"FixedKLController(coef={self.value})"


class AdaptiveKLController:
    r"""The proportional KL controller of Ziegler et al. 2019 ("Fine-tuning language models from human
    preferences", section 2.2), which steers the measured KL towards ``target``.

    After each step, with ``current_kl`` the measured KL(pi || ref) (per sequence, summed over its tokens, in
    the paper) and ``n_steps`` the number of samples the step trained on::

        error  = clip(current_kl / target - 1, -0.2, 0.2)
        value <- value * (1 + error * n_steps / horizon)

    so the coefficient grows while the KL is above target and shrinks below it, by at most 20% per
    ``horizon`` samples (the paper uses horizon = 10,000). ``target`` and ``current_kl`` must be in the same
    unit (per-sequence sum or per-token mean; pick one). ``value`` stays >= 0 (the factor is floored at 0, which
    only acts if ``n_steps > 5 * horizon``), and 0 stays 0.
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if not init_coef >= 0:
            raise ValueError(f"init_coef must be >= 0, got {init_coef}")
        if not target > 0:
            raise ValueError(f"target must be > 0 (the KL to steer towards), got {target}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0 (samples per 20% change), got {horizon}; e.g. 10000")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` by the proportional rule above; ``n_steps`` >= 0 samples since the last update."""
        if n_steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(float(current_kl) / self.target - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= max(1.0 + error * n_steps / self.horizon, 0.0)

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"
