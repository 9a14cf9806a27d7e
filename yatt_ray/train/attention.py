"""Attention over shared-prefix packed rows without an L x L tensor.

A packed row (`packing.SharedPrefixRows`) holds a group's shared body (b tokens, segment id 0) and then each
sample's own tokens (segment j >= 1, n_j tokens). Its attention is, per sample j, plain causal attention over
the sequence [body; segment j]: a body token sees the body before it, a segment token the whole body and its
own segment up to itself. So the packed attention is one causal attention over variable-length sequences
(`varlen.varlen_attention`, one call a layer):

    the body:      queries = the body's b tokens,   keys = the body
    segment j:     queries = segment j's n_j tokens, keys = [body; segment j]   (causal, bottom-right aligned)

Queries are the packed rows as they are (the sequences tile them in order: no gather, no scatter of the output);
keys and values are gathered once a layer into the sequences (the body's once per sequence that reads it:
linear in L). On a GPU this is FlashAttention-2's variable-length kernel, on the CPU its stand-in by length
buckets (`varlen.BucketPlan`); memory O(sum_j (b + n_j)) per head instead of the dense path's O(L^2) mask
and scores.

Short rows (up to a length measured per machine, `kernels.KernelChoice.dense_rows`) run instead as whole rows
with their [G, 1, L, L] visibility mask in one masked kernel call: at tens of tokens a row that is faster than
many tiny sequences, and its memory is bounded by that length.

`shared_prefix_attention_class()` is the Megatron core-attention module that does this (the trainer's default, see
`model.build_gpt_model`); Megatron's `DotProductAttention` with `SharedPrefixRows.attention_mask()` is the
dense reference the tests compare against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from yatt_ray.train.kernels import active_dense_rows, active_gqa, grouped_attention
from yatt_ray.train.micro_batches import to_device
from yatt_ray.train.varlen import BucketPlan, bucket_plan, bucketed_attention, varlen_attention

HALF = (torch.float16, torch.bfloat16)  # what the CUDA flash kernel takes


@dataclass(frozen=True)
class SegmentLayout:
    """The causal sequences of a packed batch [G, L] (its positions flat, row after row: [G * L]), in the form
    `varlen.varlen_attention` takes: sequence i's queries are positions cu_q[i]:cu_q[i+1]; its keys the
    positions kv_index[cu_k[i]:cu_k[i+1]] (kv_index [T_k] long; cu_q, cu_k int32 [N + 1]); max_q / max_k the
    longest. Every position is one sequence's query (padding: a sequence of its own, whose outputs nothing reads).

    Whole masked rows (the short-row form) instead have `visible` [G, 1, L, L] (and, flattened, `grid` and
    `out_source`: see `flattened`); their sequence fields are empty.
    """

    kv_index: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int = 0
    max_k: int = 0
    visible: Tensor | None = None
    grid: Tensor | None = None
    out_source: Tensor | None = None

    @functools.cached_property
    def plan(self) -> BucketPlan:
        """The CPU's length buckets of these sequences (made on first use, on the layout's device)."""
        plan = bucket_plan(self.cu_q.cpu(), self.cu_k.cpu(), self.kv_index.cpu())
        device = self.kv_index.device
        grids = tuple((q.to(device), kv.to(device)) for q, kv in plan.grids)
        return BucketPlan(grids, plan.out_cell.to(device))

    def to(self, device) -> SegmentLayout:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else to_device(t, device)

        return SegmentLayout(
            to_device(self.kv_index, device), to_device(self.cu_q, device), to_device(self.cu_k, device),
            self.max_q, self.max_k, move(self.visible), move(self.grid), move(self.out_source),
        )  # fmt: skip

    def flattened(self, real: Tensor, length: int | None = None) -> SegmentLayout:
        """This layout for its [G, L] rows' real positions (`real` [G, L] bool) laid end to end as one row of T
        tokens (`SharedPrefixRows.flat`), padded to `length` >= T tokens at the end (default T): the same
        attention, indexed into the flat row; no token reads the padding (a sequence of its own).

        Whole masked rows get `grid` [G * L]: the flat index each padded-row position reads (padding: any real
        one, never seen through the mask), and `out_source` [T'] = the padded-row position of each flat token
        (padding: position 0's output, which nothing downstream of a padding token reads)."""
        flat = real.reshape(-1)
        keep = torch.nonzero(flat).flatten()
        total = len(keep)
        pad = (total if length is None else length) - total
        if pad < 0:
            raise ValueError(f"length={length} is below the {total} real positions")
        rank = (torch.cumsum(flat, 0) - 1).clamp(min=0)  # a real position's place in the flat row
        if self.visible is not None:
            empty = _empty_sequences()
            return SegmentLayout(
                *empty, visible=self.visible, grid=rank, out_source=torch.cat([keep, keep.new_zeros(pad)])
            )
        cu_q, cu_k = self.cu_q.tolist(), self.cu_k.tolist()
        q_lengths, keys = [], []
        for i in range(len(cu_q) - 1):
            if flat[cu_q[i]]:  # a padding sequence of the rows has no place in the flat row
                q_lengths.append(cu_q[i + 1] - cu_q[i])
                keys.append(rank[self.kv_index[cu_k[i] : cu_k[i + 1]]])
        if pad:
            q_lengths.append(pad)
            keys.append(torch.arange(total, total + pad))
        return sequences_layout(q_lengths, keys)


def _empty_sequences() -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty(0, dtype=torch.long),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )


def sequences_layout(q_lengths: list[int], keys: list[Tensor]) -> SegmentLayout:
    """The layout of sequences that tile the queries in order (sequence i: q_lengths[i] queries, the last of
    its keys' positions `keys[i]`)."""

    def cumulative(lengths: list[int]) -> Tensor:
        return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)

    k_lengths = [len(k) for k in keys]
    return SegmentLayout(
        torch.cat(keys), cumulative(q_lengths), cumulative(k_lengths), max(q_lengths), max(k_lengths)
    )


