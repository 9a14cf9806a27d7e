"""Split a batch's rows into micro-batches: a fixed number of rows, or a token budget (dynamic batching).

Both forms keep a group (a prompt's `group_size` consecutive samples) in one micro-batch and return lists of
row indices; the trainer runs one forward (and backward) per list and writes per-row results back at those
indices, so callers always get rows in their original order.

Fixed size: with k = max(1, micro_batch_size // group_size) groups per micro-batch, the G groups go into
M = ceil(G / k) micro-batches of equal group count (sizes differ by at most one, none above k), taken in order
of decreasing real tokens: the layers run a micro-batch's real tokens only (`SharedPrefixRows.flat`), but its
attention pads every group to the longest (whole masked rows), so groups of similar length together waste the
least there (micro-batches run one after
another, so balancing their sums would buy nothing; balancing across data-parallel ranks is `balance.py`'s).
The longest groups share the first micro-batch, whose padded size, k x the longest, is what any split of the
same counts has at its largest. Rows within a micro-batch are ascending; micro-batches are ordered by their
first row.

Token budget: `plan_micro_batches` plans units (groups) of given lengths so that (units x longest unit) stays
within the budget: `packing.pack_shared_prefix` packs each group into one row, padded to the micro-batch's
longest (the layers then run only the real tokens, so the budget bounds them from above; the attention's
padded rows are what it bounds exactly). A group's real tokens bound its packed length from above,
so they are its planning length. Units are taken in order of DECREASING length (ties by index), and each
micro-batch is filled greedily until the next unit would push the cost over the budget. Sorting first keeps
units of similar length together, so little of the budget is spent on padding, and the first unit of a
micro-batch always sets its width.
"""

from __future__ import annotations

import torch


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group row indices so that len(group) * max(lengths of the group) <= max_tokens.

    Args:
        lengths: real (unpadded) length of each row; a length of 0 counts as 1 (an empty row still takes a
            row of the packed micro-batch).
        max_tokens: the budget per micro-batch, >= 1.
    Returns:
        Lists of row indices covering every row exactly once: rows sorted by decreasing length (stable),
        packed greedily. A row longer than the budget gets a micro-batch of its own. [] for no rows.
    Raises:
        ValueError: max_tokens < 1 or a negative length.
    """
    if max_tokens < 1:
        raise ValueError(
            f"max_tokens_per_micro_batch={max_tokens} must be >= 1; give a budget of at least the longest "
            "sequence, or None to split by micro_batch_size."
        )
    if any(n < 0 for n in lengths):
        raise ValueError(f"row lengths must be >= 0, got {lengths}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    width = 0  # longest row of the current micro-batch (its first row, since rows come longest first)
    for i in order:
        cost = max(lengths[i], 1)
        if plan and (len(plan[-1]) + 1) * width <= max_tokens:
            plan[-1].append(i)
        else:
            plan.append([i])
            width = cost
    return plan


def micro_batch_indices(
    attention_mask: torch.Tensor, micro_batch_size: int | None, max_tokens: int | None, group_size: int = 1
) -> list[list[int]]:
    """Row-index lists for one pass over a [B, T] batch; each group of `group_size` consecutive rows (a
    prompt's samples, packed together by `packing.pack_shared_prefix`) stays in one micro-batch.

    With `max_tokens` (the token budget) the groups are planned by `plan_micro_batches` over their packed
    lengths and `micro_batch_size` is ignored; otherwise ceil(G / k) micro-batches of k = `micro_batch_size`
    rows rounded down to whole groups (at least one group) or fewer, of equal group count, groups of similar
    real tokens together (longest first; see the module docstring).
    """
    rows = attention_mask.shape[0]
    groups = [list(range(s, min(s + group_size, rows))) for s in range(0, rows, group_size)]
    lengths = [int(attention_mask[g].sum()) for g in groups]  # >= the group's packed length
    if max_tokens is not None:
        return [[i for k in plan for i in groups[k]] for plan in plan_micro_batches(lengths, max_tokens)]
    if micro_batch_size is None or micro_batch_size < 1:
        raise ValueError(
            f"micro_batch_size={micro_batch_size}: give a micro_batch_size >= 1 or a "
            "max_tokens_per_micro_batch budget."
        )
    per_micro = max(1, micro_batch_size // group_size)
    order = sorted(range(len(groups)), key=lambda k: (-lengths[k], k))
    parts = [sorted(p.tolist()) for p in torch.tensor(order).tensor_split(-(-len(groups) // per_micro))]
    plan = [[i for k in part for i in groups[k]] for part in parts if part]
    return sorted(plan, key=lambda m: m[0])


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`. A host tensor bound for a GPU is copied from pinned memory without blocking: a
    copy from pageable memory makes the host wait for every kernel queued before it (the previous
    micro-batch's backward), while this one lets the host pack the next micro-batch as the GPU runs."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def select_rows(batch: dict, rows: int, index: list[int], device) -> dict:
    """The micro-batch of `batch` at row `index`: every tensor with `rows` rows is indexed (and moved to
    `device`); other values are passed whole."""
    idx = torch.tensor(index, dtype=torch.long)
    contiguous = index == list(range(index[0], index[0] + len(index))) if index else False
    out = {}
    for key, value in batch.items():
        if torch.is_tensor(value) and value.ndim > 0 and value.shape[0] == rows:
            part = (
                value[index[0] : index[0] + len(index)]
                if contiguous
                else value.index_select(0, idx.to(value.device))
            )
            out[key] = to_device(part, device)
        else:
            out[key] = value
    return out


def mini_batch_rows(rows: int, group_size: int, count: int) -> list[torch.Tensor]:
    """The row indices of `count` PPO mini-batches over `rows` rows: whole groups of `group_size` consecutive
    rows each (a group's samples share their prompt, which packing computes once, and a vision policy's
    images), the G = rows / group_size groups in order, min(count, G) mini-batches whose group counts differ
    by at most one. Raises ValueError when the rows are not whole groups."""
    if group_size < 1 or rows % group_size:
        raise ValueError(f"{rows} rows are not whole groups of {group_size}")
    groups = [g for g in torch.arange(rows // group_size).tensor_split(count) if len(g)]
    return [(g[:, None] * group_size + torch.arange(group_size)[None, :]).reshape(-1) for g in groups]


def keep_one_group(trained: torch.Tensor, group_size: int, attention_mask: torch.Tensor) -> torch.Tensor:
    """The row indices to train of a mini-batch whose rows `trained` [N] (bool, whole groups of `group_size`
    consecutive rows alike) marks: those rows, or when none is marked, the group with the fewest real tokens
    (`attention_mask` [N, T]), so every rank still runs a forward and backward (its gradient is then 0)."""
    if bool(trained.any()):
        return torch.nonzero(trained).flatten()
    tokens = attention_mask.sum(dim=1).view(-1, group_size).sum(dim=1)
    first = int(torch.argmin(tokens)) * group_size
    return torch.arange(first, first + group_size)
