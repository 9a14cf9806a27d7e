"""Prompt images: entry forms, decoding (bytes, local paths, fsspec URLs), placeholders, chat prompts, the Ray
Data batch function with bad rows skipped or raised, the CLIP processor wrapper, and (cluster) the decode
running in Ray Data tasks on a parquet file."""

from __future__ import annotations

import io
import os
import pickle

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from yatt_ray.data.images import (
    ERROR,
    PIXELS,
    SIZES,
    BadImage,
    ClipPixels,
    ImageRef,
    _clip_processor,
    bad_image_rows,
    check_image_column,
    check_on_bad_image,
    check_placeholders,
    count_placeholders,
    decode_images_batch,
    image_arrow_type,
    image_refs,
    load_image,
    prompt_text,
)
from yatt_ray.errors import ConfigError, DataError
from yatt_ray.models.tiny import build_tokenizer


def pixels(height: int, width: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def encode(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


def objects(values: list) -> np.ndarray:
    """A 1-d object array, one value per row (Ray's numpy form of a nested column)."""
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def pil_rgb(data: bytes) -> np.ndarray:
    """The reference: PIL's own decoding, converted to RGB."""
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# ---- entries -------------------------------------------------------------------------------------------
def test_image_refs_accepts_every_entry_form():
    refs = image_refs(
        [
            {"bytes": b"png1"},
            {"path": "/a.png"},
            "/b.png",
            {"bytes": b"png2", "path": "/c.png"},
            {"bytes": b"", "path": "/d.png"},
        ],
        row_id=7,
    )
    assert refs == [
        ImageRef(0, data=b"png1"),
        ImageRef(1, path="/a.png"),
        ImageRef(2, path="/b.png"),
        ImageRef(3, data=b"png2"),  # bytes win when non-empty
        ImageRef(4, path="/d.png"),  # empty bytes: the path
    ]
    # Ray's numpy form of a list<struct<bytes, path>> cell: an object array of dicts with None for nulls
    cell = np.array([{"bytes": None, "path": "s3://b/x.jpg"}, {"bytes": b"x", "path": None}], dtype=object)
    assert image_refs(cell, 1) == [ImageRef(0, path="s3://b/x.jpg"), ImageRef(1, data=b"x")]
    assert (
        image_refs(None, 1) == []
        and image_refs([], 1) == []
        and image_refs(np.array([], dtype=object), 1) == []
    )


@pytest.mark.parametrize(
    "cell, where",
    [
        ("/a.png", "image cell is of type str"),  # a bare string cell: not wrapped in a list
        ({"bytes": b"x"}, "image cell is of type dict"),
        (3, "image cell is of type int"),
        ([5], "image 0 is 5"),
        ([{"bytes": b"x"}, {"image": "a.png"}], "image 1 is {'image': 'a.png'}"),
        ([{"bytes": None, "path": None}], "image 0 is"),
        ([""], "image 0 is ''"),
        ([{"bytes": "not bytes"}], "'bytes' is of type str"),
    ],
)
def test_image_refs_rejects_other_cells_naming_row_and_forms(cell, where):
    with pytest.raises(DataError) as info:
        image_refs(cell, row_id="r-42")
    message = str(info.value)
    assert "row 'r-42'" in message and where in message
    assert '{"bytes": <encoded image>}' in message and "bare path string" in message


# ---- decoding ------------------------------------------------------------------------------------------
def test_load_image_from_bytes_converts_to_rgb():
    rgb = pixels(5, 7)
    image = load_image(ImageRef(0, data=encode(rgb)), row_id=1)
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), rgb)
    gray, rgba = encode(pixels(4, 6, channels=1)), encode(pixels(4, 6, channels=4))
    for data in (gray, rgba, encode(rgb, "JPEG")):
        image = load_image(ImageRef(0, data=data), row_id=1)
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), pil_rgb(data))


