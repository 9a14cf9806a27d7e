"""The data-preparation scripts (examples/data/): each dataset's own columns in (a local copy, no network),
verl's layout out, read back by the library's readers (`check_sources`, `EvalRows`) with verl's keys, and
scored by the `math` reward as the prompts ask: each script's data_source picks the scorer its ground truths
are written for."""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from yatt_ray.config import DataConfig
from yatt_ray.data import check_sources
from yatt_ray.data.eval_rows import EvalRows
from yatt_ray.data.images import ERROR, PIXELS, chat_messages, image_arrow_type
from yatt_ray.data.sources import VERL_KEYS
from yatt_ray.reward import math as math_rewards
from yatt_ray.reward.math import gsm8k, math_reward, math_verify, reward_for_source

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
BOXED = "Let's think step by step and output the final answer within \\boxed{}."


@pytest.fixture
def scripts(monkeypatch):
    """The three scripts imported from their folder (as `python examples/data/x.py` finds `common`)."""
    monkeypatch.syspath_prepend(str(DATA))
    monkeypatch.setattr(math_rewards, "MATH_VERIFY_TIMEOUT_S", 60.0)  # the first call imports sympy
    return {name: importlib.import_module(name) for name in ("gsm8k", "math_lighteval", "geo3k")}


def write(path, rows, schema=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def read_back(url: str, pixels=None) -> dict[str, list]:
    """The file as the library reads it with verl's keys (checked as training data first: columns, ids)."""
    data = DataConfig(train_files=[url], eval_files=[url], **VERL_KEYS)
    [url] = check_sources(data, images=pixels is not None)  # (memory://x is listed as memory:///x)
    out: dict[str, list] = {}
    for batch in EvalRows(data, [url], 0, 1, pixels=pixels).batches():
        for name, values in batch.items():
            out.setdefault(name, []).extend(values)
    return out


def assert_scored(got: dict, right, wrong, scorer) -> None:
    """Every row's data_source sends `math` to `scorer`; `right(truth)` scores 1, `wrong` 0."""
    for truth, source in zip(got["ground_truth"], got["data_source"]):
        assert reward_for_source(source) is scorer, source
        assert math_reward(right(truth), truth, source) == 1.0, (truth, right(truth))
        assert math_reward(wrong, truth, source) == 0.0, truth


# ---- GSM8K -----------------------------------------------------------------------------------------------
GSM8K = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "48 + 24 = 72\n#### 72"},
    {"question": "Weng earns $12 an hour. How much?", "answer": "12 * 50 / 60 = 10\n#### 10"},
    {"question": "A big sum?", "answer": "1000 + 234 = 1234\n#### 1,234"},
]


def test_gsm8k_to_verl_layout_read_by_the_library(scripts, tmp_path):
    script = scripts["gsm8k"]
    write(tmp_path / "src" / "train.jsonl", GSM8K)  # the jsonl of GSM8K's own repository
    write(tmp_path / "src" / "test.jsonl", GSM8K[:2])
    written = script.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out")])
    assert written == {s: str(tmp_path / "out" / f"{s}.parquet") for s in ("train", "test")}
    got = read_back(written["train"])
    assert [int(i) for i in got["id"]] == [0, 1, 2]
    assert got["ground_truth"] == ["72", "10", "1234"]  # the number after ####, commas removed
    assert set(got["data_source"]) == {"openai/gsm8k"}
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    for prompt, row in zip(got["prompt"], GSM8K):
        assert chat_messages(prompt) == [{"role": "user", "content": f"{row['question']} {instruction}"}]
    assert_scored(got, lambda t: f"So the answer is:\n#### {t}", "#### 99999", gsm8k)
    assert len(read_back(written["test"])["id"]) == 2
    extra = pq.read_table(written["train"]).column("extra_info").to_pylist()[2]
    assert extra == {
        "split": "train",
        "index": 2,
        "answer": GSM8K[2]["answer"],
        "question": GSM8K[2]["question"],
    }


