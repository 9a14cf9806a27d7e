"""Prompt-file checks that run on the driver before any cluster work."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt_ray import DataError
from yatt_ray.config import DataConfig
from yatt_ray.data import check_sources


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_parquet_glob_expands(tmp_path):
    for i in range(2):
        write(tmp_path / f"part{i}.parquet", [{"id": i, "prompt": "1+1=", "ground_truth": "2"}])
    files = check_sources(DataConfig(train_files=[str(tmp_path / "*.parquet")]))
    assert [f.rsplit("/", 1)[1] for f in files] == ["part0.parquet", "part1.parquet"]


def test_missing_prompt_column_names_columns_and_fix(tmp_path):
    path = write(tmp_path / "t.parquet", [{"question": "1+1=", "ground_truth": "2"}])
    with pytest.raises(DataError) as info:
        check_sources(DataConfig(train_files=[path]))
    message = str(info.value)
    assert "no column 'prompt' (data.prompt_key)" in message
    assert "['ground_truth', 'question']" in message and "Set data.prompt_key=<column>" in message


def test_renamed_columns_are_accepted(tmp_path):
    path = write(tmp_path / "t.parquet", [{"question": "1+1=", "answer": "2"}])
    assert check_sources(DataConfig(train_files=[path], prompt_key="question", answer_key="answer")) == [path]


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(DataError, match="matches no file|does not exist"):
        check_sources(DataConfig(train_files=[str(tmp_path / "nope.parquet")]))
    (tmp_path / "t.csv").write_text("prompt,ground_truth\n")
    with pytest.raises(DataError, match="unknown extension; use .parquet or .jsonl"):
        check_sources(DataConfig(train_files=[str(tmp_path / "t.csv")]))


def test_jsonl_and_memory_filesystem(tmp_path):
    import fsspec

    with fsspec.open("memory://bucket/train.jsonl", "w") as f:
        f.write(json.dumps({"prompt": "2+2=", "ground_truth": "4"}) + "\n")
    (found,) = check_sources(DataConfig(train_files=["memory://bucket/train.jsonl"]))
    assert found.startswith("memory://") and found.endswith("bucket/train.jsonl")
    with fsspec.open("memory://bucket/bad.jsonl", "w") as f:
        f.write(json.dumps({"text": "2+2="}) + "\n")
    with pytest.raises(DataError, match="no column 'prompt'"):
        check_sources(DataConfig(train_files=["memory://bucket/bad.jsonl"]))


def test_empty_list():
    with pytest.raises(DataError, match="data.train_files is empty"):
        check_sources(DataConfig())
