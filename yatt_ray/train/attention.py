"""Attention over shared-prefix packed rows without an L x L tensor.

A packed row (`packing.SharedPrefixRows`) holds a group's shared body (b tokens, segment id 0) and then each
sample's own tokens (segment j >= 1, n_j tokens). Its attention is, per sample j, plain causal attention over
the sequence [body; segment j]: a body token sees the body before it, a segment token the whole body and its
own segment up to itself. So the packed attention is S independent causal attentions, one per segment,

    out[body]      = causal_attn(body)                        (taken from the row's first sequence)
    out[segment j] = causal_attn([body; segment j])[b:]

each a fused `scaled_dot_product_attention(..., is_causal=True)` call (flash attention on CUDA, the blocked
flash kernel on CPU): memory O(sum_j (b + n_j)) per head instead of the dense path's O(L^2) mask and scores.
The body's keys and values are gathered once per sequence (n copies of b tokens, linear in L); the body's
queries are recomputed per sequence, b^2 / 2 score pairs each, against the n_j (b + n_j / 2) a segment needs.

Short rows (up to a length measured per machine, `kernels.KernelChoice.dense_rows`) run instead as whole rows
with their [G, 1, L, L] visibility mask in one masked kernel call: at tens of tokens a row that is faster than
many tiny sequences, and its memory is bounded by that length.

Sequences are batched into length buckets (`SegmentLayout.buckets`) so that one kernel call serves many
sequences: each bucket is padded to its longest sequence. Padding sits after a sequence's real tokens, so a real
query (causal) never sees it; padded queries' outputs are never read. A sequence joins a bucket while its
length is >= `BUCKET_RATIO` of the bucket's longest or within `BUCKET_SLACK` tokens of it, which bounds the
padded work per bucket.

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

BUCKET_RATIO = 0.85
BUCKET_SLACK = 64


@dataclass(frozen=True)
class SegmentLayout:
    """Where each causal sequence of a packed batch [G, L] comes from, and where its outputs go.

    buckets: one long tensor [S_k, L_k] per bucket: flat indices into the [G * L] packed positions of each
    sequence's tokens ([body; segment], then padding pointing at position 0). out_source [G * L] long: for each
    packed position, the flat index into the concatenated bucket outputs (sum_k S_k * L_k of them) that holds
    its attention output, or that total (a zero row) for padding positions.
    """

    buckets: tuple[Tensor, ...]
    out_source: Tensor
    visible: Tensor | None = None
    grid: Tensor | None = None

    @functools.cached_property
    def gather(self) -> Tensor:
        """[sum_k S_k * L_k] every bucket's flat indices, bucket after bucket (made once per layout, read by
        every layer)."""
        return torch.cat([b.reshape(-1) for b in self.buckets])

    def to(self, device) -> SegmentLayout:
        visible, grid = (None if t is None else t.to(device) for t in (self.visible, self.grid))
        buckets = tuple(b.to(device) for b in self.buckets)
        return SegmentLayout(buckets, self.out_source.to(device), visible, grid)

    def flattened(self, real: Tensor, length: int | None = None) -> SegmentLayout:
        """This layout for its [G, L] rows' real positions (`real` [G, L] bool) laid end to end as one row of T
        tokens (`SharedPrefixRows.flat`), padded to `length` >= T tokens at the end (default T): the same
        attention, indexed into the flat row; no token reads the padding.

        Buckets index the flat row; `out_source` [T'] keeps each real position's entry (padding: the zero row).
        Whole masked rows get `grid` [G * L]: the flat index each padded-row position reads (padding: any real
        one, never seen through the mask), and `out_source` [T'] = the padded-row position of each flat token
        (padding: position 0's output, which nothing downstream of a padding token reads)."""
        flat = real.reshape(-1)
        keep = torch.nonzero(flat).flatten()
        pad = (len(keep) if length is None else length) - len(keep)
        if pad < 0:
            raise ValueError(f"length={length} is below the {len(keep)} real positions")
        rank = (torch.cumsum(flat, 0) - 1).clamp(min=0)  # a real position's place in the flat row
        if self.visible is not None:
            return SegmentLayout((), torch.cat([keep, keep.new_zeros(pad)]), self.visible, rank)
        zero_row = sum(b.numel() for b in self.buckets)
        out_source = torch.cat([self.out_source[keep], keep.new_full((pad,), zero_row)])
        return SegmentLayout(tuple(rank[b] for b in self.buckets), out_source)


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
        return SegmentLayout((), torch.empty(0, dtype=torch.long), visible_mask(seg))
    body = (seg == 0).sum(1)  # [G]
    where = torch.nonzero(seg > 0)  # [P, 2] (row, column), row-major: segments are contiguous runs
    key = where[:, 0] * (int(seg.max()) + 1) + seg[where[:, 0], where[:, 1]]
    _, counts = torch.unique_consecutive(key, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    row = where[starts, 0]
    first_col = where[starts, 1]
    first_of_row = torch.ones_like(row, dtype=torch.bool)
    first_of_row[1:] = row[1:] != row[:-1]
    seq_len = body[row] + counts
    order = torch.argsort(seq_len, descending=True, stable=True)
    out_source = torch.full((rows * length,), -1, dtype=torch.long)
    buckets: list[Tensor] = []
    offset = 0
    for members in _bucket(order, seq_len):
        width = int(seq_len[members[0]])
        t = torch.arange(width)[None, :]
        r = row[members][:, None]
        b = body[r]
        col = torch.where(t < b, t, first_col[members][:, None] + t - b)
        real = t < seq_len[members][:, None]
        flat = torch.where(real, r * length + col, torch.zeros_like(col))
        buckets.append(flat)
        # a segment position's output comes from its own sequence; a body position's from the row's first
        writes = real & ((t >= b) | first_of_row[members][:, None])
        out_index = offset + torch.arange(flat.numel()).view_as(flat)
        out_source[flat[writes]] = out_index[writes]
        offset += flat.numel()
    out_source[out_source < 0] = offset
    return SegmentLayout(tuple(buckets), out_source)


def _bucket(order: Tensor, seq_len: Tensor) -> list[Tensor]:
    """Sequences (indices in descending length `order`) cut into buckets; see the module docstring."""
    buckets: list[list[int]] = []
    top = 0
    for i in order.tolist():
        n = int(seq_len[i])
        if buckets and (n >= BUCKET_RATIO * top or top - n <= BUCKET_SLACK):
            buckets[-1].append(i)
        else:
            buckets.append([i])
            top = n
    return [torch.tensor(b, dtype=torch.long) for b in buckets]


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

    def flat(x: Tensor) -> Tensor:  # [L, G, n, d] -> [G * L, n, d]
        return x.transpose(0, 1).reshape(rows * length, x.shape[2], dim)

    # every bucket's positions in one gather per tensor (its backward one index_add), split into the buckets
    # as views (whose backward is one cat): the kernel launches do not grow with the bucket count but for the
    # attention calls themselves
    sizes = [index.numel() for index in layout.buckets]
    gathered = (x.index_select(0, layout.gather).split(sizes) for x in (flat(query), flat(key), flat(value)))
    outputs = []
    for index, q, k, v in zip(layout.buckets, *gathered):
        s, w = index.shape

        def bucket(x: Tensor, s: int = s, w: int = w) -> Tensor:  # [S_k * L_k, n, d] -> [S_k, n, L_k, d]
            return x.view(s, w, x.shape[1], dim).transpose(1, 2)

        out = grouped_attention(bucket(q), bucket(k), bucket(v), scale, active_gqa())  # [S_k, h, L_k, d]
        outputs.append(out.transpose(1, 2).reshape(s * w, heads * dim))
    outputs.append(query.new_zeros(1, heads * dim))
    out = torch.cat(outputs).index_select(0, layout.out_source)  # [G * L, h * d]
    return out.view(rows, length, heads * dim).transpose(0, 1)


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
    assert layout.visible is not None
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
