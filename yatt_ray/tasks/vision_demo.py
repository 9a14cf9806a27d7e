"""The embedded vision demo (`demo.task=vision`): a tiny vision-language model, warmed up on the visual sum task.

`build_warm_vlm` builds the tiny model of `demo.vision_model` (llava: `yatt_ray.models.tiny_vlm`, a CLIP
vision tower, the LLaVA projector, the tiny Llama; qwen2_5_vl: `yatt_ray.models.tiny_qwen_vl`, Qwen's vision
transformer and merger before a tiny Qwen2 with M-RoPE) and trains ALL of it with next-token loss on the
answers of fresh problems (`yatt_ray.tasks.visual`: two seven-segment digits drawn as "a+b", the prompt
"<image>Sum:", the answer the sum), so that the tower learns to see the digits and the model is sometimes
right; GRPO then trains the language model (the tower frozen, `model.train_vision=none` by default) from
there. Prompts and images go through the run's own path: the model directory's image processor
(`images.pixels_processor`) and `prompts.PromptEncoder` (the image tokens expanded as the engine and the
trainer see them).
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
    """Random tiny vision-language model (`demo.vision_model`) -> `demo.sft_steps` AdamW steps (batches of
    SFT_BATCH fresh problems, constant `lr`, gradients clipped at 1) -> the HF directory `model_dir` (written
    whole, then renamed into place)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from yatt_ray.batch import PromptImages
    from yatt_ray.data.images import GRID, PIXELS, pixels_processor
    from yatt_ray.model_dir import ImageLayout
    from yatt_ray.prompts import PromptEncoder

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    if demo.vision_model == "qwen2_5_vl":
        from yatt_ray.models.tiny_qwen_vl import build_tiny_qwen_vl

        build_tiny_qwen_vl(tmp)
    else:
        from yatt_ray.models.tiny_vlm import build_tiny_vlm

        build_tiny_vlm(tmp)
    model = AutoModelForImageTextToText.from_pretrained(tmp, dtype=torch.float32)
    layout = ImageLayout.from_model_dir(tmp)
    assert layout is not None
    encoder = PromptEncoder(AutoTokenizer.from_pretrained(tmp), 10**6, layout)
    tokenizer, pixels = encoder.tokenizer, pixels_processor(str(tmp))
    rows = visual.make_problems(demo.sft_steps * SFT_BATCH, seed=1, id_offset=10**9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    model.train()
    for start in range(0, len(rows), SFT_BATCH):
        batch = rows[start : start + SFT_BATCH]
        encoded = []
        for r in batch:
            out = pixels([Image.open(io.BytesIO(e["bytes"])) for e in r["images"]])
            values = out if layout.merge == 1 else out["pixel_values"]
            grid = {} if layout.merge == 1 else {GRID: out["image_grid_thw"]}
            encoded.append(encoder.encode({"prompt": r["prompt"], PIXELS: values, **grid}))
        targets = [
            tokenizer(r["ground_truth"], add_special_tokens=False)["input_ids"] + [EOS_ID] for r in batch
        ]
        input_ids, labels, mask = _right_padded([e.ids for e in encoded], targets)
        images = PromptImages.of([e.pixels for e in encoded if e.pixels is not None])
        extra = {"pixel_values": images.values}
        if images.grid is not None:  # Qwen VL: the grids, and which tokens are image tokens (M-RoPE)
            extra.update(image_grid_thw=images.grid, mm_token_type_ids=(input_ids == layout.token_id).int())
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels, **extra).loss
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
