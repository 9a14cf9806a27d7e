"""The eval set read in the controller's process (`EvalRows`): parquet and jsonl, dotted keys and verl files,
several files keyed by file, each data-parallel rank's share (every row once over the ranks), batches of a
fixed size, and a vision file's images decoded batch by batch with bad rows flagged; (cluster) the same rows
and columns as the Ray Data pipeline (`build_dataset`) gives."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from yatt_ray import DataError
from yatt_ray.config import DataConfig
from yatt_ray.data.eval_rows import EvalRows
from yatt_ray.data.images import ERROR, PIXELS, SIZES, ClipPixels, chat_messages, image_arrow_type
from yatt_ray.data.sources import VERL_KEYS

CANONICAL = {"id", "prompt", "ground_truth", "data_source"}


def write(path, rows) -> str:
    if str(path).endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def plain_rows(n: int, start: int = 0) -> list[dict]:
    return [{"id": start + i, "prompt": f"{start + i}+1=", "ground_truth": start + i + 1} for i in range(n)]


def verl_rows(n: int, tag: str) -> list[dict]:
    """Rows in verl's layout (a chat prompt, struct columns); `tag` marks the file in the answers."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "reward_model": {"style": "rule", "ground_truth": f"{tag}{i}"},
            "extra_info": {"split": "test", "index": i},
        }
        for i in range(n)
    ]


def read_all(rows: EvalRows) -> dict[str, list]:
    """Every batch of `rows` joined, column by column."""
    out: dict[str, list] = {}
    for batch in rows.batches():
        for name, values in batch.items():
            out.setdefault(name, []).extend(values)
    return out


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_one_file_in_batches_of_a_fixed_size(tmp_path, ext):
    path = write(tmp_path / f"eval.{ext}", plain_rows(600))
    rows = EvalRows(DataConfig(eval_files=[path]), [path], dp_rank=0, dp_size=1)
    batches = list(rows.batches())
    assert [len(b["id"]) for b in batches] == [256, 256, 88]
    assert all(set(b) == CANONICAL for b in batches)
    assert [int(i) for b in batches for i in b["id"]] == list(range(600))  # file order
    first = batches[0]
    assert first["id"].dtype == np.int64 and first["ground_truth"].dtype == object
    assert first["ground_truth"][3] == "4" and first["prompt"][3] == "3+1="  # answers as strings
    assert list(first["data_source"][:2]) == ["default", "default"]  # no source column
    assert [len(b["id"]) for b in rows.batches()] == [256, 256, 88]  # read again: the second evaluation


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_the_ranks_shares_partition_the_rows_of_several_files(tmp_path, ext):
    sizes = [5, 7, 30]  # row i (across the files) goes to rank i % dp_size
    files, expected = [], []  # the ids over several files: "<file name>:<id>"
    for k, n in enumerate(sizes):
        rows = plain_rows(n, start=len(expected))
        files.append(write(tmp_path / f"part{k}.{ext}", rows))
        expected += [f"part{k}.{ext}:{row['id']}" for row in rows]
    data = DataConfig(eval_files=files)
    for dp_size in (1, 2, 3, 4):
        shares = [read_all(EvalRows(data, files, r, dp_size, batch_size=4))["id"] for r in range(dp_size)]
        for r, share in enumerate(shares):
            assert share == expected[r::dp_size], (dp_size, r)  # deterministic, in file order
        assert sorted(i for share in shares for i in share) == sorted(expected)  # every row exactly once
    batches = list(EvalRows(data, files, 1, 3, batch_size=4).batches())
    assert [len(b["id"]) for b in batches] == [4, 4, 4, 2]  # batches span files


def test_a_rank_beyond_the_rows_gets_no_batch(tmp_path):
    path = write(tmp_path / "eval.parquet", plain_rows(2))
    assert list(EvalRows(DataConfig(eval_files=[path]), [path], 2, 3).batches()) == []
    with pytest.raises(ValueError, match=r"dp_rank=3 must be in \[0, dp_size=3\)"):
        EvalRows(DataConfig(eval_files=[path]), [path], 3, 3)


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_verl_files_read_with_dotted_keys_and_keyed_by_file(tmp_path, ext):
    files = []
    for name in ("gsm8k", "math"):
        rows = verl_rows(3, name[0])
        rows[2]["extra_info"] = None  # no index: id "" over several files
        (tmp_path / name).mkdir()
        files.append(write(tmp_path / name / f"test.{ext}", rows))
    data = DataConfig(eval_files=files, **VERL_KEYS)
    got = read_all(EvalRows(data, files, 0, 1))
    assert set(got) == CANONICAL  # no path column left
    assert got["id"] == [
        f"gsm8k/test.{ext}:0",
        f"gsm8k/test.{ext}:1",
        "",
        f"math/test.{ext}:0",
        f"math/test.{ext}:1",
        "",
    ]
    assert got["ground_truth"] == ["g0", "g1", "g2", "m0", "m1", "m2"]
    assert set(got["data_source"]) == {"openai/gsm8k"}
    assert chat_messages(got["prompt"][4]) == [
        {"role": "user", "content": "question 1"}
    ]  # the chat list intact
    one = read_all(EvalRows(DataConfig(eval_files=files[:1], **VERL_KEYS), files[:1], 0, 1))
    assert [int(i) for i in one["id"]] == [0, 1, -1]  # one file: the ids as they are, -1 for a null struct


