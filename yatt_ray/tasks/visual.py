"""A visual verifiable task: add the numbers drawn in the prompt's image(s).

Each row holds `prompt` ("<image>Sum:"), `images` ([{"bytes": <png>}], the layout of `yatt_ray.data.images`),
`ground_truth` ("12"), `data_source` ("visual_sum") and a unique `id`. With one image per prompt the image shows
"a+b"; with `images_per_prompt=k >= 2` each of the k images shows one number and the answer is their sum
(prompt "<image>" * k + "Sum:"). The rule reward is `exact_match` (`yatt_ray.reward.rules`): the answer is
`str(sum)`, exactly what it compares (stripped), so the task needs no reward of its own.

Glyphs: seven-segment digits drawn as filled rectangles, white on black, sized from the image (a digit is 3/4
of its cell wide, 0.8 of the image high at most, strokes 1/5 of the digit's width, at least 1 px). Not a font:
PIL's default font is a FreeType font or a small bitmap depending on how Pillow was built, so the bytes would
differ between machines, and a bitmap glyph scaled up is blurry. Seven segments at fixed places are the easiest
digits a tiny vision tower can learn at 32-48 px: each digit is which of 7 bars are lit, at known positions
(at 32 px square, one image of "a+b": digits 8 x 16 px with 2 px strokes).

Size: `noise=A` fills the background with uniform levels in [0, A) per channel (the glyphs stay 255, so they remain
clear), which PNG cannot compress: the bytes then grow with the area (`image_size`) and the image count, for
benchmarks of the data path. PNG bytes per row measured (one image per prompt, seed 0, mean of 64 rows):

    image_size      32      64     128     256      512
    noise=0        171     229     395     760     1788
    noise=64      2450    8967   35905  142270   560453

so noise=64 grows a row ~230x from 32 to 512 px, and `images_per_prompt=4` (32 px, noise 64) gives 9611 bytes a
row (4x). Rendering and encoding take 0.3 ms a row at 32 px and 32 ms at 512 px with noise (one CPU core).

`write_rows` writes parquet (the image column as list<struct<bytes: binary, path: string>>, bytes inline) or
jsonl (which cannot hold bytes: each image goes to a png file beside it and the entry is {"path": <its path or
URL>}, the form verl's jsonl data uses).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import fsspec
import numpy as np
from PIL import Image, ImageDraw

from yatt_ray.data.images import IMAGE_PLACEHOLDER, image_arrow_type

DATA_SOURCE = "visual_sum"
REWARD_FUNCTION = "exact_match"  # yatt_ray.reward.rules: the answer is str(sum)
PROMPT_SUFFIX = "Sum:"
DEFAULT_IMAGE_SIZE = 32
# which of the segments a (top), b (top right), c (bottom right), d (bottom), e (bottom left), f (top left)
# and g (middle) each digit lights
SEGMENTS = {
    0: "abcdef",
    1: "bc",
    2: "abdeg",
    3: "abcdg",
    4: "bcfg",
    5: "acdfg",
    6: "acdefg",
    7: "abc",
    8: "abcdefg",
    9: "abcdfg",
}


def make_problems(
    count: int,
    seed: int,
    max_operand: int = 9,
    image_size: int | tuple[int, int] = DEFAULT_IMAGE_SIZE,
    images_per_prompt: int = 1,
    noise: int = 0,
    id_offset: int = 0,
) -> list[dict]:
    """`count` rows (module docstring), numbers 0..max_operand drawn with a fixed seed.

    `image_size`: the side of a square image, or (width, height). `noise`: the background noise amplitude,
    0..255 (0: plain black). Rows are a prefix-stable stream: `make_problems(n, s)` is the start of
    `make_problems(m, s)` for m > n, and the numbers do not depend on `image_size` or `noise`.
    """
    width, height = (image_size, image_size) if isinstance(image_size, int) else image_size
    if max_operand < 0 or images_per_prompt < 1 or not 0 <= noise <= 255:
        raise ValueError(
            "need max_operand >= 0, images_per_prompt >= 1 and 0 <= noise <= 255; got "
            f"max_operand={max_operand}, images_per_prompt={images_per_prompt}, noise={noise}"
        )
    terms = max(2, images_per_prompt)
    cells = terms * len(str(max_operand)) + 1 if images_per_prompt == 1 else len(str(max_operand))
    if width // cells < 4 or height < 8:
        raise ValueError(
            f"image_size={image_size} is too small for {cells} glyph(s) side by side (a glyph needs 4 x 8 px); "
            f"give at least ({4 * cells}, 8), or fewer digits (max_operand={max_operand})"
        )
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        numbers = [rng.randint(0, max_operand) for _ in range(terms)]
        noise_rng = np.random.default_rng(rng.getrandbits(64))
        groups = [numbers] if images_per_prompt == 1 else [[n] for n in numbers]
        images = [
            {"bytes": png_bytes(render(g, width, height, len(str(max_operand)), noise, noise_rng))}
            for g in groups
        ]
        rows.append(
            {
                "id": id_offset + i,
                "prompt": IMAGE_PLACEHOLDER * len(images) + PROMPT_SUFFIX,
                "ground_truth": str(sum(numbers)),
                "data_source": DATA_SOURCE,
                "images": images,
            }
        )
    return rows


GEO3K_SOURCE = "hiyouga/geometry3k"  # verl's geo3k data_source: `reward.function=math` reads boxed answers
GEO3K_INSTRUCTION = " Put the final answer in \\boxed{}."


def as_geo3k(rows: list[dict], split: str = "train") -> list[dict]:
    """`make_problems` rows in the layout of verl's geometry3k parquet files: `prompt` a one-message chat list
    ([{"role": "user", "content": "<image>Sum: ... \\boxed{}."}]), `images` entries {"bytes", "path": None},
    `reward_model` {"style": "rule", "ground_truth"}, `extra_info` {"split", "index", "answer", "question"},
    `data_source` GEO3K_SOURCE, `ability` "math": read with data.answer_key=reward_model.ground_truth and
    data.id_key=extra_info.index, as examples/configs/grpo_qwen_vl_geo3k.yaml does."""
    out = []
    for r in rows:
        question = r["prompt"] + GEO3K_INSTRUCTION
        out.append({
            "data_source": GEO3K_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "images": [{"bytes": im.get("bytes"), "path": im.get("path")} for im in r.get("images") or []],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
            "extra_info": {"split": split, "index": r["id"], "answer": r["ground_truth"], "question": question},
        })  # fmt: skip
    return out


def render(
    numbers: list[int],
    width: int,
    height: int,
    digits: int,
    noise: int = 0,
    rng: np.random.Generator | None = None,
) -> Image.Image:
    """An RGB image [height, width] of `numbers` side by side, each right-aligned in `digits` cells, joined by
    "+" cells, in seven-segment glyphs (module docstring); background levels uniform in [0, noise) per channel."""
    cells: list[str] = []
    for k, n in enumerate(numbers):
        if k:
            cells.append("+")
        cells.extend(str(n).rjust(digits))
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    cell_w = width / len(cells)
    for k, glyph in enumerate(cells):
        if glyph != " ":
            _draw_glyph(draw, glyph, k * cell_w, cell_w, height)
    lit = np.asarray(mask) > 0
    background = np.zeros((height, width, 3), dtype=np.uint8)
    if noise:
        rng = rng if rng is not None else np.random.default_rng(0)
        background = rng.integers(0, noise, size=(height, width, 3), dtype=np.uint8)
    background[lit] = 255
    return Image.fromarray(background, "RGB")


def _draw_glyph(draw: ImageDraw.ImageDraw, glyph: str, x0: float, cell_w: float, height: int) -> None:
    """One digit (or "+") centred in the cell [x0, x0 + cell_w) x [0, height)."""
    h = height * 0.8
    w = min(cell_w * 0.75, h * 0.55)
    t = max(1.0, w / 5)  # stroke width
    left, top = x0 + (cell_w - w) / 2, (height - h) / 2
    right, bottom, mid = left + w, top + h, top + h / 2
    if glyph == "+":
        boxes = [
            (left, mid - t / 2, right, mid + t / 2),
            ((left + right - t) / 2, mid - w / 2, (left + right + t) / 2, mid + w / 2),
        ]
    else:
        bars = {
            "a": (left, top, right, top + t),
            "b": (right - t, top, right, mid),
            "c": (right - t, mid, right, bottom),
            "d": (left, bottom - t, right, bottom),
            "e": (left, mid, left + t, bottom),
            "f": (left, top, left + t, mid),
            "g": (left, mid - t / 2, right, mid + t / 2),
        }
        boxes = [bars[s] for s in SEGMENTS[int(glyph)]]
    for x_a, y_a, x_b, y_b in boxes:  # pixel (x, y) is lit when its centre lies in the box
        draw.rectangle((round(x_a), round(y_a), round(x_b) - 1, round(y_b) - 1), fill=255)


def png_bytes(image: Image.Image) -> bytes:
    """The image encoded as PNG (deterministic for the same pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_rows(rows: list[dict], path: str | Path) -> str:
    """Write rows to `path` (a local path or fsspec URL; .parquet or .jsonl) and return it.

    parquet: the images column typed list<struct<bytes: binary, path: string>> (bytes inline, path null).
    jsonl: each image written as `<stem>_images/<id>_<k>.png` beside the file, the entry {"path": <its
    absolute path, or URL>} (JSON has no bytes). Local files are written atomically (a temporary name renamed).
    """
    url = str(path)
    if url.endswith(".parquet"):
        _write_parquet(rows, url)
    elif url.endswith(".jsonl"):
        _write_jsonl(rows, url)
    else:
        raise ValueError(f"write_rows: {url!r} has an unknown extension; use .parquet or .jsonl")
    return url


def _write_parquet(rows: list[dict], url: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "images"} for r in rows])
    if rows and "images" in rows[0]:
        table = table.append_column("images", pa.array([r["images"] for r in rows], type=image_arrow_type()))
    with _atomic(url, "wb") as f:
        pq.write_table(table, f)


