"""The embedded vision demo (`demo.task=vision`): the tiny LLaVA, warmed up on the visual sum task.

`build_warm_vlm` builds the tiny vision-language model (`yatt_ray.models.tiny_vlm`: a CLIP vision tower, the
LLaVA projector, the tiny Llama) and trains ALL of it with next-token loss on the answers of fresh problems
(`yatt_ray.tasks.visual`: two seven-segment digits drawn as "a+b", the prompt "<image>Sum:", the answer the
sum), so that the tower learns to see the digits and the model is sometimes right; GRPO then trains the
language model (the tower frozen, `model.train_vision=none` by default) from there. The images go through
the model directory's own CLIP image processor, as in a run.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from yatt_ray.config import DemoConfig
from yatt_ray.models.tiny import EOS_ID
from yatt_ray.tasks import visual

SFT_BATCH = 64


def build_warm_vlm(model_dir: Path, demo: DemoConfig, lr: float = 1e-3) -> None:
    """Random tiny LLaVA -> `demo.sft_steps` AdamW steps (batches of SFT_BATCH fresh problems, constant `lr`,
    gradients clipped at 1) -> the HF directory `model_dir` (written whole, then renamed into place)."""
    from PIL import Image
    from transformers import AutoTokenizer, LlavaForConditionalGeneration

    from yatt_ray.data.images import ClipPixels
    from yatt_ray.models.tiny_vlm import build_tiny_vlm
    from yatt_ray.prompts import ImageLayout
    from yatt_ray.train.vision import expand_image_tokens

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    build_tiny_vlm(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = LlavaForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32)
    layout = ImageLayout.from_model_dir(tmp)
    assert layout is not None
    pixels = ClipPixels(str(tmp))
    rows = visual.make_problems(demo.sft_steps * SFT_BATCH, seed=1, id_offset=10**9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    model.train()
    for start in range(0, len(rows), SFT_BATCH):
        batch = rows[start : start + SFT_BATCH]
        prompts = [
            expand_image_tokens(tokenizer(r["prompt"])["input_ids"], layout.token_id, layout.tokens_per_image)
            for r in batch
        ]
        targets = [
            tokenizer(r["ground_truth"], add_special_tokens=False)["input_ids"] + [EOS_ID] for r in batch
        ]
        input_ids, labels, mask = _right_padded(prompts, targets)
        images: list[Image.Image] = [Image.open(io.BytesIO(e["bytes"])) for r in batch for e in r["images"]]
        values = torch.from_numpy(pixels(images))
        loss = model(input_ids=input_ids, attention_mask=mask, pixel_values=values, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.save_pretrained(tmp)
    tmp.rename(model_dir)  # atomic: a half-built model is never reused


def _right_padded(
    prompts: list[list[int]], targets: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T] input ids (prompt + target), labels (-100 on the prompt and padding), attention mask."""
    width = max(len(p) + len(t) for p, t in zip(prompts, targets))
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    mask = torch.zeros_like(input_ids)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
        mask[i, : len(p) + len(t)] = 1
    return input_ids, labels, mask