def visible_mask(segment: Tensor) -> Tensor:
    """[G, L] segment ids -> [G, 1, L, L] bool, True = the query (row) sees the key (column): a body token
    sees the body before it, a segment token the body and its own segment up to itself; a query always sees
    itself (padding too, so that no row is empty)."""
    length = segment.shape[1]
    cols = torch.arange(length, device=segment.device)
    causal = cols[None, :, None] >= cols[None, None, :]  # [1, q, k]
    key_seg, query_seg = segment[:, None, :], segment[:, :, None]
    visible = causal & (key_seg >= 0) & ((key_seg == 0) | (key_seg == query_seg))
    return (visible | torch.eye(length, dtype=torch.bool, device=segment.device))[:, None]


def segment_layout(segment: Tensor, dense_up_to: int | None = None) -> SegmentLayout:
    """The layout of packed rows from their segment ids [G, L] (0 = body at the row's front, j >= 1 = sample
    j's tokens, contiguous and in order, -1 = padding at the end); see the module docstring.

    Rows of at most `dense_up_to` tokens (default: this process's `kernels` choice, measured) get the dense
    form instead: their [G, 1, L, L] visibility mask, one masked kernel call over whole rows. It is faster for
    short rows (the demo's: tens of tokens) and its memory is bounded by that length."""
    seg = segment.cpu()
    rows, length = seg.shape
    if length <= (active_dense_rows() if dense_up_to is None else dense_up_to):
        return SegmentLayout(*_empty_sequences(), visible=visible_mask(seg))
    q_lengths, keys = [], []
    for r in range(rows):  # each run of one segment id is a sequence
        ids, counts = torch.unique_consecutive(seg[r], return_counts=True)
        start, body = r * length, None
        for value, n in zip(ids.tolist(), counts.tolist()):
            own = torch.arange(start, start + n)
            body = own if value == 0 else body
            keys.append(torch.cat([body, own]) if value > 0 and body is not None else own)
            q_lengths.append(n)
            start += n
    return sequences_layout(q_lengths, keys)


