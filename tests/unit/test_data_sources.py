"""Prompt-file checks that run on the driver before any cluster work."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt_ray import DataError
from yatt_ray.config import DataConfig
from yatt_ray.data import check_sources
from yatt_ray.data.sources import first_row


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


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_empty_parquet_names_the_file(tmp_path):
    empty = pa.table({"prompt": pa.array([], pa.string()), "ground_truth": pa.array([], pa.string())})
    pq.write_table(empty, tmp_path / "empty.parquet")
    good = write(tmp_path / "good.parquet", [{"id": 0, "prompt": "1+1=", "ground_truth": "2"}])
    with pytest.raises(DataError) as info:
        check_sources(DataConfig(train_files=[good, str(tmp_path / "empty.parquet")]))
    assert f"data file {str(tmp_path / 'empty.parquet')!r} holds no rows" in str(info.value)


def test_empty_jsonl_names_the_file(tmp_path):
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"empty.jsonl' holds no rows; remove it"):
        check_sources(DataConfig(train_files=[path]))


def test_malformed_jsonl_line_names_the_file_and_line(tmp_path):
    row = json.dumps({"id": 1, "prompt": "1+1=", "ground_truth": "2"})
    path = write_jsonl(tmp_path / "t.jsonl", [row, "", '{"id": 2, "prompt": "2+2=", "ground_truth": 4'])
    with pytest.raises(DataError) as info:
        check_sources(DataConfig(train_files=[path]))
    message = str(info.value)
    assert f"data file {path!r} line 3 is not valid JSON" in message and "fix or remove that line" in message
    path = write_jsonl(tmp_path / "u.jsonl", [row, "[1, 2]"])
    with pytest.raises(DataError, match=r"u.jsonl' line 2 is a JSON list, not an object"):
        check_sources(DataConfig(train_files=[path]))
    path = write_jsonl(tmp_path / "v.jsonl", [row, row, json.dumps({"prompt": "3+3="})])
    with pytest.raises(DataError, match=r"v.jsonl' line 3 has no key 'ground_truth' \(data.answer_key\)"):
        check_sources(DataConfig(train_files=[path]))


def test_ids_repeated_across_files_warn(tmp_path, caplog, monkeypatch):
    a = write(tmp_path / "a.parquet", [{"id": i, "prompt": "p", "ground_truth": "g"} for i in range(3)])
    b = write(tmp_path / "b.parquet", [{"id": i, "prompt": "p", "ground_truth": "g"} for i in range(2, 5)])
    c = write_jsonl(tmp_path / "c.jsonl", [json.dumps({"id": 4, "prompt": "p", "ground_truth": "g"})])
    read_columns = []
    original = pq.read_table

    def spy(source, columns=None, **kwargs):  # the check reads the id column only
        read_columns.append(columns)
        return original(source, columns=columns, **kwargs)

    monkeypatch.setattr(pq, "read_table", spy)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        check_sources(DataConfig(train_files=[a, b]))
    assert read_columns == [["id"], ["id"]]
    assert "1 row(s) repeat an id of the column 'id' (data.id_key)" in caplog.text
    assert "resumed run may re-train or skip" in caplog.text and "give every row a unique id" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        d = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"id": 4, "prompt": "q", "ground_truth": "h"})])
        check_sources(DataConfig(train_files=[c, d]))
    assert "1 row(s) repeat an id" in caplog.text and "(e.g. 4)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        check_sources(DataConfig(train_files=[a]))
    assert caplog.text == ""


def test_rows_without_ids_warn(tmp_path, caplog):
    path = write(tmp_path / "t.parquet", [{"prompt": "p", "ground_truth": "g"}])
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        check_sources(DataConfig(train_files=[path]))
    assert "without the id column 'id' (data.id_key)" in caplog.text and "get id -1" in caplog.text


def test_too_few_rows_for_one_step(tmp_path):
    path = write(tmp_path / "t.parquet", [{"id": i, "prompt": "p", "ground_truth": "g"} for i in range(3)])
    assert check_sources(DataConfig(train_files=[path]), min_rows=3) == [path]
    with pytest.raises(
        DataError, match=r"data.train_files holds 3 rows over 1 file\(s\), fewer than the 4 needed"
    ):
        check_sources(DataConfig(train_files=[path]), min_rows=4)


def test_first_row_parquet_and_jsonl(tmp_path):
    rows = [{"q": f"{i}+1=", "a": i + 1, "data_source": "add"} for i in range(5)]
    path = write(tmp_path / "t.parquet", rows)
    data = DataConfig(prompt_key="q", answer_key="a")
    assert first_row(data, [path]) == ("0+1=", "1", "add")
    lines = ["", *(json.dumps({"q": r["q"], "a": r["a"]}) for r in rows)]
    assert first_row(data, [write_jsonl(tmp_path / "t.jsonl", lines)]) == ("0+1=", "1", "default")
