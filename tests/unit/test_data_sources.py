"""Prompt-file checks that run on the driver before any cluster work."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt_ray import DataError
from yatt_ray.config import DataConfig
from yatt_ray.data import check_sources
from yatt_ray.data.sources import check_position, first_row, id_prefixes, qualified_id


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


def test_ids_may_repeat_across_files_but_not_within_one(tmp_path, caplog, monkeypatch):
    """A run keys each prompt on (file, id): files that index alike are fine, an id repeated within one file is
    refused before any work, naming the file, the ids, their count and the fix."""
    a = write(tmp_path / "a.parquet", [{"id": i, "prompt": "p", "ground_truth": "g"} for i in range(3)])
    b = write(tmp_path / "b.parquet", [{"id": i, "prompt": "p", "ground_truth": "g"} for i in range(3)])
    c = write_jsonl(tmp_path / "c.jsonl", [json.dumps({"id": 4, "prompt": "p", "ground_truth": "g"})])
    d = write_jsonl(tmp_path / "d.jsonl", [json.dumps({"id": 4, "prompt": "q", "ground_truth": "h"})])
    read_columns = []
    original = pq.read_table

    def spy(source, columns=None, **kwargs):  # the check reads the id column only
        read_columns.append(columns)
        return original(source, columns=columns, **kwargs)

    monkeypatch.setattr(pq, "read_table", spy)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        assert check_sources(DataConfig(train_files=[a, b])) == [a, b]
        assert check_sources(DataConfig(train_files=[c, d])) == [c, d]
    assert read_columns == [["id"], ["id"]] and caplog.text == ""
    twice = write(
        tmp_path / "e.parquet", [{"id": i % 4, "prompt": "p", "ground_truth": "g"} for i in range(7)]
    )
    with pytest.raises(DataError) as info:
        check_sources(DataConfig(train_files=[a, twice]))
    message = str(info.value)
    assert f"data file {twice!r} repeats ids of the column 'id' (data.id_key): 3 row(s)" in message
    assert "(e.g. 0, 1, 2)" in message and "Give each row of the file a unique id in data.id_key" in message
    lines = [json.dumps({"id": "x", "prompt": "p", "ground_truth": "g"})] * 2
    with pytest.raises(DataError, match=r"f.jsonl' repeats ids .*: 1 row\(s\) .*\(e.g. 'x'\)"):
        check_sources(DataConfig(train_files=[write_jsonl(tmp_path / "f.jsonl", lines)]))
    assert check_sources(DataConfig(eval_files=[twice]), key="data.eval_files") == [twice]  # no position


def test_a_file_listed_twice_is_refused(tmp_path):
    a = write(tmp_path / "a.parquet", [{"id": 0, "prompt": "p", "ground_truth": "g"}])
    with pytest.raises(DataError, match="names the data file .*a.parquet' twice .*list each file once"):
        check_sources(DataConfig(train_files=[str(tmp_path / "*.parquet"), a]))


def test_rows_without_ids_warn(tmp_path, caplog):
    path = write(tmp_path / "t.parquet", [{"prompt": "p", "ground_truth": "g"}])
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        check_sources(DataConfig(train_files=[path]))
    assert "1 row(s) in 1 file(s)" in caplog.text and "no id in the column 'id' (data.id_key" in caplog.text
    caplog.clear()
    nulls = write(
        tmp_path / "n.parquet", [{"id": i, "prompt": "p", "ground_truth": "g"} for i in (0, None, None, -1)]
    )
    lines = [
        json.dumps({"prompt": "p", "ground_truth": "g"}),
        json.dumps({"id": 1, "prompt": "p", "ground_truth": "g"}),
    ]
    partial = write_jsonl(tmp_path / "p.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        check_sources(DataConfig(train_files=[nulls]))  # nulls and -1 are no ids, not one id repeated
        check_sources(DataConfig(train_files=[partial]))
    assert f"3 row(s) in 1 file(s) ({nulls} (3))" in caplog.text and f"({partial} (1))" in caplog.text
    assert "resumed run trains them again" in caplog.text


def test_id_prefixes_name_each_file_below_the_common_folder():
    """The name that qualifies a file's ids depends on the list alone and survives moving the data folder."""
    verl = ["/home/u/data/gsm8k/train.parquet", "/home/u/data/math/train.parquet"]
    assert list(id_prefixes(verl).values()) == ["gsm8k/train.parquet", "math/train.parquet"]
    moved = ["s3://bucket/rl/gsm8k/train.parquet", "s3://bucket/rl/math/train.parquet"]
    assert list(id_prefixes(moved).values()) == list(id_prefixes(verl).values())
    parts = ["/d/part-0.jsonl", "/d/sub/part-1.jsonl"]
    assert id_prefixes(parts) == {
        "/d/part-0.jsonl": "part-0.jsonl",
        "/d/sub/part-1.jsonl": "sub/part-1.jsonl",
    }
    assert id_prefixes(verl[:1]) == {}  # one file: ids stay as they are
    assert qualified_id("math/train.parquet", 17) == "math/train.parquet:17"
    assert qualified_id("m.jsonl", 17.0) == "m.jsonl:17" and qualified_id("m.jsonl", "a7") == "m.jsonl:a7"