def test_a_top_level_column_with_a_dot_wins(tmp_path):
    rows = [{"a.b": "top", "a": {"b": "nested"}, "prompt": "p"}]
    path = write(tmp_path / "eval.parquet", rows)
    got = read_all(EvalRows(DataConfig(eval_files=[path], answer_key="a.b"), [path], 0, 1))
    assert got["ground_truth"] == ["top"]


def test_a_jsonl_key_of_two_types_names_the_file(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"prompt": "1", "ground_truth": 1}\n{"prompt": "2", "ground_truth": "two"}\n')
    with pytest.raises(DataError, match=r"eval file .*eval.jsonl.* one type on every line"):
        list(EvalRows(DataConfig(eval_files=[str(path)]), [str(path)], 0, 1).batches())


# ---- images ----------------------------------------------------------------------------------------------
def png(seed: int) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, size=(6, 5, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def vision_file(path) -> str:
    """Five rows: good images (0, 1, 4), corrupt bytes (2), no image (3, a prompt without <image>)."""
    cells = [
        [{"bytes": png(0)}],
        [{"bytes": png(1)}],
        [{"bytes": b"\x89PNG not really"}],
        None,
        [{"bytes": png(4)}],
    ]
    rows = [
        {"id": i, "prompt": ("<image>" if cell else "") + "Sum:", "ground_truth": str(i), "images": cell}
        for i, cell in enumerate(cells)
    ]
    schema = pa.schema(
        [
            ("id", pa.int64()),
            ("prompt", pa.string()),
            ("ground_truth", pa.string()),
            ("images", image_arrow_type()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


@pytest.fixture
def clip_dir(tmp_path):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor.save_pretrained(tmp_path / "proc")
    return str(tmp_path / "proc")


def test_vision_rows_are_decoded_and_a_bad_image_is_flagged(tmp_path, clip_dir):
    path = vision_file(tmp_path / "eval.parquet")
    data = DataConfig(eval_files=[path])
    got = read_all(EvalRows(data, [path], 0, 1, pixels=ClipPixels(clip_dir)))
    assert set(got) == CANONICAL | {PIXELS, SIZES, ERROR}  # the image column itself is dropped
    assert [int(i) for i in got["id"]] == [0, 1, 2, 3, 4]
    assert [e == "" for e in got[ERROR]] == [True, True, False, True, True]
    assert "row 2 image 0" in got[ERROR][2] and "does not decode" in got[ERROR][2]
    for i in (0, 1, 4):
        assert got[PIXELS][i].dtype == np.float32 and got[PIXELS][i].shape == (1, 3, 16, 16)
        assert got[SIZES][i].tolist() == [[6, 5]]
    assert got[PIXELS][3].shape == (0, 3, 0, 0) and got[PIXELS][2].shape == (0, 3, 0, 0)
    with pytest.raises(DataError, match="row 2 image 0"):  # data.on_bad_image=raise stops, as in Ray Data
        read_all(
            EvalRows(DataConfig(eval_files=[path], on_bad_image="raise"), [path], 0, 1, ClipPixels(clip_dir))
        )


def test_images_are_decoded_one_batch_at_a_time(tmp_path):
    path = vision_file(tmp_path / "eval.parquet")
    seen: list[int] = []

    def count(images):  # [I, 3, 1, 1]
        seen.append(len(images))
        return np.zeros((len(images), 3, 1, 1), np.float32)

    batches = EvalRows(DataConfig(eval_files=[path]), [path], 0, 1, pixels=count, batch_size=2).batches()
    first = next(batches)
    assert [int(i) for i in first["id"]] == [0, 1] and seen == [1, 1]  # only the first batch's images
    rest = list(batches)
    assert [len(b["id"]) for b in rest] == [2, 1] and seen == [1, 1, 1]  # row 2 bad, row 3 without images


# ---- against the Ray Data pipeline (the shared cluster) -----------------------------------------------------
@pytest.mark.cluster
@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_the_same_rows_and_columns_as_build_dataset(ray_cluster, tmp_path, ext):
    from yatt_ray.data import build_dataset

    files = []
    for name in ("gsm8k", "math"):
        rows = verl_rows(5, name[0])
        rows[3]["extra_info"] = None
        rows[4]["data_source"] = None
        (tmp_path / name).mkdir()
        files.append(write(tmp_path / name / f"test.{ext}", rows))
    data = DataConfig(eval_files=files, shuffle_seed=None, **VERL_KEYS)
    ray_rows = sorted(build_dataset(data, files).take_all(), key=lambda r: r["ground_truth"])
    ours = [
        {name: batch[name][i] for name in batch}
        for rank in range(2)
        for batch in EvalRows(data, files, rank, 2).batches()
        for i in range(len(batch["id"]))
    ]
    ours.sort(key=lambda r: r["ground_truth"])
    assert len(ours) == len(ray_rows) == 10
    for mine, theirs in zip(ours, ray_rows):
        assert set(mine) == set(theirs)
        for name in ("id", "ground_truth", "data_source"):
            assert mine[name] == theirs[name] and type(mine[name]) is type(theirs[name]), (name, mine, theirs)
        assert type(mine["prompt"]) is type(theirs["prompt"])
        assert chat_messages(mine["prompt"]) == chat_messages(theirs["prompt"])
