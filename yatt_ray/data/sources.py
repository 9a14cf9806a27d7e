"""Read prompt files (parquet or jsonl, any fsspec URL) into a Ray Dataset with canonical columns.

`check_sources` runs on the driver before the cluster does any work: it expands globs, checks that each
file exists, that the configured columns are present and that it holds rows, and warns about repeated ids.
Parquet files are checked from their footer metadata (plus the id column); jsonl files have no metadata, so
they are streamed line by line (each line parsed once, none kept). `first_row` reads one row (the reward
function's dry call). `build_dataset` is lazy: rows are read by Ray Data tasks, never by the driver.

Images (a vision-language policy): with `images=True` the image column (`data.image_key`) must be in every
file (parquet: its footer; the driver reads no image), and `build_dataset` decodes each row's images and runs
the image processor in Ray Data tasks (`yatt_ray.data.images`), after the shuffle. A text policy given files
with that column is stopped before any work (its `<image>` placeholders would be trained as text).

Nested fields. Every key setting (data.prompt_key, answer_key, source_key, id_key, image_key) may name a field
inside a struct column (parquet) or a nested object (jsonl) by a dotted path, as verl's files hold them:
`reward_model.ground_truth`, `extra_info.index`. A top-level column whose own name is the whole key wins (a
column named "a.b" is read as it is); otherwise the longest dotted prefix that is a column is taken and the
rest of the key is looked up inside it (`key_path`). Parquet files are checked from their footer schema (the
struct's fields); the Ray Data tasks pick the field out of the struct column's values (numpy batches hold a
struct column as an object array of dicts). A row whose struct is null reads as missing (id -1, source
"default", prompt / answer None).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec

from yatt_ray.config import DataConfig
from yatt_ray.errors import DataError

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ("id", "prompt", "ground_truth", "data_source")
# the keys that read a verl-format parquet (GSM8K / MATH from verl's preprocessing scripts) as it is; its
# `prompt` (a chat list) and `data_source` columns match the defaults
VERL_KEYS = {"answer_key": "reward_model.ground_truth", "id_key": "extra_info.index"}
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
_MISSING = object()  # an id column that a file (or a jsonl line) lacks


def check_sources(
    data: DataConfig, key: str = "data.train_files", min_rows: int = 1, images: bool = False
) -> list[str]:
    """Expanded file list for `key` (data.train_files or data.eval_files); DataError naming file, column, fix.

    Raises on a missing file, a missing prompt / answer column, an empty file, a malformed jsonl line (its
    1-based number) and fewer than `min_rows` rows over all the files; warns when ids (`data.id_key`) are
    missing or repeated, since the data position of a checkpoint is a set of ids. `images`: the policy reads
    images, so every file needs the image column; without, no file may have it (a non-empty data.image_key).
    """
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
            files.append(url)
    if len({_format(f) for f in files}) > 1:
        raise DataError(f"{key} mixes formats ({files}); use one of parquet or jsonl per run")
    ids = _IdTally(data.id_key)
    rows = 0
    for url in files:
        rows += _check_file(url, data, ids, images)
    if rows < min_rows:
        raise DataError(
            f"{key} holds {rows} rows over {len(files)} file(s), fewer than the {min_rows} needed (one step's "
            "prompts, train.prompts_per_step); add data or lower train.prompts_per_step"
        )
    ids.warn(key)
    log.info("%s: %d rows in %d file(s)", key, rows, len(files))
    return files


def first_row(data: DataConfig, files: list[str]) -> tuple[str, str, str]:
    """(prompt, ground_truth, data_source) of the first row of `files[0]`, read alone (parquet: one row of the
    first row group; jsonl: the first non-blank line), as `build_dataset` would give them (dotted keys read
    nested fields)."""
    url = files[0]
    keys = [data.prompt_key, data.answer_key, data.source_key]
    if _format(url) == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb") as f:
            pf = pq.ParquetFile(f)
            shape = _schema_shape(pf.schema_arrow)
            paths = [key_path(key, shape) for key in keys]
            columns = sorted({path[0] for path in paths if path})
            row = next((b.to_pylist()[0] for b in pf.iter_batches(batch_size=1, columns=columns)), None)
    else:
        with fsspec.open(url, "r") as f:
            row = next((obj for _, obj in _jsonl_rows(f, url)), None)
    if row is None:
        raise DataError(f"data file {url!r} holds no rows; remove it from the data file lists or fill it")
    prompt, answer, source = (lookup(row, key) for key in keys)
    return str(prompt), str(answer), str("default" if source is _MISSING or source is None else source)


# ---- dotted keys ---------------------------------------------------------------------------------------
def key_path(key: str, shape: Any) -> list[str] | None:
    """The field names that `key` walks through `shape` (a row dict, or `_schema_shape` of a file), or None.

    A name that is the whole key wins; otherwise, longest first, a dotted prefix that names a nested mapping
    and a rest that resolves inside it: "reward_model.ground_truth" -> ["reward_model", "ground_truth"].
    """
    if not isinstance(shape, Mapping):
        return None
    if key in shape:
        return [key]
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:cut])
        if isinstance(shape.get(head), Mapping):
            rest = key_path(".".join(parts[cut:]), shape[head])
            if rest is not None:
                return [head, *rest]
    return None


def lookup(row: Any, key: str, default: Any = _MISSING) -> Any:
    """`row`'s value at the dotted `key` (see `key_path`), or `default` when it has none."""
    path = key_path(key, row)
    if path is None:
        return default
    for name in path:
        row = row[name]
    return row