def test_load_image_from_local_and_memory_paths(tmp_path):
    data = encode(pixels(6, 4, seed=1))
    (tmp_path / "a.png").write_bytes(data)
    with fsspec.open("memory://imgs/a.png", "wb") as f:
        f.write(data)
    for ref, root in [
        (ImageRef(0, path=str(tmp_path / "a.png")), None),
        (ImageRef(0, path="a.png"), str(tmp_path)),  # relative to root
        (ImageRef(0, path="memory://imgs/a.png"), None),
        (ImageRef(0, path="a.png"), "memory://imgs"),
    ]:
        assert np.array_equal(np.asarray(load_image(ref, 1, root=root)), pil_rgb(data))


def test_missing_path_is_a_bad_image_naming_row_entry_and_cause(tmp_path):
    for path in (str(tmp_path / "nope.png"), "memory://imgs/nope.png"):
        with pytest.raises(BadImage) as info:
            load_image(ImageRef(2, path=path), row_id=17)
        message = str(info.value)
        assert "row 17 image 2" in message and "nope.png" in message and "does not exist" in message
        assert isinstance(info.value, DataError)


@pytest.mark.parametrize(
    "data, cause",
    [
        (b"not an image at all", "UnidentifiedImageError"),
        (encode(pixels(64, 64))[:200], "truncated"),  # a png cut short
    ],
)
def test_corrupt_bytes_are_a_bad_image_naming_row_entry_and_cause(data, cause):
    with pytest.raises(BadImage) as info:
        load_image(ImageRef(1, data=data), row_id="abc")
    message = str(info.value)
    assert f"row 'abc' image 1 ({len(data)} bytes) does not decode" in message and cause in message


def test_bad_image_survives_pickling():
    error = pickle.loads(pickle.dumps(BadImage("row 3 image 0: broken")))
    assert type(error) is BadImage and str(error) == "row 3 image 0: broken"


# ---- prompts -------------------------------------------------------------------------------------------
def test_count_placeholders_in_strings_and_chat_lists():
    assert count_placeholders("What is it?") == 0
    assert count_placeholders("<image><image>Sum:") == 2
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>left, <image>right"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and <image>?"},
    ]
    assert count_placeholders(chat) == 3
    assert count_placeholders(np.array(chat, dtype=object)) == 3  # Ray's numpy form of a list<struct> cell


def test_check_placeholders_names_row_and_both_counts():
    check_placeholders("<image>Sum:", 1, row_id=5)
    check_placeholders([{"role": "user", "content": "<image><image>"}], 2, row_id=5)
    with pytest.raises(DataError) as info:
        check_placeholders("<image><image>Sum:", 1, row_id=5)
    message = str(info.value)
    assert (
        "row 5" in message and "holds 2 '<image>' placeholder(s)" in message and "has 1 image(s)" in message
    )
    with pytest.raises(DataError, match="holds 0 '<image>' placeholder"):
        check_placeholders([{"role": "user", "content": "what?"}], 1, row_id=5)


def test_prompt_text_string_and_fallback_join():
    assert prompt_text("<image>Sum:") == "<image>Sum:"
    chat = [{"role": "user", "content": "<image>Sum:"}]
    assert prompt_text(chat) == "<image>Sum:"  # a one-message chat is its string form
    assert prompt_text(chat, build_tokenizer()) == "<image>Sum:"  # the tiny tokenizer has no chat template
    two = [{"role": "system", "content": "Add."}, {"role": "user", "content": "<image>Sum:"}]
    assert prompt_text(np.array(two, dtype=object)) == "Add.\n<image>Sum:"


def test_prompt_text_uses_the_tokenizers_chat_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    chat = [{"role": "system", "content": "Add."}, {"role": "user", "content": "<image>Sum:"}]
    assert prompt_text(chat, tokenizer) == "[system]Add.[user]<image>Sum:[assistant]"


