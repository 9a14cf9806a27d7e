"""Read prompt files (parquet or jsonl, any fsspec URL) into a Ray Dataset with canonical columns.

`check_sources` runs on the driver before the cluster does any work: it expands globs, checks that each
file exists, that the configured columns are present and that it holds rows, and (training files) that no id
repeats within a file. Parquet files are checked from their footer metadata (plus the id column); jsonl files
have no metadata, so they are streamed line by line (each line parsed once, none kept). `first_row` reads one
row (the reward function's dry call). `build_dataset` is lazy: rows are read by Ray Data tasks, never by the
driver.

Prompt ids. A checkpoint's data position is the set of prompt ids each open epoch consumed (`data/feed.py`),
so an id must name one row. A run over one file keys a row on its id as it is (`data.id_key`); a run over
several files on its file and id, the string "<file name>:<id>" (`qualified_id`), where the file name is the
file's path below the files' deepest common folder (`id_prefixes`: "gsm8k/train.parquet:17" for verl's
~/data/gsm8k/train.parquet beside ~/data/math/train.parquet, which both index from 0). The name depends only
on the list of files, not on the order Ray Data reads them, and survives moving the data folder; the Ray Data
tasks find each row's file from the "path" column that `include_paths=True` adds. An id repeated within one
file is refused before any work. A row without an id (no id column, a null, or -1) gets -1 ("" over several
files): the position cannot record it, so a resumed run trains it again in its epoch (warned).
`check_position` refuses, on the driver, a checkpoint whose position is keyed the other way (one file against
several, or other files), which would mark the wrong rows consumed.

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
import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import fsspec
import numpy as np

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

    Raises on a missing file, a file listed twice, a missing prompt / answer column, an empty file, a malformed
    jsonl line (its 1-based number) and fewer than `min_rows` rows over all the files. Training files only (the
    data position of a checkpoint is a set of ids): raises on an id (`data.id_key`) repeated within one file,
    and warns about rows without an id. `images`: the policy reads images, so every file needs the image
    column; without, no file may have it (a non-empty data.image_key).
    """
    files = expand_files(data, key)
    if len({_format(f) for f in files}) > 1:
        raise DataError(f"{key} mixes formats ({files}); use one of parquet or jsonl per run")
    names = id_prefixes(files)
    rows, missing = 0, []
    for url in files:
        ids = _FileIds(url, data.id_key, names.get(url)) if key == "data.train_files" else None
        rows += _check_file(url, data, ids, images)
        if ids is not None:
            ids.refuse_repeats()
            if ids.missing:
                missing.append((url, ids.missing))
    if rows < min_rows:
        raise DataError(
            f"{key} holds {rows} rows over {len(files)} file(s), fewer than the {min_rows} needed (one step's "
            "prompts, train.prompts_per_step); add data or lower train.prompts_per_step"
        )
    if missing:
        log.warning(
            "%s: %d row(s) in %d file(s) (%s) have no id in the column %r (data.id_key: the column is absent, or "
            "the value null or -1): the data position (which prompts an epoch consumed) cannot record them, so a "
            "resumed run trains them again in their epoch; give every row a unique id in a column named by "
            "data.id_key",
            key,
            sum(n for _, n in missing),
            len(missing),
            ", ".join(f"{url} ({n})" for url, n in missing[:3]) + (", ..." if len(missing) > 3 else ""),
            data.id_key,
        )
    log.info("%s: %d rows in %d file(s)", key, rows, len(files))
    return files


def expand_files(data: DataConfig, key: str = "data.train_files") -> list[str]:
    """The files that `key`'s patterns (globs, any fsspec URL) name, in pattern order, each pattern's matches
    sorted; DataError on an empty list, a pattern matching nothing, or a file named twice."""
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
            if url in files:
                raise DataError(
                    f"{key} names the data file {url!r} twice (patterns {patterns}); its prompts would be read "
                    "twice an epoch: list each file once"
                )
            files.append(url)
    return files