def test_a_checkpoint_keyed_the_other_way_is_refused(tmp_path, caplog):
    """A position of plain ids (one file, or several keyed by an earlier version) does not resume a run over
    several files, nor one of "<file>:<id>" keys a run over one file; keys of a file left out are ignored."""
    for name in ("gsm8k", "math"):
        (tmp_path / name).mkdir()
        write(
            tmp_path / name / "train.parquet",
            [{"id": i, "prompt": "p", "ground_truth": "g"} for i in range(3)],
        )
    both = DataConfig(train_files=[str(tmp_path / "*" / "train.parquet")])
    one = DataConfig(train_files=[str(tmp_path / "gsm8k" / "train.parquet")])
    where = "checkpoint step 4 in /ckpt"
    with pytest.raises(DataError) as info:
        check_position({0: [0, 1, 2]}, both, where)
    message = str(info.value)
    assert message.startswith(
        f"{where}: its data position keys prompts as 0, 1, 2, but this run reads 2 files"
    )
    assert (
        "'gsm8k/train.parquet:<id>'" in message
        and "Resume with the data.train_files that run used" in message
    )
    keyed = {0: ["gsm8k/train.parquet:0", "math/train.parquet:0"], 1: ["math/train.parquet:2"]}
    with pytest.raises(DataError, match="keys prompts by file and id .* but this run reads one file"):
        check_position(keyed, one, where)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        check_position(keyed, both, where)  # the same files: fine
        check_position({0: [0, 5]}, one, where)  # one file, plain ids: as before
        check_position({}, both, where)
        assert caplog.text == ""
        check_position({0: ["gsm8k/train.parquet:1", "aime/train.parquet:1"]}, both, where)
    assert "1 of the 2 prompt ids of its data position name files this run does not read" in caplog.text


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


def test_footer_readers_scale_with_the_file_count_and_keep_the_users_setting(monkeypatch):
    """Ray Data starts 32 footer-reader actors (32 processes) for any parquet read; while a read is planned
    the count is one per 10 files (at most 32), and a user's RAY_DATA_PARQUET_FOOTER_NUM_ACTORS wins."""
    import os

    from yatt_ray.data.sources import FOOTER_ENV, footer_readers

    monkeypatch.delenv(FOOTER_ENV, raising=False)
    for files, readers in ((1, "1"), (10, "1"), (11, "2"), (1000, "32")):
        with footer_readers(files):
            assert os.environ[FOOTER_ENV] == readers
        assert FOOTER_ENV not in os.environ
    monkeypatch.setenv(FOOTER_ENV, "7")
    with footer_readers(1):
        assert os.environ[FOOTER_ENV] == "7"
    assert os.environ[FOOTER_ENV] == "7"