@pytest.mark.parametrize(
    "prompt, where",
    [
        ([], "the prompt is []"),
        (3, "the prompt is 3"),
        (["hi"], "message 0 of the chat prompt is 'hi'"),
        ([{"role": "user"}], "message 0"),
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
            "structured content",
        ),
    ],
)
def test_prompt_text_rejects_malformed_chat_lists_with_the_fix(prompt, where):
    with pytest.raises(DataError) as info:
        prompt_text(prompt, row_id=9)
    message = str(info.value)
    assert (
        "row 9" in message and where in message and '[{"role": "user", "content": "<image>..."}]' in message
    )


# ---- batches -------------------------------------------------------------------------------------------
def mixed_batch(tmp_path):
    """Six rows: two good (one with two images of different sizes, one from a path), one without images, and
    three bad (corrupt bytes, a missing path, a placeholder count that does not match)."""
    a, b, c = encode(pixels(4, 6, seed=1)), encode(pixels(5, 3, seed=2), "JPEG"), encode(pixels(7, 7, seed=3))
    (tmp_path / "c.png").write_bytes(c)
    cells = [
        [{"bytes": a, "path": None}, {"bytes": b, "path": None}],
        [{"bytes": b"garbage", "path": None}],
        [{"bytes": None, "path": str(tmp_path / "c.png")}],
        [{"bytes": None, "path": str(tmp_path / "missing.png")}],
        None,
        [{"bytes": a, "path": None}],
    ]
    batch = {
        "id": np.array([10, 11, 12, 13, 14, 15]),
        "prompt": np.array(
            ["<image>x<image>", "<image>", "<image>", "<image>", "no image", "<image><image>"], dtype=object
        ),
        "images": objects([np.array(cell, dtype=object) if cell else None for cell in cells]),
    }
    return batch, (a, b, c)


def test_decode_batch_skip_decodes_good_rows_and_flags_bad_ones(tmp_path):
    batch, (a, b, c) = mixed_batch(tmp_path)
    out = decode_images_batch(batch, "images", on_bad_image="skip")
    assert "images" not in out and list(out["id"]) == [10, 11, 12, 13, 14, 15]  # every row kept, in order
    first = out[PIXELS][0]
    assert first.shape == (2, 5, 6, 3) and first.dtype == np.uint8  # padded to the largest height and width
    assert np.array_equal(first[0, :4, :6], pil_rgb(a)) and not first[0, 4:].any()
    assert np.array_equal(first[1, :5, :3], pil_rgb(b)) and not first[1, :, 3:].any()
    assert out[SIZES][0].tolist() == [[4, 6], [5, 3]]
    assert np.array_equal(out[PIXELS][2], pil_rgb(c)[None]) and out[SIZES][2].tolist() == [[7, 7]]
    assert out[PIXELS][4].shape == (0, 0, 0, 3) and out[SIZES][4].shape == (0, 2)  # text-only row: good
    assert [e == "" for e in out[ERROR]] == [True, False, True, False, True, False]
    for i in (1, 3, 5):
        assert out[PIXELS][i].shape == (0, 0, 0, 3) and out[SIZES][i].shape == (0, 2)
    bad = bad_image_rows(out)
    assert [row_id for row_id, _ in bad] == [11, 13, 15] and all(type(row_id) is int for row_id, _ in bad)
    assert "row 11 image 0" in bad[0][1] and "does not decode" in bad[0][1]
    assert "row 13 image 0" in bad[1][1] and "does not exist" in bad[1][1]
    assert "row 15" in bad[2][1] and "holds 2 '<image>' placeholder(s) but the row has 1" in bad[2][1]
    kept = decode_images_batch(batch, "images", keep_image_column=True, prompt_column=None)
    assert kept["images"] is batch["images"] and [r for r, _ in bad_image_rows(kept)] == [11, 13]


