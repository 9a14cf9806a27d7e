"""Host bytes of pixels a step: each prompt's images once (`batch.PromptImages`) against once per sample.

    python release/bench_pixels.py                          # n = 8, 336 px, 32 prompts a rank
    python release/bench_pixels.py --n 16 --size 448 --prompts 64

What a controller holds and sends for its rollout batch of P prompts x n samples, one image a prompt, built
by the library's own functions (`batch.prompt_images`, `RolloutBatch.rows`, `concat`, the balance exchange's
message `balance._message`, and the pickle the tensor-parallel broadcast sends), in two layouts:
  - per sample (before; what verl, OpenRLHF, slime and AReaL carry, and yatt_ray did): row i's pixels in a
    row field [N, I, *S], each prompt's repeated for its n samples;
  - per prompt (now): `PromptImages` [sum P_g, *S] once, rows pointing at theirs (`image_prompt`).
Pixels are real processor output: LLaVA at `--size` px (CLIP: [3, size, size] float32 an image) and Qwen2.5-VL
(its PIL processor with min/max pixels = size^2: (size/14)^2 patch rows of 1,176 float32 an image), random
images, so nothing compresses. Figures per family: the batch's pixel bytes, the bytes of the TP broadcast's
pickle of the whole batch, and of the balance exchange's message for a quarter of the groups. Ratios are
before / after, measured on the same batch. Last line:
    pixels: ratio_llava=<x> ratio_qwen=<y> batch_mb_before=<llava> batch_mb_after=<llava>
"""

from __future__ import annotations

import argparse
import pickle
import tempfile

import numpy as np
import torch
from PIL import Image

from yatt_ray.batch import Pixels, pack, prompt_images
from yatt_ray.train.balance import _message


def _images(count: int, size: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def _pixels(family: str, prompts: int, size: int) -> list[Pixels]:
    """Each prompt's processed image, as the Ray Data task gives it."""
    from yatt_ray.data.images import ClipPixels, QwenPixels

    with tempfile.TemporaryDirectory() as tmp:
        if family == "llava":
            import transformers

            processor = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
            processor(size={"shortest_edge": size}, crop_size=size).save_pretrained(tmp)
            fn = ClipPixels(tmp)
            return [Pixels(torch.from_numpy(fn([im]))) for im in _images(prompts, size, 0)]
        from yatt_ray.models.tiny_qwen_vl import build_image_processor

        build_image_processor().save_pretrained(tmp)
        qwen = QwenPixels(tmp, min_pixels=size * size, max_pixels=size * size)
        out = [qwen([im]) for im in _images(prompts, size, 0)]
    return [Pixels(torch.from_numpy(o["pixel_values"]), torch.from_numpy(o["image_grid_thw"])) for o in out]


def measure(family: str, prompts: int, n: int, size: int) -> dict[str, float]:
    pixels = _pixels(family, prompts, size)
    ids = [[1, 2, 3]] * (prompts * n)
    batch = pack(ids, [[4, 5]] * len(ids), [[0.0, 0.0]] * len(ids), pad_id=0, group_size=n)
    after = pack(ids, [[4, 5]] * len(ids), [[0.0, 0.0]] * len(ids), pad_id=0, group_size=n)
    after.images, after.image_prompt = prompt_images(pixels, n)
    per_row = torch.stack([p.values for p in pixels]).repeat_interleave(
        n, dim=0
    )  # [N, I = 1 (LLaVA) or P, *S]
    before_batch = {"rows": batch, "pixel_values": per_row}  # what the per-sample layout pickles
    moved = torch.arange(prompts // 4 * n)  # a quarter of the groups go to another rank
    return {
        "batch_before": float(per_row.nbytes),
        "batch_after": float(after.images.nbytes),
        "broadcast_before": float(len(pickle.dumps(before_batch))),
        "broadcast_after": float(len(pickle.dumps(after))),
        "message_before": float(sum(t.nbytes for t in _message(batch.rows(moved))) + per_row[moved].nbytes),
        "message_after": float(sum(t.nbytes for t in _message(after.rows(moved)))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=8, help="samples a prompt")
    parser.add_argument("--size", type=int, default=336, help="image side in pixels")
    parser.add_argument("--prompts", type=int, default=32, help="prompts a rank (256 prompts over 8 ranks)")
    args = parser.parse_args()
    ratios, mb = {}, {}
    print(f"pixels a step: {args.prompts} prompts x n={args.n}, one {args.size} px image a prompt")
    print(f"{'family':8} {'what':10} {'before MB':>10} {'after MB':>10} {'ratio':>6}")
    for family in ("llava", "qwen"):
        m = measure(family, args.prompts, args.n, args.size)
        for what in ("batch", "broadcast", "message"):
            before, after = m[f"{what}_before"] / 2**20, m[f"{what}_after"] / 2**20
            print(f"{family:8} {what:10} {before:10.1f} {after:10.1f} {before / after:6.2f}")
        ratios[family] = m["batch_before"] / m["batch_after"]
        mb[family] = (m["batch_before"] / 2**20, m["batch_after"] / 2**20)
    print(
        f"pixels: ratio_llava={ratios['llava']:.2f} ratio_qwen={ratios['qwen']:.2f} "
        f"batch_mb_before={mb['llava'][0]:.1f} batch_mb_after={mb['llava'][1]:.1f}"
    )


if __name__ == "__main__":
    main()
