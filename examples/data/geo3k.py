"""Geometry3K (hiyouga/geometry3k) as verl-layout parquet with an `images` column of {bytes, path} structs.

    python examples/data/geo3k.py --out s3://$BUCKET/geo3k

Each figure is stored as PNG bytes, and the prompt holds one <image> placeholder per figure (the hub's problems
already start with one; a missing one is prepended). yatt_ray's `math` reward sends the data_source
"hiyouga/geometry3k" to math-verify on the response's last \\boxed{...}, which the prompt asks for.
"""

import io

import fsspec
import pyarrow as pa
from common import BOXED, run, verl_row
from PIL import Image

HUB_ID = "hiyouga/geometry3k"
PLACEHOLDER = "<image>"
IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))  # datasets' Image layout


def png(image) -> dict:
    """A PIL image, or a {bytes, path} struct of a local copy, as {"bytes": <PNG bytes>, "path": None}."""
    if isinstance(image, dict):
        raw = image.get("bytes")
        if not raw:
            with fsspec.open(image["path"], "rb") as f:
                raw = f.read()
        image = Image.open(io.BytesIO(raw))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def to_verl(row: dict, split: str, index: int) -> dict:
    problem, images = row["problem"], [png(image) for image in row["images"] or []]
    missing = max(0, len(images) - problem.count(PLACEHOLDER))
    content = f"{PLACEHOLDER * missing}{problem} {BOXED}"
    out = verl_row(HUB_ID, content, row["answer"], split, index, answer=row["answer"], question=problem)
    return {**out, "images": images}


def main(argv=None) -> dict:
    return run(to_verl, HUB_ID, __doc__, types={"images": IMAGES}, argv=argv)


if __name__ == "__main__":
    main()
