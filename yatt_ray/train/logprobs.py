"""Per-token log-probabilities and entropy from the last hidden states and the vocab-parallel output weight,
without materialising the logits.

Each tensor-parallel rank holds its slice of the output weight W [V/tp, H]; the logits of a position are
z = W h. With m the global max, S = sum_v exp(z_v - m) (summed over all ranks' slices) and log Z = m + log S:

    logp(y)  = z_y - log Z                      (z_y lives on exactly one rank; the others add 0)
    entropy  = log Z - sum_v p_v z_v  = log S - E,      E = sum_v p_v (z_v - m)

The vocabulary is walked in chunks of columns (`chunk_columns`: about `CHUNK_ELEMENTS` float32 values of
[N, chunk] on a CPU, `CUDA_CHUNK_ELEMENTS` on a GPU): each chunk's logits are one matmul, upcast to float32,
folded into running (m, S, E) with the online-softmax rescaling (a new max m' multiplies S by exp(m - m') and
turns sum e (z - m) into exp(m - m') (sum e (z - m) + (m - m') S)), then dropped. Only [N] tensors cross
ranks (the max, then S, the target logit and E in one all-reduce). The backward walks the chunks again,
recomputing each chunk's logits from the saved h and W and the saved m, S, E ([N] each):

    d logp(y) / d z_v = [v = y] - p_v          d entropy / d z_v = -p_v (z_v - m - E)
    dh = sum_chunks G_c W_c   (float32, all-reduced over the TP ranks)       dW_c = G_c^T h

so the peak extra memory is a few [N, chunk] float32 tensors and one [N, H] float32 accumulator, whatever the
vocabulary: at 16,384 tokens x 151,936 ids x hidden 1,536 the float32 logits and their gradient alone would
be ~19 GiB (`release/bench_gpu_ready.py` measures the peak). Each chunk costs ~15 kernel launches in the
forward and ~20 in the backward, so a GPU's chunk is 8x a CPU's (16 MiB, which stays in cache).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 22  # float32 values of one [N, chunk] block on a CPU (16 MiB)
CUDA_CHUNK_ELEMENTS = 1 << 25  # on a GPU (128 MiB): 75 chunks for 16,384 tokens x 151,936 ids


def head_logprobs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` and the entropy of the predictive distribution, per position.

    Args:
        hidden: [..., H] the last hidden states (after the final norm), any float dtype.
        weight: [V/tp, H] this rank's slice of the output weight (rank r holds ids [r*V/tp, (r+1)*V/tp)),
            the dtype of `hidden`.
        targets: [...] long token ids in [0, V).
        tp_group: the tensor-parallel process group; None (or a group of size 1) means the full vocabulary.
    Returns:
        (logp [...], entropy [...]) in float32, both differentiable w.r.t. `hidden` and `weight`.
    """
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _HeadLogProbs.apply(flat, weight, targets.reshape(-1), tp_group)
    return logp.view(shape), entropy.view(shape)


def _tp_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def chunk_columns(rows: int, vocab: int, cuda: bool) -> list[slice]:
    """Column slices of the [rows, vocab] logits, each at most the device's chunk of values (one column at
    least)."""
    budget = CUDA_CHUNK_ELEMENTS if cuda else CHUNK_ELEMENTS
    step = max(1, budget // max(rows, 1))
    return [slice(i, min(i + step, vocab)) for i in range(0, vocab, step)]


def _chunk_targets(local: torch.Tensor, on_rank: torch.Tensor, c: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [N, 1] into chunk `c`'s columns, whether the target is in the chunk [N])."""
    inside = on_rank & (local >= c.start) & (local < c.stop)
    return (local - c.start).clamp(0, c.stop - c.start - 1)[:, None], inside


class _HeadLogProbs(torch.autograd.Function):
    """hidden [N, H], weight [V/tp, H], targets [N] -> (logp [N], entropy [N]) float32; see the module
    docstring."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp_group):
        rows, vocab = hidden.shape[0], weight.shape[0]
        tp = _tp_size(tp_group)
        local = targets - (0 if tp == 1 else dist.get_rank(tp_group)) * vocab
        on_rank = (local >= 0) & (local < vocab)
        zeros = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
        m, total, weighted, target = zeros - torch.inf, zeros, zeros, zeros  # S, sum e (z - m), z_y
        for c in chunk_columns(rows, vocab, hidden.is_cuda):
            z = (hidden @ weight[c].T).float()  # [N, chunk]
            new_m = torch.maximum(m, z.amax(dim=-1))
            # the log of the rescale of what came before (0 before the first chunk)
            drop = torch.where(m > -torch.inf, m - new_m, 0.0)
            weighted = drop.exp() * (weighted + drop * total)
            total = drop.exp() * total
            shifted = z - new_m[:, None]
            exp = shifted.exp()
            total = total + exp.sum(dim=-1)
            weighted = weighted + (exp * shifted).sum(dim=-1)
            index, inside = _chunk_targets(local, on_rank, c)
            target = torch.where(inside, z.gather(-1, index).squeeze(-1), target)
            m = new_m
        if tp > 1:
            global_m = m.clone()
            dist.all_reduce(global_m, op=dist.ReduceOp.MAX, group=tp_group)
            drop = m - global_m
            sums = torch.stack(
                [
                    drop.exp() * total,
                    drop.exp() * (weighted + drop * total),
                    torch.where(on_rank, target, 0.0),
                ]
            )
            dist.all_reduce(sums, group=tp_group)
            m, (total, weighted, target) = global_m, sums
        target = target - m  # z_y - m
        mean_shifted = weighted / total  # E
        logp = target - total.log()
        entropy = total.log() - mean_shifted
        ctx.tp_group = tp_group
        ctx.save_for_backward(hidden, weight, local, on_rank, m, total, mean_shifted)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, weight, local, on_rank, m, total, mean_shifted = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        )
        grad_weight = torch.empty_like(weight) if need_weight else None
        for c in chunk_columns(hidden.shape[0], weight.shape[0], hidden.is_cuda):
            shifted = (hidden @ weight[c].T).float() - m[:, None]
            p = shifted.exp() / total[:, None]
            g = -p * (grad_logp[:, None] + grad_entropy[:, None] * (shifted - mean_shifted[:, None]))
            index, inside = _chunk_targets(local, on_rank, c)
            g.scatter_add_(-1, index, (grad_logp * inside)[:, None])
            g = g.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden += (g @ weight[c]).float()
            if grad_weight is not None:
                grad_weight[c] = g.T @ hidden
        if grad_hidden is not None:
            if _tp_size(ctx.tp_group) > 1:  # each rank's slice adds its part (the output layer's all-reduce)
                dist.all_reduce(grad_hidden, group=ctx.tp_group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None