# ---- prompt ids ----------------------------------------------------------------------------------------
NO_ID = -1  # the id of a row without one (a run over several files: "")
_QUALIFIED = re.compile(r".+\.(parquet|jsonl|json):")  # what `qualified_id` gives starts like this


def id_prefixes(files: list[str]) -> dict[str, str]:
    """{file URL: the name its ids are qualified with} for a run over several files; {} for one file.

    The name is the file's path below the deepest folder common to all the files (protocol left out):
    ["/d/gsm8k/train.parquet", "/d/math/train.parquet"] -> "gsm8k/train.parquet", "math/train.parquet";
    the parts of one folder -> their file names. It depends on the list alone (not on read order), and stays
    the same when the whole data folder moves (another absolute prefix, local or bucket)."""
    if len(files) < 2:
        return {}
    bare = [_bare(f) for f in files]
    common = posixpath.commonpath([posixpath.dirname(b) for b in bare])
    return {f: b[len(common) :].lstrip("/") for f, b in zip(files, bare)}


def qualified_id(name: str, value: Any) -> str:
    """The key of a row with id `value` in the file named `name` (`id_prefixes`): "gsm8k/train.parquet:17".
    A whole float is written as an int: Ray Data hands an int column (or struct field) holding a null as floats,
    block by block, and a row's key must not depend on which block it was read in."""
    value = _plain(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{name}:{value}"


def has_id(value: Any) -> bool:
    """False for a row without an id: -1 (what `build_dataset` gives it), "" (over several files), null, NaN."""
    value = _plain(value)
    if value is None or value is _MISSING or (isinstance(value, str) and value == ""):
        return False
    if isinstance(value, float) and value != value:  # NaN: a null of a float column written by pandas
        return False
    return not (isinstance(value, int | float) and not isinstance(value, bool) and value == NO_ID)


def check_position(position: Mapping[int, list], data: DataConfig, where: str) -> None:
    """DataError unless a checkpoint's data position (`where`: which checkpoint) is keyed as this run keys its
    prompts (`data.train_files`): plain ids for one file, "<file name>:<id>" for several. Resuming from one keyed
    the other way would mark the wrong rows consumed. Warns when some (not all) ids name files this run does not
    read (a file left out): those are ignored. Nothing to check without files or consumed ids."""
    ids = [i for consumed in position.values() for i in consumed]
    if not ids or not data.train_files:
        return
    files = expand_files(data)
    names = sorted(id_prefixes(files).values())
    examples = ", ".join(repr(i) for i in ids[:3])
    fix = (
        "Resume with the data.train_files that run used, or start a new run (a new checkpoint.dir) from its "
        "weights (model.path=<an HF export of it: checkpoint.export_hf_steps>)"
    )
    if not names:
        if all(isinstance(i, str) and _QUALIFIED.match(i) for i in ids):
            raise DataError(
                f"{where}: its data position keys prompts by file and id ({examples}), as a run over several "
                f"files does, but this run reads one file ({files[0]!r}), whose prompts are keyed by id alone: "
                f"resuming would mark the wrong rows consumed. {fix}"
            )
        return
    known = [i for i in ids if isinstance(i, str) and any(i.startswith(n + ":") for n in names)]
    if not known:
        raise DataError(
            f"{where}: its data position keys prompts as {examples}, but this run reads {len(files)} files "
            f"(data.train_files), whose prompts are keyed by file and id ('{names[0]}:<id>', ...). The checkpoint "
            "was written by a run over other files, or over several files by an earlier version that keyed "
            f"prompts by id alone (which cannot tell the files' rows apart): resuming would mark the wrong rows "
            f"consumed. {fix}"
        )
    if len(known) < len(ids):
        matched = set(known)
        log.warning(
            "%s: %d of the %d prompt ids of its data position name files this run does not read (e.g. %r); they "
            "are ignored (this run reads %s)",
            where,
            len(ids) - len(known),
            len(ids),
            next(i for i in ids if i not in matched),
            ", ".join(names),
        )


def _bare(url: str) -> str:
    """A file URL without its protocol and leading slashes: "s3://b/k" -> "b/k", "/d/f" -> "d/f"."""
    return url.split("://", 1)[-1].lstrip("/")


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value (how ids are compared, printed and stored)."""
    return value.item() if isinstance(value, np.generic) else value


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


class _FileIds:
    """The ids of one training file, as the data position keys them (`qualified_id` with `name`, over several
    files): how many rows repeat an id of an earlier row, a few of those ids, and the rows without an id."""

    def __init__(self, url: str, id_key: str, name: str | None) -> None:
        self.url, self.id_key, self.name = url, id_key, name
        self.seen: set = set()
        self.repeats = 0
        self.examples: list = []
        self.missing = 0  # rows without an id (no column, null, -1)

    def add(self, value: Any) -> None:
        if not has_id(value):
            self.missing += 1
            return
        key = qualified_id(self.name, value) if self.name is not None else value
        try:
            hash(key)
        except TypeError:
            key = repr(key)
        if key in self.seen:
            self.repeats += 1
            if len(self.examples) < 5:
                self.examples.append(value)
        else:
            self.seen.add(key)

    def refuse_repeats(self) -> None:
        if self.repeats:
            raise DataError(
                f"data file {self.url!r} repeats ids of the column {self.id_key!r} (data.id_key): {self.repeats} "
                f"row(s) share an id with an earlier row of that file (e.g. {', '.join(map(repr, self.examples))}). "
                "A checkpoint records which prompts an epoch consumed by (file, id), so a resumed run would skip "
                "or repeat the rows sharing an id. Give each row of the file a unique id in data.id_key (e.g. its "
                "row number), or set data.id_key to a column that is unique within each file"
            )


def _check_file(url: str, data: DataConfig, ids: _FileIds | None, images: bool = False) -> int:
    """The number of rows in `url`, after checking its columns and (jsonl) every line; its ids go to `ids`."""
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
            "Point model.path at a vision-language model (LLaVA, Qwen2-VL, Qwen2.5-VL), or set data.image_key='' to train on the text alone."
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


def _check_parquet(
    fs, path: str, url: str, data: DataConfig, ids: _FileIds | None, images: bool = False
) -> int:
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
        if ids is not None and metadata.num_rows and id_path is not None:
            f.seek(0)
            column = pq.read_table(f, columns=[id_path[0]]).column(0)
            if len(id_path) > 1:  # a field of a struct column (a null struct gives a null id)
                column = pc.struct_field(column.combine_chunks(), id_path[1:])
            for value in column.to_pylist():
                ids.add(value)
        elif ids is not None:
            ids.missing += int(metadata.num_rows)
    return int(metadata.num_rows)


def _check_jsonl(
    fs, path: str, url: str, data: DataConfig, ids: _FileIds | None, images: bool = False
) -> int:
    rows = 0
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
            if ids is not None:
                ids.add(lookup(obj, data.id_key))
            rows += 1
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

    A file without the id or data-source column gets -1 ids and source "default". Over several files each id is
    "<file name>:<id>" ("" for a row without one; see the module docstring), each row's file read from the
    "path" column that the read adds. `pixels` (a vision policy's image processor, e.g.
    `yatt_ray.data.images.ClipPixels(model_dir)`): the image column is read too and, in Ray Data tasks after the
    shuffle, decoded and processed into the columns `images.PIXELS` (float32 [I, 3, H, W] a row; Qwen VL:
    [patches, D] with `images.GRID`), `images.SIZES` and `images.ERROR` (see `images.decode_images_batch`; bad rows are kept, flagged, under
    data.on_bad_image=skip).
    """
    import ray.data

    from yatt_ray.data.images import decode_images_batch

    reader = ray.data.read_parquet if _format(files[0]) == "parquet" else ray.data.read_json
    canonical = canonical_columns(data, images=pixels is not None, files=files)
    with footer_readers(len(files)):
        ds = reader(files, include_paths=len(files) > 1).map_batches(canonical, batch_format="numpy")
    if data.shuffle_seed is not None:
        ds = ds.random_shuffle(seed=data.shuffle_seed)
    if pixels is not None:
        options = {
            "image_column": "images",
            "processor_fn": pixels,
            "on_bad_image": data.on_bad_image,
            "max_images": data.max_images,
        }
        ds = ds.map_batches(decode_images_batch, batch_format="numpy", fn_kwargs=options)
    return ds


FOOTER_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FILES_PER_FOOTER_READER = 10  # Ray Data's footer batch: files one FooterReader reads per call


@contextmanager
def footer_readers(num_files: int) -> Iterator[None]:
    """While a parquet read is planned (Ray Data builds its file indexer then, on this process): one footer
    reader actor per `FILES_PER_FOOTER_READER` files, at most Ray's default of 32, unless the user set
    RAY_DATA_PARQUET_FOOTER_NUM_ACTORS. Ray's default starts 32 actors (each a fresh Python process) for any
    number of files; for the demo's one file that was 5-8 processes competing with the engines' start-up on
    a 2-core box (command -> step 1: 45 s -> 34 s with one reader, `release/bench_startup.py`)."""
    if FOOTER_ENV in os.environ:
        yield
        return
    os.environ[FOOTER_ENV] = str(min(32, max(1, -(-num_files // FILES_PER_FOOTER_READER))))
    try:
        yield
    finally:
        os.environ.pop(FOOTER_ENV, None)


def canonical_columns(data: DataConfig, images: bool = False, files: list[str] | None = None):
    """The batch function (column -> values, for `Dataset.map_batches`) that maps the configured columns (dotted
    keys into struct columns included) to PROMPT_COLUMNS, and with `images` the image column to "images".

    With several `files` (the list given to the read), the batch must carry the read's "path" column (Ray Data's
    `include_paths=True`: the path without its protocol); each id becomes `qualified_id` of its file's name."""
    keys = {
        "id": data.id_key,
        "prompt": data.prompt_key,
        "ground_truth": data.answer_key,
        "data_source": data.source_key,
        **({"images": data.image_key} if images else {}),
    }
    defaults = {"id": NO_ID, "data_source": "default"}
    names = {_bare(url): name for url, name in id_prefixes(list(files or [])).items()}

    def to_canonical(batch: dict) -> dict:
        n = len(next(iter(batch.values()))) if batch else 0
        out = {name: _batch_column(batch, col, defaults.get(name), n) for name, col in keys.items()}
        out["ground_truth"] = [str(v) for v in out["ground_truth"]]
        if names:
            if "path" not in batch:
                raise DataError(
                    f"a batch read from {len(names)} data files carries no 'path' column, so its rows' files are "
                    "unknown; read them with include_paths=True (as build_dataset does)"
                )
            files_of = [_file_name(str(p), names) for p in batch["path"]]
            out["id"] = np.asarray(
                [qualified_id(f, v) if has_id(v) else "" for f, v in zip(files_of, out["id"])], dtype=object
            )
        return out

    return to_canonical


def _file_name(path: str, names: dict[str, str]) -> str:
    """The name (`id_prefixes`) of the file that Ray Data reports as `path`: the one whose URL is `path` up to
    its protocol, else the one file whose URL ends with it or that it ends with (at a "/")."""
    bare = _bare(path)
    if bare in names:
        return names[bare]
    near = [name for url, name in names.items() if url.endswith("/" + bare) or bare.endswith("/" + url)]
    if len(near) != 1:
        raise DataError(
            f"Ray Data read a row from {path!r}, which matches {'none' if not near else 'several'} of the data "
            f"files {sorted(names)}; list the files by the paths the read reports (absolute paths or full URLs)"
        )
    return near[0]