def test_decode_batch_raise_names_the_first_bad_row(tmp_path):
    batch, _ = mixed_batch(tmp_path)
    with pytest.raises(BadImage, match=r"row 11 image 0 \(7 bytes\) does not decode"):
        decode_images_batch(batch, "images", on_bad_image="raise")
    only_mismatch = {k: v[5:] for k, v in batch.items()}
    with pytest.raises(BadImage, match="row 15: the prompt holds 2"):  # not only decoding: every unusable row
        decode_images_batch(only_mismatch, "images", on_bad_image="raise")
    good = {k: v[[0, 2, 4]] for k, v in batch.items()}
    assert list(decode_images_batch(good, "images", on_bad_image="raise")[ERROR]) == ["", "", ""]


def test_decode_batch_checks_its_arguments(tmp_path):
    batch, _ = mixed_batch(tmp_path)
    with pytest.raises(ConfigError) as info:
        decode_images_batch(batch, "images", on_bad_image="ignore")
    assert "data.on_bad_image='ignore'" in str(info.value) and "skip, raise" in str(info.value)
    assert check_on_bad_image("raise") == "raise"
    with pytest.raises(DataError, match="no image column 'pics'.*data.image_key=<column>"):
        decode_images_batch(batch, "pics")
    with pytest.raises(DataError, match="run decode_images_batch on it first"):
        bad_image_rows(batch)


def test_decode_batch_with_a_processor_fn(tmp_path):
    batch, (a, b, _) = mixed_batch(tmp_path)
    seen = []

    def mean_colour(images):  # [I, 3, 1, 1]: each image's mean colour
        seen.append(len(images))
        return np.stack([np.asarray(im, dtype=np.float64).mean(axis=(0, 1))[:, None, None] for im in images])

    out = decode_images_batch(batch, "images", processor_fn=mean_colour)
    assert seen == [2, 1]  # good rows with images only
    assert out[PIXELS][0].dtype == np.float32 and out[PIXELS][0].shape == (2, 3, 1, 1)
    assert np.allclose(out[PIXELS][0][1, :, 0, 0], pil_rgb(b).mean(axis=(0, 1)), atol=1e-4)
    assert out[PIXELS][4].shape == (0, 3, 0, 0) and out[PIXELS][1].shape == (0, 3, 0, 0)
    assert out[SIZES][0].tolist() == [[4, 6], [5, 3]]  # sizes before the processor
    with pytest.raises(ValueError, match=r"returned an array of shape \(3, 4\) for 2 image"):
        decode_images_batch(batch, "images", processor_fn=lambda images: np.zeros((3, 4)))


def test_clip_pixels_matches_the_processor_called_directly(tmp_path):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor.save_pretrained(tmp_path / "proc")
    images = [Image.fromarray(pixels(20, 30, seed=4)), Image.fromarray(pixels(24, 18, seed=5))]
    expected = processor(images=images, return_tensors="np")["pixel_values"]
    clip = pickle.loads(pickle.dumps(ClipPixels(str(tmp_path / "proc"))))
    misses = _clip_processor.cache_info().misses
    values = clip(images)
    assert np.array_equal(pickle.loads(pickle.dumps(clip))(images), values)  # a fresh copy, as in each task
    assert _clip_processor.cache_info().misses == misses + 1  # loaded once per process
    assert values.dtype == np.float32 and values.shape == (2, 3, 16, 16)
    assert np.array_equal(values, expected.astype(np.float32))
    assert len(pickle.dumps(clip)) < 200  # holds the path, not the processor
    with pytest.raises(ConfigError, match="no CLIP image processor in"):
        ClipPixels(str(tmp_path / "none"))(images)


# ---- driver-side checks --------------------------------------------------------------------------------
def test_check_image_column_names_file_column_and_fix(tmp_path):
    path = tmp_path / "t.parquet"
    table = pa.table({"prompt": ["<image>"], "imgs": pa.array([[{"bytes": b"x"}]], type=image_arrow_type())})
    pq.write_table(table, path)
    names = pq.read_metadata(path).schema.to_arrow_schema().names
    check_image_column(names, str(path), "imgs")
    with pytest.raises(DataError) as info:
        check_image_column(names, str(path), "images")
    message = str(info.value)
    assert str(path) in message and "no image column 'images' (data.image_key)" in message
    assert "['imgs', 'prompt']" in message and "Set data.image_key=<column>" in message


