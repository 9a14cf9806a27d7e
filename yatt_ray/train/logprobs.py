"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary, [B, T, V/tp]. With m the global max,
S = sum_v exp(z_v - m) (summed over all ranks' slices) and log Z = m + log S:

    logp(y)  = z_y - log Z                      (z_y lives on exactly one rank; the others add 0)
    entropy  = log Z - sum_v p_v z_v  = log S - sum_v exp(z_v - m) (z_v - m) / S

Only three [B, T] tensors cross ranks (max, S, and the target logit / the p*z sum). The collectives are
autograd-aware with the tensor-parallel convention: forward all-reduce, backward identity. The loss built on
top is computed identically on every TP rank, so each rank back-propagates d(loss)/d(own slice) once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group` in forward; pass the gradient through unchanged in backward (replicated consumers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tp_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def _sum(x: torch.Tensor, tp_group) -> torch.Tensor:
    return x if _tp_size(tp_group) == 1 else _AllReduceSum.apply(x, tp_group)


def token_logprobs_and_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` and the entropy of the predictive distribution, per position.

    Args:
        logits_shard: [B, T, V/tp] this rank's vocabulary slice (rank r holds ids [r*V/tp, (r+1)*V/tp)).
        targets: [B, T] long token ids in [0, V).
        tp_group: the tensor-parallel process group; None (or a group of size 1) means the full vocabulary.
    Returns:
        (logp [B, T], entropy [B, T]) in float32, both differentiable w.r.t. `logits_shard`.
    """
    z = logits_shard.float()
    local_vocab = z.shape[-1]
    rank = 0 if _tp_size(tp_group) == 1 else dist.get_rank(tp_group)

    # The max only stabilises exp(); log-softmax does not depend on it, so no gradient flows through it.
    m = z.detach().amax(dim=-1)
    if _tp_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - m.unsqueeze(-1)  # [B, T, V/tp], <= 0
    exp = shifted.exp()
    sum_exp = _sum(exp.sum(dim=-1), tp_group)  # S [B, T]
    log_sum_exp = sum_exp.log()

    local_ids = targets - rank * local_vocab
    on_rank = (local_ids >= 0) & (local_ids < local_vocab)
    picked = shifted.gather(-1, local_ids.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
    target_shifted = _sum(torch.where(on_rank, picked, torch.zeros_like(picked)), tp_group)

    logp = target_shifted - log_sum_exp
    entropy = log_sum_exp - _sum((exp * shifted).sum(dim=-1), tp_group) / sum_exp
    return logp, entropy