def nested_names(shape: Mapping) -> list[str]:
    """Every dotted key inside the nested mappings of `shape` (top-level names excluded), for messages."""
    return [name for top, sub in shape.items() if isinstance(sub, Mapping) for name in _flat(sub, f"{top}.")]


def _flat(shape: Mapping, prefix: str) -> list[str]:
    names: list[str] = []
    for name, sub in shape.items():
        names.append(prefix + name)
        if isinstance(sub, Mapping):
            names += _flat(sub, f"{prefix}{name}.")
    return names


def _schema_shape(schema: Any) -> dict[str, Any]:
    """A pyarrow schema as nested dicts: a struct column -> {field: ...}, any other column -> its type."""
    import pyarrow as pa

    def shape(arrow_type: Any) -> Any:
        if pa.types.is_struct(arrow_type):
            return {f.name: shape(f.type) for f in arrow_type}
        return arrow_type

    return {f.name: shape(f.type) for f in schema}


def _batch_column(batch: Mapping[str, Any], key: str, default: Any, n: int) -> Any:
    """The values of the dotted `key` in a numpy batch: the column itself, or the field picked out of each
    row's dict of a struct column (`default` where a row's struct or field is null, or lacks the field);
    `[default] * n` when no column matches."""
    if key in batch:
        return batch[key]
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:cut])
        if head in batch:
            rest = ".".join(parts[cut:])
            values = (lookup(cell, rest, None) for cell in batch[head])
            return _as_array([default if v is None else v for v in values])
    return [default] * n


