"""verl-format data read as it is: dotted keys into struct columns (parquet) and nested objects (jsonl), on the
driver (check_sources, first_row) and in Ray Data tasks (build_dataset); data.system_prompt in rendering."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from yatt_ray import DataError
from yatt_ray.config import DataConfig
from yatt_ray.data import check_sources
from yatt_ray.data.images import chat_messages, prompt_text
from yatt_ray.data.sources import VERL_KEYS, _batch_column, first_row, key_path, lookup
from yatt_ray.models.tiny import build_tokenizer
from yatt_ray.prompts import PromptEncoder

VERL = dict(VERL_KEYS)  # answer_key, id_key
QUESTIONS = ["Natalia sold 48 clips. How many?", "Weng earns $12 an hour. How much?", "Betty needs $100."]
ANSWERS = ["72", "10", "5"]


def verl_rows(n: int = 3, start: int = 0) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": QUESTIONS[i % 3] + " Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ANSWERS[i % 3]},
            "extra_info": {"split": "train", "index": start + i, "answer": "... #### " + ANSWERS[i % 3]},
        }
        for i in range(n)
    ]


def write_verl(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def verl_config(path: str, **extra) -> DataConfig:
    return DataConfig(train_files=[path], **{**VERL, **extra})


def test_verl_parquet_checks_with_dotted_keys(tmp_path, caplog):
    path = write_verl(tmp_path / "train.parquet", verl_rows())
    schema = pq.read_schema(path)
    assert pa.types.is_struct(schema.field("reward_model").type)  # the keys do go through struct columns
    assert pa.types.is_list(schema.field("prompt").type)
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        assert check_sources(verl_config(path)) == [path]
    assert "without the id column" not in caplog.text and "repeat an id" not in caplog.text


def test_nested_ids_are_keyed_by_file(tmp_path, caplog):
    """verl's GSM8K and MATH files both index from 0: a run over both is checked without a warning (its
    prompts are keyed by file and index); an index repeated within one file is refused."""
    (tmp_path / "gsm8k").mkdir(), (tmp_path / "math").mkdir()
    gsm8k = write_verl(tmp_path / "gsm8k" / "train.parquet", verl_rows(3))
    math = write_verl(tmp_path / "math" / "train.parquet", verl_rows(3))
    with caplog.at_level(logging.WARNING, logger="yatt_ray.data.sources"):
        assert check_sources(DataConfig(train_files=[gsm8k, math], **VERL)) == [gsm8k, math]
    assert caplog.text == ""
    again = write_verl(tmp_path / "again.parquet", verl_rows(3) + verl_rows(2, start=1))  # index 1, 2 twice
    with pytest.raises(DataError) as info:
        check_sources(DataConfig(train_files=[gsm8k, again], **VERL))
    message = str(info.value)
    assert (
        f"data file {again!r} repeats ids of the column 'extra_info.index' (data.id_key): 2 row(s)" in message
    )
    assert "(e.g. 1, 2)" in message


def test_a_wrong_dotted_key_names_the_file_key_and_nested_fields(tmp_path):
    path = write_verl(tmp_path / "train.parquet", verl_rows())
    with pytest.raises(DataError) as info:
        check_sources(verl_config(path, answer_key="reward_model.answer"))
    message = str(info.value)
    assert f"data file {path!r} has no column 'reward_model.answer' (data.answer_key)" in message
    assert "'reward_model.ground_truth'" in message and "'reward_model.style'" in message
    assert "'extra_info.index'" in message and "'data_source'" in message


def test_default_keys_on_a_verl_file_point_at_the_verl_keys(tmp_path):
    path = write_verl(tmp_path / "train.parquet", verl_rows())
    with pytest.raises(DataError) as info:
        check_sources(DataConfig(train_files=[path]))
    message = str(info.value)
    assert "no column 'ground_truth' (data.answer_key)" in message
    assert "data.answer_key=reward_model.ground_truth data.id_key=extra_info.index" in message


def test_first_row_reads_nested_fields(tmp_path):
    path = write_verl(tmp_path / "train.parquet", verl_rows())
    prompt, truth, source = first_row(verl_config(path), [path])
    assert (truth, source) == ("72", "openai/gsm8k") and QUESTIONS[0] in prompt
    data = verl_config(path, source_key="extra_info.split")
    assert first_row(data, [path])[2] == "train"


def test_jsonl_nested_objects(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in verl_rows()))
    assert check_sources(verl_config(str(path))) == [str(path)]
    assert first_row(verl_config(str(path)), [str(path)])[1:] == ("72", "openai/gsm8k")
    lines = [json.dumps(row) for row in verl_rows(2)] + [json.dumps({"prompt": "p", "reward_model": {}})]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 3 has no key 'reward_model.ground_truth' \(data.answer_key\)"):
        check_sources(verl_config(str(path)))


def test_a_top_level_column_with_a_dot_wins(tmp_path):
    rows = [{"prompt": "1+1=", "meta.answer": "flat", "meta": {"answer": "nested"}, "id": 0}]
    path = write_verl(tmp_path / "t.parquet", rows)
    data = DataConfig(train_files=[path], answer_key="meta.answer")
    assert check_sources(data) == [path] and first_row(data, [path])[1] == "flat"
    only_flat = write_verl(tmp_path / "u.parquet", [{"prompt": "1+1=", "a.b": "2"}])
    assert first_row(DataConfig(train_files=[only_flat], answer_key="a.b"), [only_flat])[1] == "2"


def test_key_path_and_lookup():
    row = {"a": {"b.c": {"d": 1}, "b": 2}, "x.y": 3, "x": {"y": 4}}
    assert key_path("a.b.c.d", row) == ["a", "b.c", "d"] and lookup(row, "a.b.c.d") == 1
    assert lookup(row, "a.b") == 2 and lookup(row, "x.y") == 3  # the exact name first
    assert key_path("a.z", row) is None and lookup(row, "a.z", "none") == "none"
    assert lookup({"a": None}, "a.b", -1) == -1  # a null struct reads as missing


def test_batch_column_of_struct_cells():
    """What to_canonical does to a numpy batch: struct columns arrive as object arrays of dicts."""
    cells = np.array([{"index": 4, "split": "train"}, None, {"index": None, "split": "test"}], dtype=object)
    batch = {"extra_info": cells, "prompt": np.array(["a", "b", "c"], dtype=object)}
    ids = _batch_column(batch, "extra_info.index", -1, 3)
    assert list(ids) == [4, -1, -1] and ids.dtype == np.int64
    assert list(_batch_column(batch, "extra_info.split", "default", 3)) == ["train", "default", "test"]
    assert _batch_column(batch, "prompt", None, 3) is batch["prompt"]
    assert _batch_column(batch, "data_source", "default", 3) == ["default"] * 3
    lists = np.array([{"m": [1, 2]}, {"m": [3, 4]}], dtype=object)
    picked = _batch_column({"s": lists}, "s.m", None, 2)
    assert picked.shape == (2,) and picked[1] == [3, 4]  # lists kept as cells, not stacked into 2-d


# ---- data.system_prompt --------------------------------------------------------------------------------
def templated_tokenizer():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    return tokenizer


def test_system_prompt_with_a_chat_template():
    tokenizer = templated_tokenizer()
    encoder = PromptEncoder(tokenizer, max_tokens=200, system_prompt="Be brief.")
    out = encoder.encode({"id": 0, "prompt": "1+1="})
    assert out.text == "[system]Be brief.[user]1+1=[assistant]"  # a string prompt becomes [system, user]
    assert out.ids == list(tokenizer(out.text)["input_ids"])
    chat = np.array([{"role": "user", "content": "2+2="}], dtype=object)  # as Ray Data hands a chat list
    assert encoder.encode({"id": 1, "prompt": chat}).text == "[system]Be brief.[user]2+2=[assistant]"
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "3+3="}]
    assert encoder.encode({"id": 2, "prompt": own}).text == "[system]Mine.[user]3+3=[assistant]"
    plain = PromptEncoder(tokenizer, max_tokens=200)  # no system prompt: a string stays as it is
    assert plain.encode({"id": 0, "prompt": "1+1="}).text == "1+1="


def test_system_prompt_without_a_chat_template():
    tokenizer = build_tokenizer()  # character-level, no chat template
    assert not getattr(tokenizer, "chat_template", None)
    encoder = PromptEncoder(tokenizer, max_tokens=200, system_prompt="Be brief.")
    assert encoder.encode({"id": 0, "prompt": "1+1="}).text == "Be brief.\n1+1="
    chat = [{"role": "user", "content": "2+2="}]
    assert prompt_text(chat, tokenizer, system_prompt="Be brief.") == "Be brief.\n2+2="
    assert prompt_text(chat, tokenizer) == "2+2=" and prompt_text("1+1=", None, system_prompt="") == "1+1="


# ---- in Ray Data tasks (the shared cluster) ------------------------------------------------------------
def test_build_dataset_reads_a_verl_parquet(ray_cluster, tmp_path):
    from yatt_ray.data import build_dataset

    rows = verl_rows(3)
    rows[2]["extra_info"] = None  # a null struct: id -1
    path = write_verl(tmp_path / "train.parquet", rows)
    data = verl_config(path, shuffle_seed=None)
    out = sorted(build_dataset(data, [path]).take_all(), key=lambda r: (r["id"] < 0, r["id"]))
    assert set(out[0]) == {"id", "prompt", "ground_truth", "data_source"}
    assert [int(r["id"]) for r in out] == [0, 1, -1]
    assert [r["ground_truth"] for r in out] == ANSWERS
    assert {r["data_source"] for r in out} == {"openai/gsm8k"}
    for r, row in zip(out, rows):
        assert chat_messages(r["prompt"]) == row["prompt"]  # the chat list intact


def test_build_dataset_keys_two_verl_files_by_file_and_index(ray_cluster, tmp_path):
    """Two files that both index from 0 (parquet, then jsonl): each row's id names its file (read from the
    row's path, whatever order Ray Data reads the files in), so all ids differ; a row without an index gets ""."""
    from yatt_ray.data import build_dataset

    for ext in ("parquet", "jsonl"):
        files = []
        for name, answer in (("gsm8k", "g"), ("math", "m")):
            rows = verl_rows(3)
            for i, row in enumerate(rows):
                row["reward_model"]["ground_truth"] = f"{answer}{i}"  # which file a row came from
            rows[2]["extra_info"] = None
            path = tmp_path / ext / name / f"train.{ext}"
            path.parent.mkdir(parents=True)
            if ext == "parquet":
                write_verl(path, rows)
            else:
                path.write_text("".join(json.dumps(row) + "\n" for row in rows))
            files.append(str(path))
        out = build_dataset(DataConfig(train_files=files, **VERL), files).take_all()  # shuffled
        got = sorted((r["id"], r["ground_truth"]) for r in out)
        assert got == [
            ("", "g2"),
            ("", "m2"),
            (f"gsm8k/train.{ext}:0", "g0"),
            (f"gsm8k/train.{ext}:1", "g1"),
            (f"math/train.{ext}:0", "m0"),
            (f"math/train.{ext}:1", "m1"),
        ], ext
        assert set(out[0]) == {"id", "prompt", "ground_truth", "data_source"}  # the path column is dropped
