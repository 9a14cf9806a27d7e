"""The visual sum task: deterministic rows, right sums, clear and distinct glyphs, bytes that grow with the
image, parquet and jsonl files that the image loader reads back, and the reward it reuses."""

from __future__ import annotations

import io
import json

import fsspec
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from yatt_ray.data.images import (
    count_placeholders,
    decode_images_batch,
    image_arrow_type,
    image_refs,
    load_image,
)
from yatt_ray.reward.rules import exact_match, resolve_reward_fn
from yatt_ray.tasks import visual


def objects(values: list) -> np.ndarray:
    """A 1-d object array, one value per row (Ray's numpy form of a nested column)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def decoded(entry: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(entry["bytes"])).convert("RGB"))


def test_rows_are_deterministic_and_a_prefix_stable_stream():
    rows = visual.make_problems(20, seed=3)
    assert rows == visual.make_problems(20, seed=3)
    assert visual.make_problems(5, seed=3) == rows[:5]
    assert [r["ground_truth"] for r in rows] != [r["ground_truth"] for r in visual.make_problems(20, seed=4)]
    noisy = visual.make_problems(20, seed=3, image_size=48, noise=64)  # same numbers, other pixels
    assert [r["ground_truth"] for r in noisy] == [r["ground_truth"] for r in rows]


def test_row_schema_and_sums_are_right():
    # every clean image is exactly one pair's rendering: read the pair back and check the answer is its sum
    pairs = {visual.png_bytes(visual.render([a, b], 32, 32, 1)): (a, b) for a in range(10) for b in range(10)}
    rows = visual.make_problems(200, seed=1, id_offset=500)
    assert [r["id"] for r in rows] == list(range(500, 700))
    for r in rows:
        assert set(r) == {"id", "prompt", "ground_truth", "data_source", "images"}
        assert r["prompt"] == "<image>Sum:" and r["data_source"] == "visual_sum"
        (entry,) = r["images"]
        a, b = pairs[entry["bytes"]]
        assert r["ground_truth"] == str(a + b)
    assert len({pairs[r["images"][0]["bytes"]] for r in rows}) > 80  # the draws cover most of the 100 pairs


def test_images_decode_to_the_asked_size():
    for size, shape in [(32, (32, 32, 3)), ((48, 40), (40, 48, 3))]:
        (row,) = visual.make_problems(1, seed=0, image_size=size)
        (ref,) = image_refs(row["images"], row["id"])
        image = load_image(ref, row["id"])
        assert image.mode == "RGB" and np.asarray(image).shape == shape


def test_distinct_numbers_give_distinct_clear_glyphs():
    clean = {(a, b): np.asarray(visual.render([a, b], 32, 32, 1)) for a in range(10) for b in range(10)}
    assert len({img.tobytes() for img in clean.values()}) == 100
    for img in clean.values():  # two colours only: glyph 255, background 0
        assert set(np.unique(img)) <= {0, 255}
    # seven segments: an 8 lights every pixel any digit lights in the same cell; a 1 only the right half
    lit = {d: clean[(d, 0)][:, :10].all(axis=2) for d in range(10)}
    assert all(not (lit[d] & ~lit[8]).any() for d in range(10))
    assert not lit[1][:, :5].any() and lit[1].sum() > 20
    # noise stays below the glyphs: thresholding a noisy image gives the clean glyphs back
    rng = np.random.default_rng(0)
    noisy = np.asarray(visual.render([4, 7], 32, 32, 1, noise=64, rng=rng))
    assert noisy.max(initial=0, where=noisy < 255) < 64 and noisy[noisy < 255].std() > 10
    assert np.array_equal(noisy > 128, clean[(4, 7)] > 128)


def test_bytes_grow_with_size_noise_and_image_count():
    def mean_bytes(**kwargs) -> float:
        rows = visual.make_problems(16, seed=0, **kwargs)
        return sum(len(e["bytes"]) for r in rows for e in r["images"]) / len(rows)

    clean = [mean_bytes(image_size=s) for s in (32, 64, 128)]
    noisy = [mean_bytes(image_size=s, noise=64) for s in (32, 64, 128)]
    assert clean[0] < clean[1] < clean[2]
    assert noisy[0] > 10 * clean[0] and 3.3 < noisy[1] / noisy[0] < 4.5 and 3.5 < noisy[2] / noisy[1] < 4.5
    assert 3.5 < mean_bytes(noise=64, images_per_prompt=4) / noisy[0] < 4.5  # one number per image, 4 images


def test_several_images_per_prompt_one_number_each():
    singles = {visual.png_bytes(visual.render([n], 32, 32, 1)): n for n in range(10)}
    for r in visual.make_problems(30, seed=2, images_per_prompt=3):
        assert r["prompt"] == "<image><image><image>Sum:" and count_placeholders(r["prompt"]) == 3
        numbers = [singles[e["bytes"]] for e in r["images"]]
        assert len(numbers) == 3 and r["ground_truth"] == str(sum(numbers))


def test_two_digit_numbers_are_right_aligned():
    rows = visual.make_problems(50, seed=0, max_operand=12, image_size=(64, 32))
    assert max(int(r["ground_truth"]) for r in rows) > 18  # two-digit operands appear
    wide = visual.render([3, 12], 64, 32, 2)
    assert not np.asarray(wide)[:, :12].any() and np.asarray(wide)[:, 13:25].any()  # blank tens cell, then 3


def test_bad_parameters_name_the_values():
    with pytest.raises(ValueError, match="image_size=8 is too small for 3 glyph"):
        visual.make_problems(1, seed=0, image_size=8)
    with pytest.raises(ValueError, match="noise=300"):
        visual.make_problems(1, seed=0, noise=300)
    with pytest.raises(ValueError, match="unknown extension"):
        visual.write_rows([], "rows.csv")


def test_parquet_file_holds_the_verl_image_column(tmp_path):
    rows = visual.make_problems(6, seed=0)
    path = visual.write_rows(rows, tmp_path / "train.parquet")
    table = pq.read_table(path)
    assert table.schema.field("images").type == image_arrow_type()
    assert table.column("id").to_pylist() == list(range(6))
    for r, back in zip(rows, table.to_pylist()):
        (ref,) = image_refs(back["images"], back["id"])
        assert ref.data == r["images"][0]["bytes"] and back["images"][0]["path"] is None
        assert back["ground_truth"] == r["ground_truth"] and back["prompt"] == r["prompt"]
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("where", ["local", "memory"])
def test_jsonl_file_refers_to_png_files(tmp_path, where):
    rows = visual.make_problems(4, seed=5, images_per_prompt=2)
    url = str(tmp_path / "train.jsonl") if where == "local" else "memory://visual/train.jsonl"
    visual.write_rows(rows, url)
    with fsspec.open(url, "r") as f:
        back = [json.loads(line) for line in f]
    assert [b["id"] for b in back] == [r["id"] for r in rows]
    batch = {
        "id": np.array([b["id"] for b in back]),
        "prompt": np.array([b["prompt"] for b in back], dtype=object),
        "images": objects([b["images"] for b in back]),
    }
    out = decode_images_batch(batch, "images", on_bad_image="raise")
    for r, b, px in zip(rows, back, out["pixel_values"]):
        assert all(set(e) == {"path"} for e in b["images"])
        assert b["images"][0]["path"].startswith("memory://" if where == "memory" else "/")
        assert np.array_equal(px, np.stack([decoded(e) for e in r["images"]]))


def test_the_reward_is_exact_match_of_the_sum():
    fn = resolve_reward_fn(visual.REWARD_FUNCTION)
    assert fn is exact_match
    for r in visual.make_problems(10, seed=0):
        assert fn(r["ground_truth"], r["ground_truth"], visual.DATA_SOURCE) == 1.0
        assert fn(" " + r["ground_truth"] + "\n", r["ground_truth"]) == 1.0
        assert fn(str(int(r["ground_truth"]) + 1), r["ground_truth"]) == 0.0


def test_numbers_cover_the_range():
    rows = visual.make_problems(300, seed=0, images_per_prompt=2)
    singles = {visual.png_bytes(visual.render([n], 32, 32, 1)): n for n in range(10)}
    seen = {singles[e["bytes"]] for r in rows for e in r["images"]}
    assert seen == set(range(10))
    assert {r["ground_truth"] for r in rows} <= {str(s) for s in range(19)}
