"""Per-token log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the vocabulary, [B, T, V/tp]. With m the global max,
S = sum_v exp(z_v - m) (summed over all ranks' slices) and log Z = m + log S:

    logp(y)  = z_y - log Z                      (z_y lives on exactly one rank; the others add 0)
    entropy  = log Z - sum_v p_v z_v  = log S - sum_v exp(z_v - m) (z_v - m) / S

Only [B, T] tensors cross ranks (the max, then S, the target logit and the p*z sum in one all-reduce). The
loss built on top is computed identically on every TP rank, so each rank back-propagates d(loss)/d(own slice)
once, and the backward needs no collective: with p_v = exp(z_v - m) / S and E = sum_v p_v (z_v - m),

    d logp(y) / d z_v = [v = y] - p_v          d entropy / d z_v = -p_v (z_v - m - E)

No [B, T, V] float32 tensor is made: the logits are read in chunks of rows (`CHUNK_ELEMENTS` values each on
a CPU, `CUDA_CHUNK_ELEMENTS` on a GPU; upcast to float32 one chunk at a time) in the forward, and again in the
backward, which recomputes p per chunk from the saved m, S and E ([B, T] each). Peak extra memory is a few
chunks, whatever the vocabulary (at 4 x 1024 tokens x 151,936 the float32 copy alone was 2.5 GB); the saved
tensor is the logits themselves. A CPU chunk fits in cache (16 MiB); a GPU's is 16x larger, since each chunk
costs ~20 kernel launches: at the CPU's size a 4,096-token micro-batch over 151,936 ids is 152 chunks, ~3,300
launches forward and backward, each on too little data to keep a GPU busy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 22  # float32 values of one chunk of rows on a CPU (16 MiB)
CUDA_CHUNK_ELEMENTS = 1 << 26  # on a GPU (256 MiB): 10 chunks for 4,096 tokens x 151,936 ids


def token_logprobs_and_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of `targets` and the entropy of the predictive distribution, per position.

    Args:
        logits_shard: [B, T, V/tp] this rank's vocabulary slice (rank r holds ids [r*V/tp, (r+1)*V/tp)), any
            float dtype.
        targets: [B, T] long token ids in [0, V).
        tp_group: the tensor-parallel process group; None (or a group of size 1) means the full vocabulary.
    Returns:
        (logp [B, T], entropy [B, T]) in float32, both differentiable w.r.t. `logits_shard`.
    """
    shape = targets.shape
    flat = logits_shard.reshape(-1, logits_shard.shape[-1])
    logp, entropy = _ChunkedLogProbs.apply(flat, targets.reshape(-1), tp_group)
    return logp.view(shape), entropy.view(shape)


def _tp_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def _chunks(logits: torch.Tensor) -> list[slice]:
    """Row slices of `logits` [N, V], each at most the device's chunk of values (one row at least)."""
    rows, vocab = logits.shape
    budget = CUDA_CHUNK_ELEMENTS if logits.is_cuda else CHUNK_ELEMENTS
    step = max(1, budget // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _ChunkedLogProbs(torch.autograd.Function):
    """logits [N, V/tp], targets [N] -> (logp [N], entropy [N]) float32; see the module docstring."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, tp_group):
        rows, vocab = logits.shape
        tp = _tp_size(tp_group)
        local = targets - (0 if tp == 1 else dist.get_rank(tp_group)) * vocab
        on_rank = (local >= 0) & (local < vocab)
        local = local.clamp(0, vocab - 1)
        m = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for c in _chunks(logits):
            m[c] = logits[c].amax(dim=-1).float()
        if tp > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        sums = torch.zeros(3, rows, dtype=torch.float32, device=logits.device)  # S, target - m, sum e (z - m)
        for c in _chunks(logits):
            shifted = logits[c].float() - m[c, None]
            exp = shifted.exp()
            sums[0, c] = exp.sum(dim=-1)
            sums[1, c] = torch.where(on_rank[c], shifted.gather(-1, local[c, None]).squeeze(-1), 0.0)
            sums[2, c] = (exp * shifted).sum(dim=-1)
        if tp > 1:
            dist.all_reduce(sums, group=tp_group)
        total, target, weighted = sums
        mean_shifted = weighted / total  # E
        logp = target - total.log()
        entropy = total.log() - mean_shifted
        ctx.save_for_backward(logits, local, on_rank, m, total, mean_shifted)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        logits, local, on_rank, m, total, mean_shifted = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for c in _chunks(logits):
            shifted = logits[c].float() - m[c, None]
            p = shifted.exp() / total[c, None]
            g = -p * (grad_logp[c, None] + grad_entropy[c, None] * (shifted - mean_shifted[c, None]))
            g.scatter_add_(-1, local[c, None], (grad_logp[c] * on_rank[c])[:, None])
            grad[c] = g.to(grad.dtype)
        return grad, None, None