def packed_attention(
    query: Tensor, key: Tensor, value: Tensor, layout: SegmentLayout, scale: float | None = None
) -> Tensor:
    """Shared-prefix attention over packed rows.

    query [L, G, h, d], key / value [L, G, g, d] (g key/value heads, h a multiple of g) in Megatron's
    [sequence, batch, heads, dim] layout -> [L, G, h * d]. Differentiable in query, key and value.
    """
    length, rows, heads, dim = query.shape
    if layout.visible is not None:  # whole short rows, one masked call
        return _whole_rows(query, key, value, layout, scale)
    scale = 1.0 / math.sqrt(dim) if scale is None else scale

    def flat(x: Tensor) -> Tensor:  # [L, G, n, d] -> [G * L, n, d] (a view for the trainer's one flat row)
        return x.transpose(0, 1).reshape(rows * length, x.shape[2], dim)

    q = flat(query)
    k, v = (flat(x).index_select(0, layout.kv_index) for x in (key, value))  # one gather a tensor
    if q.is_cuda and q.dtype not in HALF:  # the flash kernel takes half precision only
        out = bucketed_attention(q, k, v, layout.plan, scale, active_gqa())
    else:
        plan = [] if q.is_cuda else layout.plan.flat()
        gqa = active_gqa() == "expand"
        out = varlen_attention(
            q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k, scale, plan, gqa
        )[0]
    return out.reshape(rows, length, heads * dim).transpose(0, 1)


def _whole_rows(
    query: Tensor, key: Tensor, value: Tensor, layout: SegmentLayout, scale: float | None
) -> Tensor:
    """Whole packed rows [G, L] in one masked call: [L, G, h, d] -> [L, G, h * d]; or, with `layout.grid`
    (flat rows), [T, 1, h, d] gathered into the padded rows and the outputs taken back -> [T, 1, h * d]."""
    if layout.grid is None:
        length, rows, heads, dim = query.shape
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [G, heads, L, d]
        out = grouped_attention(q, k, v, scale, active_gqa(), mask=layout.visible)
        return out.permute(2, 0, 1, 3).reshape(length, rows, heads * dim)
    assert layout.visible is not None and layout.out_source is not None
    rows, length, grid = layout.visible.shape[0], layout.visible.shape[-1], layout.grid

    def padded(x: Tensor) -> Tensor:  # [T, 1, n, d] -> [G, n, L, d]
        return x[:, 0].index_select(0, grid).view(rows, length, *x.shape[2:]).transpose(1, 2)

    out = grouped_attention(
        padded(query), padded(key), padded(value), scale, active_gqa(), mask=layout.visible
    )
    out = out.transpose(1, 2).reshape(rows * length, -1).index_select(0, layout.out_source)
    return out[:, None]


@functools.cache
def shared_prefix_attention_class() -> type:
    """`SharedPrefixAttention`, the Megatron core-attention module (a drop-in for `DotProductAttention` in a
    layer spec) over packed rows; built on first use so that importing this module does not import Megatron.

    Its `attention_mask` argument is a `SegmentLayout` (`SharedPrefixRows.attention_layout()`), or None for
    plain causal attention over each row. Softmax scale 1/sqrt(kv_channels) unless the config sets one; no
    dropout (the trainer's configs have none).
    """
    from megatron.core.transformer.module import MegatronModule

    class SharedPrefixAttention(MegatronModule):
        def __init__(
            self,
            config,
            layer_number: int,
            attn_mask_type=None,
            attention_type: str = "self",
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection=None,
        ):
            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout > 0:
                raise ValueError(
                    f"attention_dropout={dropout}: the packed attention has no dropout; set it to 0"
                )
            kv_channels = config.kv_channels or config.hidden_size // config.num_attention_heads
            scale = config.softmax_scale if softmax_scale is None else softmax_scale
            self.scale = 1.0 / math.sqrt(kv_channels) if scale is None else scale

        def forward(
            self,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask,
            attn_mask_type=None,
            attention_bias=None,
            packed_seq_params=None,
        ) -> Tensor:
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("the packed attention takes neither attention_bias nor packed_seq_params")
            if attention_mask is None:
                return causal_attention(query, key, value, self.scale)
            if not isinstance(attention_mask, SegmentLayout):
                raise TypeError(
                    "the packed attention needs a SegmentLayout (SharedPrefixRows.attention_layout()), got "
                    f"{type(attention_mask).__name__}; a dense mask needs "
                    "build_gpt_model(..., attention='dense')"
                )
            return packed_attention(query, key, value, attention_mask, self.scale)

    return SharedPrefixAttention


def causal_attention(query: Tensor, key: Tensor, value: Tensor, scale: float | None = None) -> Tensor:
    """Plain causal attention over each row: [L, G, h, d] (key / value [L, G, g, d]) -> [L, G, h * d]."""
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [G, heads, L, d]
    out = grouped_attention(q, k, v, scale, active_gqa())
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