def test_sources_limit_and_fsspec_urls(scripts, tmp_path):
    """A hub snapshot's config folder is picked; one file gives its split alone; --limit caps each split;
    --out may be any fsspec URL; a folder without train / test files is refused."""
    script = scripts["gsm8k"]
    write(tmp_path / "hub" / "main" / "train-00000-of-00001.parquet", GSM8K)
    write(tmp_path / "hub" / "main" / "test-00000-of-00001.parquet", GSM8K)
    write(tmp_path / "hub" / "socratic" / "train-00000-of-00001.parquet", GSM8K[:1])  # another config
    out = "memory://data_prep_test/gsm8k"
    try:
        written = script.main(["--source", str(tmp_path / "hub"), "--out", out, "--limit", "2"])
        assert written == {"train": f"{out}/train.parquet", "test": f"{out}/test.parquet"}
        got = read_back(written["train"])
        assert [int(i) for i in got["id"]] == [0, 1] and got["ground_truth"] == ["72", "10"]
    finally:
        fsspec.filesystem("memory").rm("/data_prep_test", recursive=True)
    one = tmp_path / "hub" / "main" / "test-00000-of-00001.parquet"
    assert list(script.main(["--source", str(one), "--out", str(tmp_path / "one")])) == ["test"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no parquet or jsonl file whose name starts with train or test"):
        script.main(["--source", str(tmp_path / "empty"), "--out", str(tmp_path / "x")])
    with pytest.raises(ValueError, match="ends with '#### <number>'"):
        script.to_verl({"question": "q", "answer": "no final line"}, "train", 0)


# ---- MATH ------------------------------------------------------------------------------------------------
MATH = [
    {
        "problem": "Half of one?",
        "solution": "It is $\\boxed{\\frac{1}{2}}$.",
        "level": "Level 1",
        "type": "Algebra",
    },
    {
        "problem": "Simplify $\\sqrt{12}$.",
        "solution": "First \\boxed{\\sqrt{12}}, then $\\boxed{2\\sqrt{3}}$.",  # the last boxed answer
        "level": "Level 2",
        "type": "Algebra",
    },
    {
        "problem": "Solve $x^2=4$.",
        "solution": "So $x \\in \\boxed{\\{-2, 2\\}}$",
        "level": "Level 3",
        "type": "Algebra",
    },
]


def test_math_to_verl_layout_read_by_the_library(scripts, tmp_path):
    script = scripts["math_lighteval"]
    write(tmp_path / "src" / "data" / "train-00000-of-00001.parquet", MATH)  # the hub repository's layout
    write(tmp_path / "src" / "data" / "test-00000-of-00001.parquet", MATH[:1])
    written = script.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out")])
    got = read_back(written["train"])
    assert [int(i) for i in got["id"]] == [0, 1, 2]
    assert got["ground_truth"] == ["\\frac{1}{2}", "2\\sqrt{3}", "\\{-2, 2\\}"]
    assert set(got["data_source"]) == {"DigitalLearningGmbH/MATH-lighteval"}
    for prompt, row in zip(got["prompt"], MATH):
        assert chat_messages(prompt) == [{"role": "user", "content": f"{row['problem']} {BOXED}"}]
    assert_scored(got, lambda t: f"The answer is $\\boxed{{{t}}}$.", "\\boxed{7}", math_verify)
    source = got["data_source"][0]
    assert math_reward("\\boxed{0.5}", got["ground_truth"][0], source) == 1.0  # math-verify, not exact match
    assert math_reward("\\boxed{\\{2, -2\\}}", got["ground_truth"][2], source) == 1.0
    extra = pq.read_table(written["train"]).column("extra_info").to_pylist()[1]
    assert extra == {"split": "train", "index": 1, "level": "Level 2", "type": "Algebra"}


def test_last_boxed(scripts):
    last_boxed = scripts["math_lighteval"].last_boxed
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\boxed{x} then \\fbox{y}") == "y"
    assert last_boxed("no answer") is None and last_boxed("\\boxed{open") is None
    with pytest.raises(ValueError, match="no \\\\boxed"):
        scripts["math_lighteval"].to_verl({**MATH[0], "solution": "none"}, "test", 4)


# ---- Geometry3K ------------------------------------------------------------------------------------------
def picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(7, 9, 3), dtype=np.uint8)


def png_bytes(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


def rgb_pixels(images: list) -> np.ndarray:
    """A `pixels` processor for EvalRows that keeps each decoded image's exact RGB values, [I, 3, H, W]."""
    return np.stack([np.asarray(im.convert("RGB"), np.float32).transpose(2, 0, 1) for im in images])


def test_geo3k_to_verl_layout_read_by_the_library(scripts, tmp_path):
    script = scripts["geo3k"]
    schema = pa.schema(
        [("images", image_arrow_type()), ("problem", pa.string()), ("answer", pa.string())]
    )  # the hub's parquet: datasets' Image feature
    rows = [
        {
            "images": [{"bytes": png_bytes(picture(0)), "path": None}],
            "problem": "<image>Find x.",
            "answer": "3",
        },
        {
            "images": [{"bytes": png_bytes(picture(1)), "path": None}],
            "problem": "Find y.",
            "answer": "2\\sqrt{221}",
        },
    ]
    for split in ("train", "validation", "test"):
        write(tmp_path / "src" / "data" / f"{split}-00000-of-00001.parquet", rows, schema)
    written = script.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "out")])
    assert sorted(written) == ["test", "train"]  # the validation split left out
    got = read_back(written["train"], pixels=rgb_pixels)
    assert [int(i) for i in got["id"]] == [0, 1] and got["ground_truth"] == ["3", "2\\sqrt{221}"]
    assert set(got["data_source"]) == {"hiyouga/geometry3k"}
    contents = [f"<image>Find x. {BOXED}", f"<image>Find y. {BOXED}"]  # one placeholder per figure, never two
    assert [chat_messages(p) for p in got["prompt"]] == [[{"role": "user", "content": c}] for c in contents]
    assert got[ERROR] == ["", ""]  # each row's placeholders match its images, which decode
    for seed, pixels in enumerate(got[PIXELS]):
        np.testing.assert_array_equal(pixels[0].transpose(1, 2, 0), picture(seed))
    table = pq.read_table(written["train"])
    assert table.schema.field("images").type == image_arrow_type()
    cell = table.column("images").to_pylist()[1]
    assert cell[0]["path"] is None and cell[0]["bytes"].startswith(b"\x89PNG")
    assert_scored(got, lambda t: f"<think>...</think> \\boxed{{{t}}}", "\\boxed{7}", math_verify)


def test_geo3k_row_from_the_hub_holds_png_bytes(scripts):
    """`datasets` hands the hub's images as PIL images; a local copy may hold JPEG bytes: both become PNG."""
    to_verl = scripts["geo3k"].to_verl
    pil = to_verl(
        {"images": [Image.fromarray(picture(2))], "problem": "<image>Find z.", "answer": "5"}, "test", 3
    )
    jpeg = to_verl(
        {"images": [{"bytes": png_bytes(picture(3), "JPEG")}], "problem": "Q", "answer": "1"}, "test", 4
    )
    for row in (pil, jpeg):
        assert row["images"][0]["bytes"].startswith(b"\x89PNG") and row["images"][0]["path"] is None
    np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(pil["images"][0]["bytes"]))), picture(2))
    assert pil["extra_info"] == {"split": "test", "index": 3, "answer": "5", "question": "<image>Find z."}
    assert jpeg["prompt"][0]["content"] == f"<image>Q {BOXED}"
