"""Reduce a per-token loss [B, T] to the scalar that is back-propagated.

THE convention (every aggregation follows it): the value returned for one micro-batch is that micro-batch's
*share* of the full-batch loss, so that

    sum over data-parallel ranks r, sum over micro-batches m of aggregate(loss[r, m], mask[r, m], ...)
        == aggregate(loss of the whole global batch, its mask, ...)

both in value and in gradient. The trainer therefore passes the denominators counted over the *whole* global
batch (all micro-batches of all data-parallel ranks; one all-reduce per step), calls ``backward()`` on each
micro-batch's result without dividing by the number of micro-batches, and reduces gradients across ranks by
*sum*. If the gradient all-reduce averages over N ranks instead (the default of PyTorch DDP and Megatron
DDP), multiply each micro-batch's result by N before ``backward()``. The sum-of-shares form is what keeps long
and short responses weighted the same whether they share a micro-batch or not; averaging per-micro-batch means
would weight a token by 1 / (tokens in its micro-batch).

Every registered aggregation has the signature
``fn(per_token, mask, *, global_tokens=None, global_seqs=None) -> scalar Tensor``, so the sequence-level modes
("seq-mean-token-sum", "seq-mean-token-mean": a per-sequence reduction, then ``sum / global_seqs``) can be
added beside "token-mean" without changing callers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import LOSS_AGGREGATIONS

__all__ = ["aggregate", "token_mean"]


def _masked(per_token: Tensor, mask: Tensor) -> Tensor:
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"per_token and mask must share one shape [B, T], got {tuple(per_token.shape)} and "
            f"{tuple(mask.shape)}"
        )
    # torch.where, not a product, so that inf / NaN at padding positions (e.g. a pad token's log-prob) cannot
    # leak into the loss: 0 * inf would be NaN.
    return torch.where(
        mask.bool(), per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    )


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> Tensor:
    """``sum_{b,t} per_token[b, t] * mask[b, t] / global_tokens``: every response token of the global batch
    weighs the same.

    Shapes: ``per_token`` [B, T], ``mask`` [B, T] (bool or 0/1 numbers; 1 = a token the loss sees) -> scalar.
    ``global_tokens`` is the number of mask-1 tokens in the whole global batch (all micro-batches, all
    data-parallel ranks); it defaults to ``mask.sum()``, which is right only when this call sees the whole
    batch. A default count of 0 (everything masked) gives 0, not NaN; an explicit count must be > 0.
    ``global_seqs`` is ignored (accepted so that every aggregation shares one signature).
    """
    del global_seqs
    total = _masked(per_token, mask).sum()
    if global_tokens is None:
        return total / mask.sum().clamp_min(1).to(total.dtype)
    if not global_tokens > 0:
        raise ValueError(
            f"global_tokens must be > 0 (the number of response tokens in the whole global batch), got "
            f"{global_tokens}; pass the all-reduced sum of mask.sum() over micro-batches and ranks"
        )
    return total / global_tokens


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> Tensor:
    """Reduce ``per_token`` [B, T] under ``mask`` [B, T] to a scalar with the registered ``mode``.

    Modes: "token-mean" (see `token_mean`). The result is this call's share of the global-batch loss (see
    the module docstring for the convention and the denominators the trainer must pass). Raises
    `UnknownNameError` listing the valid modes for any other name.
    """
    return LOSS_AGGREGATIONS.get(mode)(per_token, mask, global_tokens=global_tokens, global_seqs=global_seqs)
