"""Prompt rows -> what the rollout engine and the trainer read: the prompt's text, its token ids, its images.

A row's prompt is a string, or a list of chat messages rendered by the tokenizer's chat template with the
generation prompt (`yatt_ray.data.images.prompt_text`); `system_prompt` (data.system_prompt) leads a chat
without a system message, and turns a string prompt into [system, user] messages rendered the same way. For a vision-language policy (`ImageLayout` from its
config.json) each `<image>` placeholder becomes `tokens_per_image` copies of the image token, as the model's
processor does, so the rollout engine and the trainer see the same token positions; the row's pixels
(`images.PIXELS`, [I, 3, H, W] from the Ray Data task) travel beside the ids. A row without images (I = 0:
its cell null or empty, its prompt without `<image>`) gets pixels [0, C, H, W] in the model's image shape, so
every consumer (engine, `batch.stack_images`, the balance exchange, the trainer) reads "no images" as I = 0
and needs no case of its own (the Ray Data task cannot know the shape without an image: it gives
[0, 3, 0, 0]).

Prompts longer than `data.max_prompt_tokens` keep their last tokens (counted in `prompts_clipped`), unless
that would cut an image's tokens: that is a DataError naming the row and the length it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from yatt_ray.data.images import PIXELS, prompt_text
from yatt_ray.errors import DataError
from yatt_ray.train.hf_convert import is_vision_model
from yatt_ray.train.vision import (
    expand_image_tokens,
    image_shape,
    image_token_id,
    llava_config,
    tokens_per_image,
)


@dataclass(frozen=True)
class ImageLayout:
    """How a LLaVA policy reads an image: the id of its image token, how many positions one image takes, and
    the (channels, height, width) of the pixel_values its vision tower takes."""

    token_id: int
    tokens_per_image: int
    image_shape: tuple[int, int, int]

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ImageLayout | None:
        """From `<path>/config.json` (`train.vision`'s readers): None for a text model (or no config.json: the
        driver checked the model)."""
        if not is_vision_model(path):
            return None
        config = llava_config(path)
        return cls(image_token_id(config), tokens_per_image(config), image_shape(config))


@dataclass(frozen=True)
class Encoded:
    """One prompt: `text` (what the reward sees), token `ids` (images expanded, clipped), whether it was
    clipped, and its images' pixels [I, C, H, W] float32 (I = 0 for a row without images; None for a text
    policy)."""

    text: str
    ids: list[int]
    clipped: bool
    pixels: torch.Tensor | None = None


class PromptEncoder:
    """`encode(row)` for a row of the prompt stream (column -> value; `id`, `prompt`, and for a vision policy
    `images.PIXELS`); `system_prompt`: data.system_prompt ("" = none, see `prompt_text`)."""

    def __init__(
        self, tokenizer: Any, max_tokens: int, layout: ImageLayout | None = None, system_prompt: str = ""
    ) -> None:
        self.tokenizer, self.max_tokens, self.layout = tokenizer, max_tokens, layout
        self.system_prompt = system_prompt

    def encode(self, row: dict) -> Encoded:
        text = prompt_text(
            row["prompt"], self.tokenizer, row_id=row.get("id"), system_prompt=self.system_prompt
        )
        ids = list(self.tokenizer(text)["input_ids"])
        pixels = None
        if self.layout is not None:
            pixels = torch.from_numpy(
                np.array(row[PIXELS], dtype=np.float32)
            )  # a copy: Ray hands read-only arrays
            if len(pixels) == 0:  # no images: [0, C, H, W] in the model's shape (the data task: [0, 3, 0, 0])
                pixels = torch.zeros((0, *self.layout.image_shape), dtype=torch.float32)
            ids = expand_image_tokens(ids, self.layout.token_id, self.layout.tokens_per_image, len(pixels))
        clipped = len(ids) > self.max_tokens
        if clipped:
            cut = ids[: len(ids) - self.max_tokens]
            if self.layout is not None and self.layout.token_id in cut:
                raise DataError(
                    f"prompt id {row.get('id')!r}: {len(ids)} tokens with its images' tokens, more than "
                    f"data.max_prompt_tokens={self.max_tokens}, and keeping the last ones would cut an image; "
                    f"raise data.max_prompt_tokens to at least {len(ids)}"
                )
            ids = ids[-self.max_tokens :]
        return Encoded(text, ids, clipped, pixels)
