"""One causal attention call over many variable-length sequences laid end to end: `varlen_attention`.

Sequence i has n_q(i) queries (rows cu_q[i]:cu_q[i+1] of q [T, h, d]) and n_k(i) >= n_q(i) keys and values
(rows cu_k[i]:cu_k[i+1] of k, v [T_k, g, d], g key/value heads, h a multiple of g). Its queries are the last
n_q(i) positions of its n_k(i): query t (0-based) sees keys 0 .. t + n_k(i) - n_q(i) (causal, aligned at the
bottom right), scaled by `scale`. A sample of a packed group is one such sequence: its own tokens query the
shared prompt's keys and its own.

It is one torch operator (`yatt_ray::varlen_attention`, its backward `yatt_ray::varlen_attention_backward`):

- on CUDA: FlashAttention-2's variable-length kernel as torch ships it (`aten::_flash_attention_forward` /
  `_backward` with cumulative lengths; GQA in the kernel): one flash-attention call forward and one backward
  per layer, whatever the number of sequences, and no padding;
- on the CPU: its stand-in, the sequences batched into length buckets (`BucketPlan`) with one fused CPU flash
  call per bucket (`aten::_scaled_dot_product_flash_attention_for_cpu`, whose output and log-sum-exp are kept
  for the backward: no recomputation).

So the trainer's Python is the same on both devices, and a dispatch-level count of its kernels
(`testing.gpu_proxies`) sees what a GPU launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from yatt_ray.train.kernels import grouped_attention

BUCKET_RATIO = 0.85
BUCKET_SLACK = 64


@dataclass(frozen=True)
class BucketPlan:
    """The CPU stand-in's batching of sequences: one entry per bucket, each a pair of [S_b, W_b] long grids
    (W_b: the bucket's longest n_k): `q_rows` the row of q each cell's query is read from, `kv_rows` the row of
    k / v of each cell's key (cell t of sequence i is its key t; the query at a key's place is that token's
    own query, read from `kv_positions`). Padding cells (t >= n_k(i)) read row 0: after a sequence's real keys,
    so no real query (causal) sees them. `out_cell` [T]: for each query row, the flat cell (buckets in order,
    S_b x W_b each) that holds its output.

    A sequence joins a bucket while its n_k is >= BUCKET_RATIO of the bucket's longest or within BUCKET_SLACK
    of it, which bounds the padded work per bucket."""

    grids: tuple[tuple[Tensor, Tensor], ...]
    out_cell: Tensor

    def flat(self) -> list[Tensor]:
        """The operator's `plan` argument: q_rows, kv_rows of each bucket, then out_cell."""
        return [t for pair in self.grids for t in pair] + [self.out_cell]


def bucket_plan(cu_q: Tensor, cu_k: Tensor, kv_positions: Tensor) -> BucketPlan:
    """The CPU buckets of the sequences given by cu_q, cu_k [N + 1] (host tensors) and `kv_positions` [T_k]: the
    query row of each key's token (`attention.SegmentLayout.kv_index`)."""
    n_q, n_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    order = torch.argsort(n_k, descending=True, stable=True)
    out_cell = torch.empty(int(cu_q[-1]), dtype=torch.long)
    grids, offset = [], 0
    for members in _buckets(order.tolist(), n_k.tolist()):
        width = int(n_k[members[0]])
        t = torch.arange(width)[None, :]
        real = t < n_k[members][:, None]
        kv_rows = torch.where(real, cu_k[members].long()[:, None] + t, 0)
        q_rows = torch.where(real, kv_positions[kv_rows], 0)
        # cells first_query .. n_k - 1 hold the sequence's queries
        first_query = (n_k - n_q)[members][:, None]
        owns = real & (t >= first_query)
        q_index = cu_q[members].long()[:, None] + t - first_query
        cells = offset + torch.arange(real.numel()).view_as(real)
        out_cell[q_index[owns]] = cells[owns]
        grids.append((q_rows, kv_rows))
        offset += real.numel()
    return BucketPlan(tuple(grids), out_cell)


def _buckets(order: list[int], lengths: list[int]) -> list[Tensor]:
    """Sequences (indices in descending length `order`) cut into buckets; see `BucketPlan`."""
    buckets: list[list[int]] = []
    top = 0
    for i in order:
        n = lengths[i]
        if buckets and (n >= BUCKET_RATIO * top or top - n <= BUCKET_SLACK):
            buckets[-1].append(i)
        else:
            buckets.append([i])
            top = n
    return [torch.tensor(b, dtype=torch.long) for b in buckets]