def _write_jsonl(rows: list[dict], url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    folder = path[: -len(".jsonl")] + "_images"
    fs.makedirs(folder, exist_ok=True)
    lines = []
    for r in rows:
        entries = []
        for k, entry in enumerate(r.get("images") or []):
            target = f"{folder}/{r['id']}_{k}.png"
            with fs.open(target, "wb") as f:
                f.write(entry["bytes"])
            entries.append(
                {"path": fs.unstrip_protocol(target) if "://" in url else str(Path(target).resolve())}
            )
        lines.append(json.dumps({**r, "images": entries} if "images" in r else r) + "\n")
    with _atomic(url, "w") as f:
        f.writelines(lines)


class _atomic:
    """Open `url` for writing; a local file is written under a temporary name and renamed on success."""

    def __init__(self, url: str, mode: str) -> None:
        self.url, self.mode = url, mode
        self.local = "://" not in url or url.startswith("file://")

    def __enter__(self):
        if self.local:
            self.path = Path(self.url.removeprefix("file://"))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = self.path.with_name(self.path.name + ".tmp")
            self.file = open(self.tmp, self.mode)  # noqa: SIM115 (closed in __exit__)
        else:
            self.file = fsspec.open(self.url, self.mode).open()
        return self.file

    def __exit__(self, kind, value, tb) -> None:
        self.file.close()
        if self.local:
            if kind is None:
                self.tmp.rename(self.path)
            else:
                self.tmp.unlink(missing_ok=True)
