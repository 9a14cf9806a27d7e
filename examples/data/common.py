"""What the data-preparation scripts share: the command line, reading a source and writing verl's layout.

A source is a Hugging Face hub id (loaded with `datasets`) or a local copy (any path or fsspec URL that
exists): a parquet / jsonl file, or a folder searched for them, each file's split named by the start of its
file name (train.jsonl, test-00000-of-00001.parquet; other splits are left out). The output folder (a path or
URL such as s3://bucket/gsm8k) gets train.parquet and test.parquet in verl's layout (`verl_row`), which
yatt_ray reads with data.answer_key=reward_model.ground_truth data.id_key=extra_info.index.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

SPLITS = ("train", "test")
BOXED = "Let's think step by step and output the final answer within \\boxed{}."
Convert = Callable[[dict, str, int], dict]  # to_verl(row, split, index) -> a verl row


def verl_row(source: str, content: str, truth: str, split: str, index: int, **extra: Any) -> dict:
    """One row of verl's layout: a one-message chat prompt, the ground truth, the row's split and index."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, **extra},
    }


def run(convert: Convert, hub_id: str, doc: str, config: str | None = None, types=None, argv=None) -> dict:
    """The script: parse `argv`, convert each split of the source, write it; {split: URL written}.
    `types`: arrow types of columns that inference would get wrong (e.g. an all-null struct field)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder: a local path or fsspec URL")
    parser.add_argument("--source", default=hub_id, help=f"hub id or local file/folder (default {hub_id})")
    parser.add_argument("--limit", type=int, default=None, help="at most this many rows a split")
    args = parser.parse_args(argv)
    written = {}
    for split, rows in read_source(args.source, config, args.limit):
        table = [convert(row, split, index) for index, row in enumerate(rows)]
        written[split] = write_split(table, args.out, split, types or {})
    return written


def read_source(source: str, config: str | None, limit: int | None) -> Iterator[tuple[str, Iterable[dict]]]:
    """(split, its rows as dicts, at most `limit`) for each split the source has."""
    if "://" not in source and not os.path.exists(source):  # a hub id
        try:
            from datasets import load_dataset
        except ImportError as exc:
            raise SystemExit(f"loading {source!r} from the hub needs `pip install datasets`") from exc
        dataset = load_dataset(source, config)
        for split in SPLITS:
            rows = dataset[split]
            yield split, rows if limit is None else rows.select(range(min(limit, len(rows))))
        return
    fs, root = fsspec.core.url_to_fs(source)
    files = sorted(fs.find(root)) if fs.isdir(root) else [root]
    if config and any(f"/{config}/" in f for f in files):  # a hub snapshot holding several configs
        files = [f for f in files if f"/{config}/" in f]
    files = [f for f in files if f.endswith((".parquet", ".jsonl"))]
    by_split = {s: [f for f in files if posixpath.basename(f).startswith(s)] for s in SPLITS}
    if not any(by_split.values()):
        raise SystemExit(f"{source}: no parquet or jsonl file whose name starts with {' or '.join(SPLITS)}")
    for split, mine in by_split.items():
        if mine:
            yield split, [row for f in mine for row in _read(fs, f)][:limit]


def _read(fs, path: str) -> list[dict]:
    with fs.open(path, "rb") as f:
        if path.endswith(".parquet"):
            return pq.read_table(f).to_pylist()
        return [json.loads(line) for line in f if line.strip()]


def write_split(rows: list[dict], out: str, split: str, types: dict) -> str:
    """`rows` written to `<out>/<split>.parquet` through fsspec; the URL written."""
    table = pa.Table.from_pylist(rows)
    for name, arrow_type in types.items():
        table = table.set_column(table.schema.get_field_index(name), name, table[name].cast(arrow_type))
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    url = posixpath.join(out, f"{split}.parquet")
    with fsspec.open(url, "wb") as f:
        pq.write_table(table, f)
    print(f"{split}: {len(rows)} rows -> {url}")
    return url
