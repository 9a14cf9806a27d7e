"""Prompt rows -> what the rollout engine and the trainer read: the prompt's text, its token ids, its images.

A row's prompt is a string, or a list of chat messages rendered by the tokenizer's chat template with the
generation prompt (`yatt_ray.data.images.prompt_text`); `system_prompt` (data.system_prompt) leads a chat
without a system message, and turns a string prompt into [system, user] messages rendered the same way. For a vision-language policy (`ImageLayout` from its
config.json) each `<image>` placeholder becomes the image's tokens, as the model's processor does (LLaVA:
`tokens_per_image` image tokens; Qwen VL: `<|vision_start|>`, t*h*w / 4 `<|image_pad|>`, `<|vision_end|>`),
so the rollout engine and the trainer see the same token positions; the row's pixels (`batch.Pixels` from the
Ray Data task's `images.PIXELS` and, for Qwen VL, `images.GRID`) travel beside the ids. A row without images
(its cell null or empty, its prompt without `<image>`) gets pixels [0, *S] in the model's row shape, so every
consumer (engine, `batch.PromptImages`, the balance exchange, the trainer) reads "no images" as I = 0 and needs
no case of its own.

Prompts longer than `data.max_prompt_tokens` keep their last tokens (counted in `prompts_clipped`), unless
that would cut an image's tokens: that is a DataError naming the row and the length it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from yatt_ray.batch import Pixels
from yatt_ray.data.images import GRID, IMAGE_PLACEHOLDER, PIXELS, prompt_text
from yatt_ray.errors import DataError
from yatt_ray.model_dir import ImageLayout, expand_image_tokens


@dataclass(frozen=True)
class Encoded:
    """One prompt: `text` (what the reward sees), token `ids` (images expanded, clipped), whether it was
    clipped, and its images' `Pixels` (I = 0 for a row without images; None for a text policy)."""

    text: str
    ids: list[int]
    clipped: bool
    pixels: Pixels | None = None


class PromptEncoder:
    """`encode(row)` for a row of the prompt stream (column -> value; `id`, `prompt`, and for a vision policy
    `images.PIXELS` (and `images.GRID` for Qwen VL)); `system_prompt`: data.system_prompt ("" = none, see
    `prompt_text`)."""

    def __init__(
        self, tokenizer: Any, max_tokens: int, layout: ImageLayout | None = None, system_prompt: str = ""
    ) -> None:
        self.tokenizer, self.max_tokens, self.layout = tokenizer, max_tokens, layout
        self.system_prompt = system_prompt

    def encode(self, row: dict) -> Encoded:
        text = prompt_text(
            row["prompt"], self.tokenizer, row_id=row.get("id"), system_prompt=self.system_prompt
        )
        layout = self.layout
        pixels = None
        if layout is None:
            ids = list(self.tokenizer(text)["input_ids"])
        else:
            pixels = self._pixels(row)
            tokenized = text.replace(IMAGE_PLACEHOLDER, layout.placeholder)
            ids = list(self.tokenizer(tokenized)["input_ids"])
            ids = expand_image_tokens(ids, layout.token_id, layout.image_tokens(pixels), pixels.count)
        clipped = len(ids) > self.max_tokens
        if clipped:
            cut = ids[: len(ids) - self.max_tokens]
            if layout is not None and layout.token_id in cut:
                raise DataError(
                    f"prompt id {row.get('id')!r}: {len(ids)} tokens with its images' tokens, more than "
                    f"data.max_prompt_tokens={self.max_tokens}, and keeping the last ones would cut an image; "
                    f"raise data.max_prompt_tokens to at least {len(ids)} (or lower data.max_pixels)"
                )
            ids = ids[-self.max_tokens :]
        return Encoded(text, ids, clipped, pixels)

    def _pixels(self, row: dict) -> Pixels:
        """The row's pixels in the model's row shape (a copy: Ray hands read-only arrays); no images: [0, *S]
        (the data task cannot know S without an image)."""
        assert self.layout is not None
        values = torch.from_numpy(np.array(row[PIXELS], dtype=np.float32))
        grid = None
        if self.layout.merge > 1:
            grid = torch.from_numpy(np.array(row.get(GRID, np.zeros((0, 3))), dtype=np.int64)).reshape(-1, 3)
        if len(values) == 0:
            values = torch.zeros((0, *self.layout.pixel_shape), dtype=torch.float32)
        return Pixels(values, grid)
