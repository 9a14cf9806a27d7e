"""The prompt budget, checked on the driver before the cluster starts.

The first `SAMPLE_ROWS` rows of the training files are read as a controller reads them (`EvalRows`: the same
columns, and for a vision policy the same image decoding and processor) and encoded as the rollout encodes them
(`PromptEncoder`: the chat template, data.system_prompt, each image's tokens), so a length here is the length
a trainer would see. Against data.max_prompt_tokens:

* a vision prompt over the budget is refused here (`DataError`, the row and the budget it needs): the rollout
  keeps a long prompt's last tokens, which would cut its image's tokens, and fail inside a training worker;
* text prompts over it are named in a warning (how many of the rows read, the longest and its id): the rollout
  keeps their last tokens (counted as `prompts_clipped` each step), which cuts the start of the question.
"""

from __future__ import annotations

import logging
from typing import Any

from yatt_ray.config import DataConfig
from yatt_ray.errors import DataError

log = logging.getLogger(__name__)
SAMPLE_ROWS = 256  # the rows read: the first of the first file(s), in the order an epoch starts from


def prompt_lengths(
    data: DataConfig, files: list[str], model_dir: str, rows: int = SAMPLE_ROWS
) -> list[tuple]:
    """(row id, prompt tokens, the index of its first image token or None) for the first `rows` rows of
    `files`, each prompt encoded whole (no budget) as the rollout encodes it."""
    from transformers import AutoTokenizer

    from yatt_ray.data.eval_rows import EvalRows
    from yatt_ray.data.images import pixels_processor
    from yatt_ray.model_dir import ImageLayout
    from yatt_ray.prompts import PromptEncoder

    layout = ImageLayout.from_model_dir(model_dir)
    pixels = None if layout is None else pixels_processor(model_dir, data.min_pixels, data.max_pixels)
    batch = next(iter(EvalRows(data, files, 0, 1, pixels, batch_size=rows).batches()), None)
    if batch is None:
        return []
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(model_dir), 10**9, layout, data.system_prompt)
    out = []
    for i in range(len(batch["id"])):
        row: dict[str, Any] = {key: column[i] for key, column in batch.items()}
        if row.get("image_error"):  # a bad image: counted and skipped by the stream (data.on_bad_image)
            continue
        ids = encoder.encode(row).ids
        first_image = ids.index(layout.token_id) if layout is not None and layout.token_id in ids else None
        row_id = row["id"].item() if hasattr(row["id"], "item") else row["id"]  # numpy scalar -> Python
        out.append((row_id, len(ids), first_image))
    return out


def check_prompt_budget(data: DataConfig, files: list[str], model_dir: str) -> str:
    """DataError when a prompt with images among the first rows is longer than data.max_prompt_tokens; a
    warning when text prompts are (see the module docstring). Returns a line for the run's log."""
    budget = data.max_prompt_tokens
    lengths = prompt_lengths(data, files, model_dir)
    if not lengths:
        return "prompt budget: no row read"
    longest = max(lengths, key=lambda r: r[1])
    over = [r for r in lengths if r[1] > budget]
    cut = [r for r in over if r[2] is not None and r[2] < r[1] - budget]
    if cut:
        row_id, tokens, _ = max(cut, key=lambda r: r[1])
        raise DataError(
            f"{len(cut)} of the first {len(lengths)} training prompts are longer than data.max_prompt_tokens="
            f"{budget} with their images' tokens (the longest, row {row_id!r}: {tokens} tokens), and keeping a "
            f"prompt's last tokens would cut an image. Raise data.max_prompt_tokens to at least "
            f"{longest[1]} (or lower data.max_pixels, which sizes each image's tokens)"
        )
    if over:
        log.warning(
            "%d of the first %d training prompts are longer than data.max_prompt_tokens=%d (the longest, row %r: "
            "%d tokens): the rollout keeps their last %d tokens, cutting the start of the prompt. Raise "
            "data.max_prompt_tokens to %d to keep them whole",
            len(over), len(lengths), budget, longest[0], longest[1], budget, longest[1],
        )  # fmt: skip
    return f"prompt budget: the longest of the first {len(lengths)} prompts {longest[1]} tokens of {budget}"
