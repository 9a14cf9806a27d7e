"""Read prompt files (parquet or jsonl, any fsspec URL) into a Ray Dataset with canonical columns.

`check_sources` runs on the driver before the cluster does any work: it expands globs, checks that each
file exists and that the configured columns are present, reading only file metadata (parquet footer or
the first jsonl line). `build_dataset` is lazy: rows are read by Ray Data tasks, never by the driver.
"""

from __future__ import annotations

import json

import fsspec

from yatt_ray.config import DataConfig
from yatt_ray.errors import DataError

PROMPT_COLUMNS = ("id", "prompt", "ground_truth", "data_source")
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def check_sources(data: DataConfig, key: str = "data.train_files") -> list[str]:
    """Expanded file list for `key` (data.train_files or data.eval_files); DataError naming file, column, fix."""
    patterns = data.train_files if key == "data.train_files" else data.eval_files
    if not patterns:
        raise DataError(f"{key} is empty; give parquet or jsonl files, e.g. {key}=[data/train.parquet]")
    files: list[str] = []
    for pattern in patterns:
        fs, _, paths = fsspec.get_fs_token_paths(pattern)
        if not paths:
            raise DataError(f"{key} entry {pattern!r} matches no file; check the path or glob")
        for path in sorted(paths):
            url = fs.unstrip_protocol(path) if "://" in pattern else path
            _check_columns(fs, path, url, data)
            files.append(url)
    if len({_format(f) for f in files}) > 1:
        raise DataError(f"data.train_files mixes formats ({files}); use one of parquet or jsonl per run")
    return files


def _format(path: str) -> str:
    for suffix, fmt in _FORMATS.items():
        if path.endswith(suffix):
            return fmt
    raise DataError(f"data file {path!r} has an unknown extension; use .parquet or .jsonl")


def _check_columns(fs, path: str, url: str, data: DataConfig) -> None:
    if not fs.exists(path):
        raise DataError(f"data file {url!r} does not exist; check the data file lists")
    if _format(path) == "parquet":
        import pyarrow.parquet as pq

        with fs.open(path, "rb") as f:
            columns = set(pq.read_schema(f).names)
    else:
        with fs.open(path, "r") as f:
            first = f.readline()
        columns = set(json.loads(first)) if first.strip() else set()
    for key_name, column in (("data.prompt_key", data.prompt_key), ("data.answer_key", data.answer_key)):
        if column not in columns:
            raise DataError(
                f"data file {url!r} has no column {column!r} ({key_name}); its columns are {sorted(columns)}. "
                f"Set {key_name}=<column> to the right one."
            )


def build_dataset(data: DataConfig, files: list[str]):
    """A lazy Ray Dataset with columns PROMPT_COLUMNS (id, prompt, ground_truth, data_source).

    A file without the id or data-source column gets -1 ids and source "default".
    """
    import ray.data

    reader = ray.data.read_parquet if _format(files[0]) == "parquet" else ray.data.read_json
    keys = {
        "id": data.id_key,
        "prompt": data.prompt_key,
        "ground_truth": data.answer_key,
        "data_source": data.source_key,
    }
    defaults = {"id": -1, "data_source": "default"}

    def to_canonical(batch: dict) -> dict:
        n = len(batch[data.prompt_key])
        out = {name: batch[col] if col in batch else [defaults[name]] * n for name, col in keys.items()}
        out["ground_truth"] = [str(v) for v in out["ground_truth"]]
        return out

    ds = reader(files).map_batches(to_canonical, batch_format="numpy")
    if data.shuffle_seed is not None:
        ds = ds.random_shuffle(seed=data.shuffle_seed)
    return ds
