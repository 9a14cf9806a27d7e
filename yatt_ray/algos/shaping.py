"""Reward shaping applied before the advantage estimator: DAPO's overlong penalty.

A response cut at the length limit is scored like any other, so a truncated-but-lucky answer is rewarded and
a truncated correct line of reasoning is punished as if it were wrong: noise either way. DAPO (Yu et al.
2025, "soft overlong punishment") adds a length penalty that ramps up inside a buffer before the limit, so
the policy learns to finish in time without a cliff at the limit.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalty"]


def overlong_penalty(
    response_lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0
) -> Tensor:
    """DAPO's soft overlong punishment, to be *added* to the outcome reward; [N] -> [N] float32.

    ``response_lengths`` [N] integer: the generated tokens of each response (``response_mask.sum(-1)``);
    ``max_new_tokens`` = L_max, the generation limit; ``buffer`` = L_cache, the tokens before the limit over
    which the penalty ramps; ``penalty`` the factor (DAPO: 1)::

        R(|y|) = 0                                          |y| <= L_max - L_cache
        R(|y|) = penalty * ((L_max - L_cache) - |y|) / L_cache     L_max - L_cache < |y| <= L_max
        R(|y|) = -penalty                                   |y| > L_max

    so the penalty falls linearly from 0 at ``L_max - L_cache`` to ``-penalty`` at ``L_max`` (a response cut at
    the limit gets the whole penalty). ``buffer = 0`` turns it off: all zeros. Raises `ValueError` unless
    ``0 <= buffer < max_new_tokens`` and ``penalty >= 0``, or for a negative length.
    """
    if response_lengths.dim() != 1:
        raise ValueError(
            f"response_lengths must have shape [N], got {tuple(response_lengths.shape)}; take "
            f"response_mask.sum(-1)"
        )
    if not 0 <= buffer < max_new_tokens:
        raise ValueError(
            f"buffer={buffer} must be in [0, max_new_tokens={max_new_tokens}) (0 turns the overlong penalty off)"
        )
    if not penalty >= 0:
        raise ValueError(f"penalty={penalty} must be >= 0 (DAPO uses 1)")
    if bool((response_lengths < 0).any()):
        raise ValueError(f"response_lengths must be >= 0, got min {int(response_lengths.min())}")
    if buffer == 0:
        return torch.zeros(response_lengths.shape, dtype=torch.float32, device=response_lengths.device)
    threshold = max_new_tokens - buffer
    lengths = response_lengths.to(torch.float64)
    ramp = (threshold - lengths) / buffer * penalty
    return ramp.clamp(-penalty, 0.0).to(torch.float32)