@torch.library.custom_op("yatt_ray::varlen_attention", mutates_args=())
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    plan: list[Tensor],
    expand_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, h, d], k / v [T_k, g, d] -> (out [T, h, d], then what the backward reads: CUDA the log-sum-exp
    [h, T] and the RNG state; CPU every bucket's log-sum-exp, flat, and every cell's output [C, h, d]); see the
    module docstring. cu_q / cu_k int32 [N + 1] on q's device; `plan`: the CPU's buckets (`BucketPlan.flat()`;
    empty on CUDA); `expand_gqa`: the CPU kernel gets k / v repeated to h heads (`kernels.GQA` "expand")."""
    if q.is_cuda:
        out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        return out, lse, rng
    heads, dim = q.shape[1:]
    outs, lses = [], []
    for q_rows, kv_rows in zip(plan[0:-1:2], plan[1:-1:2]):
        qc, kc, vc = (
            _cells(q, q_rows),
            _cells(k, kv_rows, heads, expand_gqa),
            _cells(v, kv_rows, heads, expand_gqa),
        )
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qc, kc, vc, 0.0, True, scale=scale
        )
        outs.append(out.transpose(1, 2).reshape(-1, heads, dim))
        lses.append(lse.reshape(-1))
    cells = torch.cat(outs)
    return cells.index_select(0, plan[-1]), torch.cat(lses), cells


@varlen_attention.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, plan, expand_gqa):
    heads, dim = q.shape[1:]
    if q.device.type == "cuda":
        return q.new_empty(q.shape), q.new_empty((heads, q.shape[0]), dtype=torch.float32), q.new_empty(2)
    cells = sum(g.numel() for g in plan[0:-1:2])
    return (
        q.new_empty(q.shape),
        q.new_empty(
            cells * heads, dtype=torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        ),
        q.new_empty(cells, heads, dim),
    )


def _cells(x: Tensor, rows: Tensor, heads: int | None = None, expand: bool = False) -> Tensor:
    """x [T, n, d] read at `rows` [S, W] -> [S, n, W, d] (n -> `heads` with k / v repeated when `expand`)."""
    s, w = rows.shape
    out = x.index_select(0, rows.reshape(-1)).view(s, w, x.shape[1], x.shape[2]).transpose(1, 2)
    if expand and heads is not None and heads != x.shape[1]:
        out = out.repeat_interleave(heads // x.shape[1], dim=1)
    return out


@torch.library.custom_op("yatt_ray::varlen_attention_backward", mutates_args=())
def _attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    out: Tensor,
    aux_a: Tensor,
    aux_b: Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    plan: list[Tensor],
    expand_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `varlen_attention`'s output given its gradient `grad` [T, h, d]."""
    if q.is_cuda:
        return torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, aux_a, cu_q, cu_k, max_q, max_k, 0.0, True, aux_b,
            q.new_empty(0), scale=scale,
        )  # fmt: skip
    heads, dim = q.shape[1:]
    lse_all, cells = aux_a, aux_b
    grad_cells = grad.new_zeros(cells.shape).index_copy_(0, plan[-1], grad)  # each query row has one cell
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cell = lse = 0
    for q_rows, kv_rows in zip(plan[0:-1:2], plan[1:-1:2]):
        s, w = q_rows.shape
        qc, kc, vc = (
            _cells(q, q_rows),
            _cells(k, kv_rows, heads, expand_gqa),
            _cells(v, kv_rows, heads, expand_gqa),
        )
        o, go = (x[cell : cell + s * w].view(s, w, heads, dim).transpose(1, 2) for x in (cells, grad_cells))
        dqc, dkc, dvc = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            go, qc, kc, vc, o, lse_all[lse : lse + s * heads * w].view(s, heads, w), 0.0, True, scale=scale
        )
        dq.index_add_(0, q_rows.reshape(-1), dqc.transpose(1, 2).reshape(-1, heads, dim))
        for full, part in ((dk, dkc), (dv, dvc)):
            if part.shape[1] != full.shape[1]:  # expanded heads back to their groups
                part = part.view(s, full.shape[1], -1, w, dim).sum(2)
            full.index_add_(0, kv_rows.reshape(-1), part.transpose(1, 2).reshape(-1, full.shape[1], dim))
        cell, lse = cell + s * w, lse + s * heads * w
    return dq, dk, dv


@_attention_backward.register_fake
def _(grad, q, k, v, cu_q, cu_k, out, aux_a, aux_b, max_q, max_k, scale, plan, expand_gqa):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, scale, plan, expand_gqa = inputs
    out, aux_a, aux_b = output
    kept_out = out if q.is_cuda else out.new_empty(0)  # the CPU reads the cells instead
    ctx.save_for_backward(q, k, v, cu_q, cu_k, kept_out, aux_a, aux_b, *plan)
    ctx.args = (max_q, max_k, scale)
    ctx.expand_gqa = expand_gqa
    ctx.set_materialize_grads(False)  # the auxiliary outputs' gradients stay None (no zero tensors made)


def _backward(ctx, grad, _grad_a, _grad_b):
    q, k, v, cu_q, cu_k, out, aux_a, aux_b, *plan = ctx.saved_tensors
    dq, dk, dv = _attention_backward(
        grad, q, k, v, cu_q, cu_k, out, aux_a, aux_b, *ctx.args, plan, ctx.expand_gqa
    )
    return dq, dk, dv, None, None, None, None, None, [None] * len(plan), None


varlen_attention.register_autograd(_backward, setup_context=_setup_context)


def bucketed_attention(
    q: Tensor, k: Tensor, v: Tensor, plan: BucketPlan, scale: float, gqa: str = "native"
) -> Tensor:
    """What `varlen_attention` computes, in autograd-tracked torch ops on any device (one
    `scaled_dot_product_attention` a bucket): a GPU's path where its flash kernel does not take the dtype
    (fp32), and the tests' second form."""
    heads, dim = q.shape[1:]
    outs = [
        grouped_attention(_cells(q, q_rows), _cells(k, kv_rows), _cells(v, kv_rows), scale, gqa)
        .transpose(1, 2)
        .reshape(-1, heads, dim)
        for q_rows, kv_rows in plan.grids
    ]
    return torch.cat(outs).index_select(0, plan.out_cell)