# ---- in Ray Data tasks (the shared cluster) ------------------------------------------------------------
@pytest.mark.cluster
def test_decode_runs_in_ray_data_tasks_on_parquet(ray_cluster, tmp_path):
    import ray.data

    good = [encode(pixels(6, 5, seed=i)) for i in range(3)]
    rows = [
        {"id": i, "prompt": "<image>Sum:", "images": [{"bytes": data, "path": None}]}
        for i, data in enumerate(good)
    ]
    rows.append({"id": 3, "prompt": "<image>Sum:", "images": [{"bytes": b"broken", "path": None}]})
    table = pa.Table.from_pylist(
        rows, schema=pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("images", image_arrow_type())])
    )
    pq.write_table(table, tmp_path / "imgs.parquet")

    def decode(batch):
        return {**decode_images_batch(batch, "images"), "pid": np.full(len(batch["id"]), os.getpid())}

    ds = ray.data.read_parquet(str(tmp_path / "imgs.parquet")).map_batches(
        decode, batch_format="numpy", batch_size=2
    )
    out = sorted(ds.take_all(), key=lambda r: r["id"])
    assert [r["id"] for r in out] == [0, 1, 2, 3] and "images" not in out[0]
    assert all(r["pid"] != os.getpid() for r in out)  # decoded in Ray Data's worker processes
    for r, data in zip(out[:3], good):
        assert r[ERROR] == "" and np.array_equal(r[PIXELS], pil_rgb(data)[None])
    assert "row 3 image 0" in out[3][ERROR] and out[3][PIXELS].shape == (0, 0, 0, 3)


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_qwen_pixels_resize_into_the_limits_and_max_images_refuses_a_row(tmp_path):
    """Qwen VL's processor in the Ray Data batch function: patch rows and grids per row, an image over
    max_pixels resized down (aspect kept), one under min_pixels up, a row with more than max_images named."""
    from yatt_ray.data.images import GRID, PIXELS, QwenPixels, decode_images_batch, pixels_processor
    from yatt_ray.models.tiny_qwen_vl import build_image_processor

    build_image_processor().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    assert isinstance(pixels_processor(str(tmp_path), max_pixels=112 * 112), QwenPixels)
    cells = np.empty(4, dtype=object)
    cells[0] = [{"bytes": _png(336, 224)}]  # 75,264 px: over max_pixels
    cells[1] = [{"bytes": _png(20, 20)}]  # under min_pixels
    cells[2] = [{"bytes": _png(56, 56)}, {"bytes": _png(56, 56, 1)}]  # two images: over max_images
    cells[3] = None  # no image
    batch = {"id": np.array([0, 1, 2, 3]), "images": cells}
    qwen = QwenPixels(str(tmp_path), min_pixels=56 * 56, max_pixels=112 * 112)
    out = decode_images_batch(batch, processor_fn=qwen, prompt_column=None, max_images=1)
    ((t, h, w),) = out[GRID][0].tolist()
    assert t == 1 and (h * 14) * (w * 14) <= 112 * 112 and w > h  # resized down, still wider than high
    assert out[PIXELS][0].shape == (h * w, 1176)
    assert out[GRID][1].tolist() == [[1, 4, 4]]  # up to 56 x 56: 4 tokens
    assert "row 2 has 2 images, more than data.max_images=1" in out["image_error"][2]
    assert out[PIXELS][2].shape[0] == 0 and out[GRID][2].shape == (0, 3)
    assert out["image_error"][3] == "" and out[GRID][3].shape == (0, 3)
    with pytest.raises(DataError, match="row 2 has 2 images"):
        decode_images_batch(batch, processor_fn=qwen, prompt_column=None, max_images=1, on_bad_image="raise")
