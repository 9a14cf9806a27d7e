"""Split a batch's rows into micro-batches: a fixed number of rows, or a token budget (dynamic batching).

Both forms return lists of row indices; the trainer runs one forward (and backward) per list and writes
per-row results back at those indices, so callers always get rows in their original order.

Token budget: the cost of a micro-batch is (rows x longest real length among them), which is what the packed
forward computes (`packing.pack_rows` trims every micro-batch to its longest real row). Rows are taken in
order of DECREASING real length (ties by row index), and each micro-batch is filled greedily until the next
row would push the cost over the budget. Sorting first keeps rows of similar length together, so little of
the budget is spent on padding, and the first row of a micro-batch always sets its width.
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
    attention_mask: torch.Tensor, micro_batch_size: int | None, max_tokens: int | None
) -> list[list[int]]:
    """Row-index lists for one pass over a [B, T] batch.

    With `max_tokens` (the token budget) the rows are planned by `plan_micro_batches` over their real lengths
    and `micro_batch_size` is ignored; otherwise consecutive chunks of `micro_batch_size` rows.
    """
    rows = attention_mask.shape[0]
    if max_tokens is not None:
        return plan_micro_batches(attention_mask.sum(dim=1).tolist(), max_tokens)
    if micro_batch_size is None or micro_batch_size < 1:
        raise ValueError(
            f"micro_batch_size={micro_batch_size}: give a micro_batch_size >= 1 or a "
            "max_tokens_per_micro_batch budget."
        )
    return [list(range(s, min(s + micro_batch_size, rows))) for s in range(0, rows, micro_batch_size)]


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
            out[key] = part.to(device)
        else:
            out[key] = value
    return out
