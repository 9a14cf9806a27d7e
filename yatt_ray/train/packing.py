"""Shared-prefix packing: the rows of a group run through the model with their common prefix computed once.

A GRPO group is `n` samples of one prompt: in the padded batch its prompt appears `n` times and every row is
padded to the longest response of the batch. Packing removes both wastes. Rows are taken in groups of
consecutive rows (`group_size`); for a group with real tokens s_1..s_n whose longest common prefix has c
tokens, the packed row is

    s[0 : b]  |  s_1[b :]  |  s_2[b :]  | ... |  s_n[b :]  | padding
    shared body  segment 1    segment 2           segment n

with b = c when every row has a token past the common prefix (a prompt's samples: each response has one), else
b = c - 1, so that no segment is empty. Positions (RoPE): body token m sits at m; token m of s_j, m >= b, at m,
exactly where it sits in the unpacked row. Attention: a body token sees the body before it; a segment token
sees the whole body and its own segment up to itself; no token sees another segment or padding. The outputs at
every real token are therefore those of the unpacked row, while the model runs over b + sum_j (len(s_j) - b)
tokens instead of n * width.

Each position predicts the token after it (`targets`), except the body's last when b = c: there every row
predicts its own first token s_j[c] from the same output. Row 1's is that position's target; rows 2..n's are
extra predictions of the position (`extra_at`, `extra_targets`), scored on its output (`unpack`'s `extra`).
Before, each segment began with its own copy of the last common token, so every position predicted exactly one
token, at the price of one more token per sample through every layer: at the benchmark's answers of ~3 tokens a
fifth of the trainer's tokens.

The trainer runs the model over `flat()`: the rows' real tokens laid end to end as one row [1, T], so no
layer computes the padding of every packed row to the longest (the attention gathers its own padded form
inside its call). The trainer's attention over packed rows (`attention.packed_attention`) runs fused causal
kernels per [body; segment] sequence, so its memory grows linearly with the packed length and a group stays
one packed row however long (splitting it would only compute its prompt again). `max_len` still splits a
group whose packed length would exceed it into sub-groups, for the dense reference (`attention_mask()`, an
[L, L] mask) in tests. `group_size=1` is plain unpadding (each row alone, real tokens moved to the front). Any
grouping gives the same results; only the cost differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from yatt_ray.train.attention import SegmentLayout, segment_layout, visible_mask
from yatt_ray.train.micro_batches import to_device

PAD_SEGMENT = -1


@dataclass(frozen=True)
class SharedPrefixRows:
    """Packed rows [G, L] and the map back to the original [B, T] layout.

    input_ids [G, L] token ids (0 on padding); position_ids [G, L] RoPE positions; segment [G, L] 0 = shared
    body, j >= 1 = a row's own tokens, -1 = padding; targets [G, L] the token each position predicts (0 where
    none); source [B, T-1] long: for original column t (which predicts original token t+1) the flat index into
    a [G * L] tensor of the position that predicts it, G * L + e for extra prediction e (below), or G * L + E
    (a zero) where token t+1 is not real;
    first_row [G] long: the original row whose tokens packed row g starts with (its prompt is g's prompt);
    row [G, L] long: the original row each packed token is taken from (the body: first_row's), -1 on padding
    (with position_ids, the token's place in that row's real tokens: multimodal RoPE reads its positions there);
    extra_at [E] long: the flat index into [G * L] of each extra prediction's position (a body's last token
    predicting the first own token of rows 2..n), extra_targets [E] long: the token it predicts.
    """

    input_ids: Tensor
    position_ids: Tensor
    segment: Tensor
    targets: Tensor
    source: Tensor
    first_row: Tensor
    row: Tensor
    extra_at: Tensor
    extra_targets: Tensor
    layout: SegmentLayout | None = None  # flat rows (`flat`): their attention layout, made before flattening

    def attention_layout(self) -> SegmentLayout:
        """What the trainer's packed attention takes (`attention.SegmentLayout`): memory linear in L."""
        return segment_layout(self.segment) if self.layout is None else self.layout

    def attention_mask(self) -> Tensor:
        """[G, 1, L, L] bool, True = masked (see the module docstring); a query always sees itself. The dense
        form, for the reference attention in tests (`build_gpt_model(..., attention="dense")`)."""
        if self.layout is not None:
            raise ValueError("flat rows have no dense mask: take the padded rows' (before .flat())")
        return ~visible_mask(self.segment)

    def flat(self, multiple: int = 1) -> SharedPrefixRows:
        """These rows' real tokens laid end to end as one row [1, T'] (T = `tokens` of them), with the same
        attention (the padded rows' layout, re-indexed: `SegmentLayout.flattened`) and `source` re-indexed to
        it; `first_row` stays per group. The layers then run over T tokens instead of G x L: no row is padded
        to the longest (at the benchmark's lengths a third of the positions). Call it on the CPU.

        T' = T rounded up to a multiple of `multiple`: padding at the end (token 0, position 0, segment -1,
        predicting nothing, attended by no token), so that batches of nearby sizes run the same matrix shapes
        (the trainer's `model.FLAT_MULTIPLE`: on a CPU oneDNN builds a kernel for every new shape)."""
        if multiple < 1:
            raise ValueError(f"multiple={multiple} must be >= 1")
        real = self.segment != PAD_SEGMENT
        total, extras = int(real.sum()), len(self.extra_at)
        length = -(-total // multiple) * multiple
        # [G * L] packed places, the E extra slots and the zero -> their flat indices: T' + e, then T' + E
        rank = torch.cat([torch.full((real.numel(),), -1), length + torch.arange(extras + 1)])
        rank[torch.nonzero(real.reshape(-1)).flatten()] = torch.arange(total)
        return SharedPrefixRows(
            self.on_flat(self.input_ids, length),
            self.on_flat(self.position_ids, length),
            self.on_flat(self.segment, length, fill=PAD_SEGMENT),
            self.on_flat(self.targets, length),
            rank[self.source],
            self.first_row,
            self.on_flat(self.row, length, fill=-1),
            rank[self.extra_at],
            self.extra_targets,
            self.attention_layout().flattened(real, length),
        )

    def on_flat(self, values: Tensor, length: int | None = None, fill: int = 0) -> Tensor:
        """Values per packed position [..., G, L] -> [..., 1, T] at the real positions, in `flat()`'s order;
        a `length` above T pads the end to it with `fill` (as `flat(multiple)` does)."""
        keep = torch.nonzero((self.segment != PAD_SEGMENT).reshape(-1)).flatten().to(values.device)
        out = values.flatten(-2)[..., keep]
        if length is not None and length > out.shape[-1]:
            out = torch.nn.functional.pad(out, (0, length - out.shape[-1]), value=fill)
        return out.unsqueeze(-2)

    def unpack(self, values: Tensor, extra: Tensor | None = None) -> Tensor:
        """Per-position values [G, L] (e.g. the log-prob of `targets`) -> [B, T-1] in the original columns,
        0 where the next original token is padding. Differentiable w.r.t. `values` and `extra`.

        extra [E]: the value of each extra prediction (the log-prob of `extra_targets` at `extra_at`); leave it
        out for a value of the position itself (an entropy, a critic's value), which every prediction from
        that position shares."""
        flat = values.reshape(-1)
        if extra is None:
            extra = flat[self.extra_at]
        return torch.cat([flat, extra, values.new_zeros(1)])[self.source]

    def places(self, index: Tensor) -> Tensor:
        """Indices into `unpack`'s values ([G * L] places, then the extra predictions, as `source` holds them)
        -> the packed place ([G * L]) whose output makes each prediction. Not for the zero (padding)."""
        lookup = torch.cat([torch.arange(self.segment.numel()), self.extra_at.cpu()])
        return lookup[index.cpu()]

    def to(self, device) -> SharedPrefixRows:
        moved: dict[str, Any] = {
            k: v.to(device) if isinstance(v, SegmentLayout) else to_device(v, device)
            for k, v in vars(self).items()
            if v is not None
        }
        return SharedPrefixRows(**moved)

    @property
    def tokens(self) -> int:
        """Real tokens the model runs over (the packed rows less padding)."""
        return int((self.segment != PAD_SEGMENT).sum())


def pack_shared_prefix(
    input_ids: Tensor, attention_mask: Tensor, group_size: int = 1, max_len: int | None = None
) -> SharedPrefixRows:
    """Pack [B, T] rows (1 = real token in `attention_mask`, any padding) in groups of `group_size`
    consecutive rows; `max_len` caps a packed row (default: no cap, a group is one row). See the module
    docstring.
    Built on the CPU (many small tensor operations); move the result with `.to(device)`."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    rows, width = input_ids.shape
    input_ids, real = input_ids.cpu(), attention_mask.cpu().bool()
    seqs = [input_ids[i][real[i]] for i in range(rows)]
    cols = [torch.nonzero(real[i]).flatten() for i in range(rows)]
    units: list[tuple[list[int], int, list[Tensor]]] = []  # (row indices, body length, row token tensors)
    for start in range(0, rows, group_size):
        group = list(range(start, min(start + group_size, rows)))
        for sub in [group] if max_len is None else _split_under(group, seqs, max_len):
            members = [seqs[i] for i in sub]
            units.append((sub, _body_len(members), members))
    length = max(2, max(_packed_len(members) for _, _, members in units))
    g = len(units)
    ids = torch.zeros(g, length, dtype=torch.long)
    pos = torch.zeros(g, length, dtype=torch.long)
    seg = torch.full((g, length), PAD_SEGMENT, dtype=torch.long)
    tgt = torch.zeros(g, length, dtype=torch.long)
    owner = torch.full((g, length), -1, dtype=torch.long)
    source = torch.full((rows, width - 1), -1, dtype=torch.long)  # -1: the zero, placed after the extras
    extra_at: list[int] = []
    extra_targets: list[int] = []
    for r, (sub, body, members) in enumerate(units):
        first = members[0]
        ids[r, :body], pos[r, :body], seg[r, :body] = first[:body], torch.arange(body), 0
        tgt[r, :body], owner[r, :body] = first[1 : body + 1], sub[0]
        at = body
        for j, (i, s) in enumerate(zip(sub, members), start=1):
            own = len(s) - body  # this row's tokens from the body's end on (>= 1)
            ids[r, at : at + own], seg[r, at : at + own], owner[r, at : at + own] = s[body:], j, i
            pos[r, at : at + own] = torch.arange(body, len(s))
            tgt[r, at : at + own - 1] = s[body + 1 :]
            if len(s) > 1:  # token m+1 of the row is predicted at the packed place of token m
                place = torch.cat([torch.arange(body), at + torch.arange(own)])[: len(s) - 1]
                source[i, cols[i][1:] - 1] = r * length + place
            if j > 1 and body > 0 and s[body] != first[body]:  # its first own token, from the body's last
                source[i, cols[i][body] - 1] = g * length + len(extra_at)
                extra_at.append(r * length + body - 1)
                extra_targets.append(int(s[body]))
            at += own
    source[source < 0] = g * length + len(extra_at)
    first_row = torch.tensor([sub[0] for sub, _, _ in units], dtype=torch.long)
    extras = torch.tensor(extra_at, dtype=torch.long), torch.tensor(extra_targets, dtype=torch.long)
    return SharedPrefixRows(ids, pos, seg, tgt, source, first_row, owner, *extras)


def _common_prefix(seqs: list[Tensor]) -> int:
    """Length of the longest common prefix of 1-D token tensors."""
    limit = min(len(s) for s in seqs)
    first = seqs[0][:limit]
    common = limit
    for s in seqs[1:]:
        differ = torch.nonzero(s[:limit] != first).flatten()
        if len(differ):
            common = min(common, int(differ[0]))
    return common


def _body_len(members: list[Tensor]) -> int:
    """The shared body of a packed row: the common prefix c when every row goes on past it, else c - 1 (no
    row's segment may be empty)."""
    common = _common_prefix(members)
    return common if all(len(s) > common for s in members) else max(common - 1, 0)


def _packed_len(members: list[Tensor]) -> int:
    """Tokens of one packed row: the body and every row's own tokens."""
    body = _body_len(members)
    return body + sum(len(s) - body for s in members)


def _split_under(group: list[int], seqs: list[Tensor], cap: int) -> list[list[int]]:
    """Consecutive sub-groups of `group` (not empty) whose packed length stays <= cap (a lone row may
    exceed it)."""
    subs = [[group[0]]]
    for i in group[1:]:
        trial = [*subs[-1], i]
        if _packed_len([seqs[k] for k in trial]) <= cap:
            subs[-1] = trial
        else:
            subs.append([i])
    return subs
