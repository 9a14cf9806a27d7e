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
``fn(per_token, mask, *, global_tokens=None, global_seqs=None, norm_len=None) -> scalar Tensor`` (each mode
ignores the denominators it does not use). The denominators, counted over the whole global batch:

* ``global_tokens``: mask-1 tokens, ``sum(mask)``;
* ``global_seqs``: sequences with at least one mask-1 token, ``sum(mask.sum(1) > 0)`` (all-masked rows, e.g.
  padding rows that even out micro-batches, do not count);
* ``norm_len``: a constant length, the same for every micro-batch (e.g. the configured maximum response length).

=========================  ======================================================  ==========================
mode                       global-batch value                                      a sequence i weighs
=========================  ======================================================  ==========================
"token-mean"               sum_{i,t} l[i,t] / global_tokens                        |y_i| / global_tokens
"seq-mean-token-sum"       sum_i (sum_t l[i,t]) / global_seqs                      |y_i| / global_seqs
"seq-mean-token-mean"      sum_i (sum_t l[i,t] / |y_i|) / global_seqs              1 / global_seqs
"seq-mean-token-sum-norm"  sum_{i,t} l[i,t] / (global_seqs * norm_len)             |y_i| / (global_seqs * L)
=========================  ======================================================  ==========================

(sums over mask-1 tokens; ``|y_i|`` = mask-1 tokens of sequence i.) "seq-mean-token-mean" is the original GRPO
objective; it gives a short response's tokens more weight each, which Dr. GRPO (Liu et al. 2025) and DAPO
identify as a length bias. "token-mean" (DAPO) and "seq-mean-token-sum-norm" (Dr. GRPO: a constant
normaliser) weight every token alike; they differ only by a constant factor per batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from yatt_ray.algos.registry import LOSS_AGGREGATIONS

__all__ = [
    "aggregate",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]


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


def _positive(name: str, value: float, how: str) -> float:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 ({how}), got {value}")
    return value


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """``sum_{b,t} per_token[b, t] * mask[b, t] / global_tokens``: every response token of the global batch
    weighs the same.

    Shapes: ``per_token`` [B, T], ``mask`` [B, T] (bool or 0/1 numbers; 1 = a token the loss sees) -> scalar.
    ``global_tokens`` is the number of mask-1 tokens in the whole global batch (all micro-batches, all
    data-parallel ranks); it defaults to ``mask.sum()``, which is right only when this call sees the whole
    batch. A default count of 0 (everything masked) gives 0, not NaN; an explicit count must be > 0.
    ``global_seqs`` and ``norm_len`` are ignored (accepted so that every aggregation shares one signature).
    """
    del global_seqs, norm_len
    total = _masked(per_token, mask).sum()
    if global_tokens is None:
        return total / mask.sum().clamp_min(1).to(total.dtype)
    _positive(
        "global_tokens",
        global_tokens,
        "the number of response tokens in the whole global batch; pass the all-reduced sum of mask.sum() over "
        "micro-batches and ranks",
    )
    return total / global_tokens


def _seq_denominator(mask: Tensor, global_seqs: float | None, dtype: torch.dtype) -> Tensor | float:
    if global_seqs is None:  # right only when this call sees the whole batch
        return (mask.bool().any(dim=1)).sum().clamp_min(1).to(dtype)
    return _positive(
        "global_seqs",
        global_seqs,
        "the number of non-empty responses in the whole global batch; pass the all-reduced sum of "
        "(mask.sum(1) > 0).sum() over micro-batches and ranks",
    )


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(
    per_token: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """``sum_b (sum_t per_token[b, t] * mask[b, t]) / global_seqs``: the mean over sequences of each
    sequence's summed loss (a sequence weighs by its length).

    Shapes: [B, T], [B, T] -> scalar. ``global_seqs`` is the number of sequences with at least one mask-1
    token in the whole global batch; it defaults to this call's count (right only for the whole batch; an
    all-masked input then gives 0). An explicit count must be > 0. ``global_tokens``, ``norm_len`` ignored.
    """
    del global_tokens, norm_len
    total = _masked(per_token, mask).sum()
    return total / _seq_denominator(mask, global_seqs, total.dtype)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(
    per_token: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """``sum_b (sum_t per_token[b, t] * mask[b, t] / |y_b|) / global_seqs`` with ``|y_b| = sum_t mask[b, t]``:
    each sequence's mean token loss, averaged over sequences (every sequence weighs the same; original GRPO).

    Shapes: [B, T], [B, T] -> scalar. A row with no mask-1 token contributes 0 (its length is clamped to 1).
    ``global_seqs`` as in `seq_mean_token_sum`. A sequence must not be split across micro-batches (its
    per-sequence mean needs all its tokens), which the trainer's row-wise micro-batching guarantees.
    ``global_tokens``, ``norm_len`` ignored.
    """
    del global_tokens, norm_len
    masked = _masked(per_token, mask)
    lengths = mask.sum(dim=1).clamp_min(1).to(masked.dtype)
    per_seq = masked.sum(dim=1) / lengths
    return per_seq.sum() / _seq_denominator(mask, global_seqs, per_seq.dtype)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    per_token: Tensor,
    mask: Tensor,
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """``sum_{b,t} per_token[b, t] * mask[b, t] / (global_seqs * norm_len)``: Dr. GRPO's constant normaliser.

    Shapes: [B, T], [B, T] -> scalar. ``norm_len`` defaults to the mask width T. It must be *the same
    constant for every micro-batch and rank* of a step (and, for Dr. GRPO, of the run): with dynamically
    padded micro-batches T differs between them, so pass the configured maximum response length explicitly.
    ``global_seqs`` as in `seq_mean_token_sum`. ``global_tokens`` ignored.
    """
    del global_tokens
    total = _masked(per_token, mask).sum()
    length = _positive(
        "norm_len", mask.shape[1] if norm_len is None else norm_len, "e.g. the maximum response length"
    )
    return total / (_seq_denominator(mask, global_seqs, total.dtype) * length)


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Reduce ``per_token`` [B, T] under ``mask`` [B, T] to a scalar with the registered ``mode``.

    Modes: "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm" (see the
    module docstring and each function). The result is this call's share of the global-batch loss (see the
    module docstring for the convention and the denominators the trainer must pass). Raises
    `UnknownNameError` listing the valid modes for any other name.
    """
    fn = LOSS_AGGREGATIONS.get(mode)
    if norm_len is None:  # an aggregation registered elsewhere may not take norm_len
        return fn(per_token, mask, global_tokens=global_tokens, global_seqs=global_seqs)
    return fn(per_token, mask, global_tokens=global_tokens, global_seqs=global_seqs, norm_len=norm_len)