def _as_array(values: list) -> Any:
    """A 1-d numpy array of `values`: typed when they are all scalars, else an object array holding them as
    they are (numpy would stack a list of equal-length lists into 2-d)."""
    import numpy as np

    if all(isinstance(v, str | int | float | bool | np.generic) for v in values):
        return np.asarray(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _format(path: str) -> str:
    for suffix, fmt in _FORMATS.items():
        if path.endswith(suffix):
            return fmt
    raise DataError(f"data file {path!r} has an unknown extension; use .parquet or .jsonl")


class _IdTally:
    """Counts ids over the files: how many repeat an id seen before, and the rows without one."""

    def __init__(self, id_key: str) -> None:
        self.id_key = id_key
        self.seen: set = set()
        self.repeats = 0
        self.examples: list = []
        self.missing: list[str] = []  # files with rows that lack the id column

    def add(self, value: Any) -> None:
        try:
            hash(value)
        except TypeError:
            value = repr(value)
        if value in self.seen:
            self.repeats += 1
            if len(self.examples) < 3:
                self.examples.append(value)
        else:
            self.seen.add(value)

    def warn(self, key: str) -> None:
        if self.missing:
            log.warning(
                "%s: %d file(s) (%s) have rows without the id column %r (data.id_key): those rows get id -1, so the "
                "data position (which prompt ids an epoch consumed) is not recorded for them and a resumed run "
                "re-trains them; give every row a unique id in a column named by data.id_key",
                key,
                len(self.missing),
                ", ".join(self.missing[:3]) + (", ..." if len(self.missing) > 3 else ""),
                self.id_key,
            )
        if self.repeats:
            log.warning(
                "%s: %d row(s) repeat an id of the column %r (data.id_key) over the files (e.g. %s): the data "
                "position (which prompt ids an epoch consumed) assumes unique ids, so a resumed run may re-train "
                "or skip the rows sharing an id; give every row a unique id",
                key,
                self.repeats,
                self.id_key,
                ", ".join(repr(v) for v in self.examples),
            )


def _check_file(url: str, data: DataConfig, ids: _IdTally, images: bool = False) -> int:
    """The number of rows in `url`, after checking its columns and (jsonl) every line."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise DataError(f"data file {url!r} does not exist; check the data file lists")
    if _format(path) == "parquet":
        rows = _check_parquet(fs, path, url, data, ids, images)
    else:
        rows = _check_jsonl(fs, path, url, data, ids, images)
    if rows == 0:
        raise DataError(f"data file {url!r} holds no rows; remove it from the data file lists or fill it")
    return rows


def _need_columns(url: str, shape: Mapping, data: DataConfig, where: str = "", images: bool = False) -> None:
    """DataError unless `shape` (a file's schema as `_schema_shape` gives it, or a jsonl row) holds the prompt
    and answer keys (dotted keys: nested fields), and the image key exactly when `images`."""
    for key_name, column in (("data.prompt_key", data.prompt_key), ("data.answer_key", data.answer_key)):
        if key_path(column, shape) is None:
            raise DataError(
                f"data file {url!r}{where} has no column {column!r} ({key_name}); its columns are "
                f"{_described(shape)}. Set {key_name}=<column> to the right one (a dotted key such as "
                f"reward_model.ground_truth names a field of a struct column).{_verl_hint(shape, data)}"
            )
    has_images = bool(data.image_key) and key_path(data.image_key, shape) is not None
    if images and not has_images:
        raise DataError(
            f"data file {url!r}{where} has no image column {data.image_key!r} (data.image_key) but the policy "
            f"(model.path) is a vision-language model; its columns are {_described(shape)}. Set "
            "data.image_key=<column> to the column holding each row's images, or train a text model."
        )
    if not images and has_images:
        raise DataError(
            f"data file {url!r}{where} has an image column {data.image_key!r} (data.image_key) but the policy "
            "(model.path) is a text-only model, which would read the prompts' <image> placeholders as text. "
            "Point model.path at a LLaVA-architecture model, or set data.image_key='' to train on the text alone."
        )


def _described(shape: Mapping) -> str:
    """ "['a', 'b']", plus " and the nested fields ['b.c', ...]" when a column is a struct (object)."""
    nested = nested_names(shape)
    return f"{sorted(shape)}" + (f" and the nested fields {sorted(nested)}" if nested else "")


def _verl_hint(shape: Mapping, data: DataConfig) -> str:
    """A pointer to the verl keys when the file has verl's layout (reward_model.ground_truth)."""
    if key_path(VERL_KEYS["answer_key"], shape) is None or data.answer_key == VERL_KEYS["answer_key"]:
        return ""
    return (
        " This file has verl's layout: use " + " ".join(f"data.{k}={v}" for k, v in VERL_KEYS.items()) + "."
    )


def _check_parquet(fs, path: str, url: str, data: DataConfig, ids: _IdTally, images: bool = False) -> int:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        try:
            metadata = pq.read_metadata(f)
        except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) or OSError on a broken footer
            raise DataError(
                f"data file {url!r} is not a readable parquet file ({type(exc).__name__}: {exc}); rewrite it, "
                "or fix its extension"
            ) from exc
        shape = _schema_shape(metadata.schema.to_arrow_schema())
        _need_columns(url, shape, data, images=images)
        id_path = key_path(data.id_key, shape)
        if metadata.num_rows and id_path is not None:
            f.seek(0)
            column = pq.read_table(f, columns=[id_path[0]]).column(0)
            if len(id_path) > 1:  # a field of a struct column (a null struct gives a null id)
                column = pc.struct_field(column.combine_chunks(), id_path[1:])
            for value in column.to_pylist():
                ids.add(value)
        elif metadata.num_rows:
            ids.missing.append(url)
    return int(metadata.num_rows)


def _check_jsonl(fs, path: str, url: str, data: DataConfig, ids: _IdTally, images: bool = False) -> int:
    rows, missing = 0, False
    with fs.open(path, "r") as f:
        for number, obj in _jsonl_rows(f, url):
            if rows == 0:
                _need_columns(url, obj, data, where=f" (line {number})", images=images)
            else:
                for key_name, column in (
                    ("data.prompt_key", data.prompt_key),
                    ("data.answer_key", data.answer_key),
                ):
                    if key_path(column, obj) is None:
                        raise DataError(
                            f"data file {url!r} line {number} has no key {column!r} ({key_name}); its keys are "
                            f"{_described(obj)}. Every line needs the prompt and answer keys: fix or remove that line"
                        )
            value = lookup(obj, data.id_key)
            if value is _MISSING:
                missing = True
            else:
                ids.add(value)
            rows += 1
    if missing:
        ids.missing.append(url)
    return rows


def _jsonl_rows(f, url: str) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line; DataError on a line that is not a JSON object."""
    for number, line in enumerate(f, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"data file {url!r} line {number} is not valid JSON ({exc.msg} at column {exc.colno}): "
                f"{line.strip()[:80]!r}; fix or remove that line (a .jsonl file holds one JSON object per line)"
            ) from exc
        if not isinstance(obj, dict):
            raise DataError(
                f"data file {url!r} line {number} is a JSON {type(obj).__name__}, not an object: "
                f"{line.strip()[:80]!r}; each line of a .jsonl file must be one object with the prompt and answer keys"
            )
        yield number, obj


def build_dataset(data: DataConfig, files: list[str], pixels: Any = None):
    """A lazy Ray Dataset with columns PROMPT_COLUMNS (id, prompt, ground_truth, data_source).

    A file without the id or data-source column gets -1 ids and source "default". `pixels` (a vision policy's
    image processor, e.g. `yatt_ray.data.images.ClipPixels(model_dir)`): the image column is read too and, in
    Ray Data tasks after the shuffle, decoded and processed into the columns `images.PIXELS` (float32
    [I, 3, H, W] a row), `images.SIZES` and `images.ERROR` (see `images.decode_images_batch`; bad rows are
    kept, flagged, under data.on_bad_image=skip).
    """
    import ray.data

    from yatt_ray.data.images import decode_images_batch

    reader = ray.data.read_parquet if _format(files[0]) == "parquet" else ray.data.read_json
    ds = reader(files).map_batches(canonical_columns(data, images=pixels is not None), batch_format="numpy")
    if data.shuffle_seed is not None:
        ds = ds.random_shuffle(seed=data.shuffle_seed)
    if pixels is not None:
        options = {"image_column": "images", "processor_fn": pixels, "on_bad_image": data.on_bad_image}
        ds = ds.map_batches(decode_images_batch, batch_format="numpy", fn_kwargs=options)
    return ds


def canonical_columns(data: DataConfig, images: bool = False):
    """The batch function (column -> values, for `Dataset.map_batches`) that maps the configured columns (dotted
    keys into struct columns included) to PROMPT_COLUMNS, and with `images` the image column to "images"."""
    keys = {
        "id": data.id_key,
        "prompt": data.prompt_key,
        "ground_truth": data.answer_key,
        "data_source": data.source_key,
        **({"images": data.image_key} if images else {}),
    }
    defaults = {"id": -1, "data_source": "default"}

    def to_canonical(batch: dict) -> dict:
        n = len(next(iter(batch.values()))) if batch else 0
        out = {name: _batch_column(batch, col, defaults.get(name), n) for name, col in keys.items()}
        out["ground_truth"] = [str(v) for v in out["ground_truth"]]
        return out

    return to_canonical
