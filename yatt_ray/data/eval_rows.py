"""The eval set, read by each group's controller in its own process: no Ray Data pipeline.

An eval set is small (the demo's 128 rows; hundreds to a few thousand as users give them) and read twice a run
(before the first step and after the last). A second Ray Data stream for it (a split coordinator actor, list and
read tasks in fresh worker processes, competing with the training stream for the CPUs) took ~25 s to start on
2 cores, far more than reading the rows. So each controller reads the eval files itself, through fsspec (any
URL), and keeps its share: over the files in list order, row i (0-based, counted across the files) belongs to
data-parallel rank i % dp_size, so the groups evaluate every row exactly once (no row dropped to even the
shares) and the same rows on every run.

`EvalRows.batches()` yields numpy batches of at most `batch_size` rows with the columns `build_dataset` gives:
`canonical_columns` of the configured keys (dotted keys into struct columns, ids keyed by file over several
files, verl's layout), each arrow column turned into numpy as Ray Data turns it (`_numpy`). For a vision policy
(`pixels`: its image processor, `images.pixels_processor`) each batch's images are decoded and processed just before
it is handed out (`images.decode_images_batch`, data.on_bad_image as in the Ray Data tasks): one batch's images
at a time, never the whole set's. Parquet files are read a chunk of row groups at a time; a jsonl file is
parsed whole (pyarrow's JSON reader, as Ray Data's `read_json` does), its rows converted chunk by chunk.

The driver only passes the file list, checked by `check_sources`; it never reads a row.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import fsspec
import numpy as np

from yatt_ray.config import DataConfig
from yatt_ray.data.images import ProcessorFn, decode_images_batch
from yatt_ray.data.sources import _format, canonical_columns
from yatt_ray.errors import DataError

Batch = dict[str, np.ndarray]
BATCH_SIZE = 256  # rows a batch: the engine generates a batch at once


class EvalRows:
    """Data-parallel rank `dp_rank`'s share of the eval `files` (of `dp_size` ranks), as numpy batches.

    Re-iterable: each `batches()` call reads the files again (nothing is cached between the two evaluations).
    `pixels`: the vision policy's image processor (None for a text policy, whose files hold no image column).
    """

    def __init__(
        self,
        data: DataConfig,
        files: list[str],
        dp_rank: int,
        dp_size: int,
        pixels: ProcessorFn | None = None,
        batch_size: int = BATCH_SIZE,
    ) -> None:
        if not files:
            raise ValueError(
                "EvalRows needs the eval files (check_sources(data, key='data.eval_files')), got []"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) with dp_size >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.data, self.files = data, list(files)
        self.dp_rank, self.dp_size, self.batch_size = dp_rank, dp_size, batch_size
        self.pixels = pixels
        images = pixels is not None
        self.canonical = canonical_columns(data, images=images, files=self.files)
        keys = [data.id_key, data.prompt_key, data.answer_key, data.source_key]
        keys += [data.image_key] if images else []
        self.columns = {prefix for key in keys for prefix in _prefixes(key)}  # what `canonical` may read

    def __repr__(self) -> str:
        return f"EvalRows({len(self.files)} file(s), rank {self.dp_rank} of {self.dp_size})"

    def batches(self) -> Iterator[Batch]:
        """This rank's rows in file order, `batch_size` a batch (the last one shorter); none when the files
        hold fewer rows than dp_rank + 1. A vision batch carries `images.PIXELS`, `SIZES` and `ERROR` (a row
        whose images do not load is kept, its ERROR set, under data.on_bad_image=skip)."""
        pending: list[Batch] = []
        held = 0
        for part in self._shares():
            pending.append(part)
            held += _length(part)
            while held >= self.batch_size:
                batch, rest = _split(_concat(pending), self.batch_size)
                pending, held = [rest], held - self.batch_size
                yield self._finish(batch)
        if held:
            yield self._finish(_concat(pending))

    def _finish(self, batch: Batch) -> Batch:
        if self.pixels is None:
            return batch
        return decode_images_batch(
            batch,
            image_column="images",
            processor_fn=self.pixels,
            on_bad_image=self.data.on_bad_image,
            max_images=self.data.max_images,
        )

    def _shares(self) -> Iterator[Batch]:
        """Canonical columns of this rank's rows, a chunk of a file at a time, in file order."""
        offset = 0  # rows of the files (and chunks) before this chunk
        chunk = self.batch_size * self.dp_size  # about one batch of this rank's rows
        for url in self.files:
            for table in _read_chunks(url, chunk):
                n = table.num_rows
                mine = np.arange((self.dp_rank - offset) % self.dp_size, n, self.dp_size)
                offset += n
                if len(mine):
                    yield self._canonical(table.take(mine), url)

    def _canonical(self, table: Any, url: str) -> Batch:
        batch = {
            name: _numpy(table.column(i)) for i, name in enumerate(table.schema.names) if name in self.columns
        }
        if len(self.files) > 1:  # what Ray Data's include_paths=True adds: the row's file
            batch["path"] = np.full(table.num_rows, url, dtype=object)
        return {name: _array(values) for name, values in self.canonical(batch).items()}


