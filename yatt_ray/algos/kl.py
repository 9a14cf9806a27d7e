"""Per-token estimators of KL(pi || ref) from tokens sampled from pi (J. Schulman, "Approximating KL
divergence", 2020).

With ``logp = log pi(x_t)`` and ``ref_logp = log ref(x_t)`` for sampled tokens ``x_t ~ pi`` and the log-ratio
``d = ref_logp - logp = log(ref / pi)``::

    k1 = -d                    = logp - ref_logp            unbiased, high variance, can be negative
    k2 = d^2 / 2               = 0.5 * (logp - ref_logp)^2  biased (low bias when pi ~ ref), always >= 0
    k3 = exp(d) - d - 1                                     unbiased, low variance, always >= 0

All take and return [B, T] tensors (any equal shapes work) and are computed in at least float32 (bf16 / fp16
inputs are promoted). Padding positions are not masked here; the loss aggregation masks them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import KL_ESTIMATORS

__all__ = ["K3_LOG_RATIO_CLAMP", "kl_estimate", "kl_k1", "kl_k2", "kl_k3"]

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


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL(pi || ref) estimate of the registered ``kind`` ("k1", "k2" or "k3"), shape [B, T].

    Raises `UnknownNameError` listing the valid kinds for any other name. See `kl_k1`, `kl_k2`, `kl_k3` for
    the formulas and clamps.
    """
    return KL_ESTIMATORS.get(kind)(logp, ref_logp)