# ---- reading ---------------------------------------------------------------------------------------------
def _read_chunks(url: str, chunk: int) -> Iterator[Any]:
    """The rows of one file as pyarrow record batches of at most `chunk` rows, in file order."""
    import pyarrow as pa

    if _format(url) == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(url, "rb") as f:
            yield from pq.ParquetFile(f).iter_batches(batch_size=chunk)
        return
    import pyarrow.json as pajson

    with fsspec.open(url, "rb") as f:
        raw = f.read()
    # one block for the whole file: types are inferred from every line, and no object straddles two blocks
    options = pajson.ReadOptions(use_threads=False, block_size=max(len(raw), 1 << 20))
    try:
        table = pajson.read_json(io.BytesIO(raw), read_options=options)
    except pa.ArrowInvalid as exc:
        raise DataError(
            f"eval file {url!r} cannot be read as JSON lines ({exc}); a key must hold one type on every line "
            "(e.g. all strings or all numbers): fix the lines that differ"
        ) from exc
    yield from table.to_batches(max_chunksize=chunk)


def _numpy(column: Any) -> np.ndarray:
    """A pyarrow array as Ray Data's numpy batches hold it: `to_numpy(zero_copy_only=False)` (a struct -> an
    object array of dicts, a list -> an object array of arrays, a null -> None), and a column of nulls only
    (pyarrow's null type) -> float32 NaN."""
    import pyarrow as pa

    if pa.types.is_null(column.type):
        return np.full(len(column), np.nan, dtype=np.float32)
    return column.to_numpy(zero_copy_only=False)


def _prefixes(key: str) -> list[str]:
    """The column names a dotted key may be read from: "a.b.c" -> ["a.b.c", "a.b", "a"] (`_batch_column`)."""
    parts = key.split(".")
    return [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]


# ---- batches ---------------------------------------------------------------------------------------------
def _array(values: Any) -> np.ndarray:
    """A canonical column as a 1-d numpy array, strings as objects (as Ray Data hands back a map's output)."""
    if isinstance(values, np.ndarray):
        return values.astype(object) if values.dtype.kind == "U" else values
    values = list(values)
    if all(isinstance(v, int | float | bool | np.number) for v in values):
        return np.asarray(values)
    out = np.empty(len(values), dtype=object)  # filled one by one: numpy would stack equal-length lists
    for i, v in enumerate(values):
        out[i] = v
    return out


def _length(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def _split(batch: Batch, k: int) -> tuple[Batch, Batch]:
    return {n: v[:k] for n, v in batch.items()}, {n: v[k:] for n, v in batch.items()}


def _concat(parts: list[Batch]) -> Batch:
    """The rows of `parts` in order; a column whose dtype differs between parts becomes an object array."""
    parts = [p for p in parts if _length(p)] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    out: Batch = {}
    for name in parts[0]:
        arrays = [p[name] for p in parts]
        if len({a.dtype for a in arrays}) > 1:
            arrays = [a.astype(object) for a in arrays]
        out[name] = np.concatenate(arrays)
    return out
