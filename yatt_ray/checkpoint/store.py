"""Checkpoint storage on any fsspec filesystem: step directories, a manifest as the commit marker, retention.

Layout under the root URL (a local path, ``memory://...``, ``s3://bucket/prefix``, ...)::

    <root>/step_00000120/            one committed checkpoint
        model.pt                     any number of named files
        optimizer.pt
        manifest.json                written LAST: the commit marker
    <root>/step_00000130.partial/    a write in progress (local filesystems only)

The rule every reader follows: **a checkpoint exists only once ``step_XXXXXXXX/manifest.json`` exists**. The
manifest lists every file with its byte size and sha256, so a reader can also tell a complete checkpoint from
one whose files were damaged afterwards (`CheckpointStore.latest_valid` verifies them).

How the commit happens depends on the filesystem:

* Local filesystems (and any fsspec filesystem reporting itself local): files are written into
  ``step_XXXXXXXX.partial/``; once all are closed the directory is renamed to ``step_XXXXXXXX/`` (atomic on
  POSIX) and then the manifest is written (to a temporary name, then renamed, so it is never seen half written).
* Object stores (S3, GCS, Azure, ``memory://``): there is no rename (a "rename" is a copy of every byte), so
  files are written straight into ``step_XXXXXXXX/`` and the manifest, uploaded with one PUT (atomic: a reader
  sees all of it or nothing), is the only commit marker. A step directory without a manifest is an
  unfinished write, exactly like a ``.partial`` directory on a local disk.

Deletion runs in the opposite order: the manifest goes first, so a half-deleted checkpoint is never taken for a
committed one.

Nothing here knows about tensors: files are bytes. `yatt_ray.checkpoint.writer` puts torch state on top.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from yatt_ray.errors import YattError

logger = logging.getLogger("yatt_ray.checkpoint")

FORMAT_NAME = "yatt_ray.checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
PARTIAL_SUFFIX = ".partial"
_STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
_PARTIAL_DIR_RE = re.compile(r"^step_(\d{8,})\.partial$")
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_HASH_CHUNK = 8 * 1024 * 1024


class CheckpointError(YattError):
    """A checkpoint cannot be written, found or read; the message names the step, the file and the fix."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint was written in a newer format than this yatt_ray reads: upgrade, do not fall back."""


def step_dir_name(step: int) -> str:
    """``step_00000120`` for step 120 (8 digits, zero padded, so names sort like numbers up to 10^8)."""
    return f"step_{step:08d}"


def validate_file_name(name: str) -> str:
    """Return `name` if it can be a file in a checkpoint directory, else raise `CheckpointError`."""
    if not isinstance(name, str) or not _FILE_NAME_RE.match(name) or name == MANIFEST_NAME:
        raise CheckpointError(
            f"invalid checkpoint file name {name!r}: use letters, digits, '_', '-' and '.', no '/', not "
            f"starting with '.', and not {MANIFEST_NAME!r} (reserved for the commit marker)"
        )
    return name


def _validate_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
    return step


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as recorded in its manifest."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json``: what was committed, when, and how to check it."""

    step: int
    created_unix: float
    files: tuple[FileEntry, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": self.format_version,
                "step": self.step,
                "created_unix": self.created_unix,
                "created_utc": datetime.fromtimestamp(self.created_unix, UTC).isoformat(),
                "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
                "metadata": self.metadata,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Manifest:
        """Parse a manifest; raise `CheckpointError` naming `where` if it is not one this version can read."""
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT_NAME:
                raise ValueError(f"format is {raw.get('format')!r}, expected {FORMAT_NAME!r}")
            version = int(raw["format_version"])
            files = tuple(FileEntry(str(f["name"]), int(f["size"]), str(f["sha256"])) for f in raw["files"])
            manifest = cls(
                step=int(raw["step"]),
                created_unix=float(raw["created_unix"]),
                files=files,
                metadata=dict(raw.get("metadata") or {}),
                format_version=version,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"unreadable checkpoint manifest {where}: {exc}") from exc
        if version > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"checkpoint manifest {where} has format_version {version}, but this yatt_ray reads up to "
                f"{FORMAT_VERSION}: upgrade yatt_ray to resume from it"
            )
        return manifest

    def file(self, name: str) -> FileEntry:
        for entry in self.files:
            if entry.name == name:
                return entry
        raise CheckpointError(
            f"checkpoint step {self.step} has no file {name!r}; its files are {[f.name for f in self.files]}"
        )


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint: its step, its directory (a path on the store's filesystem) and its manifest."""

    step: int
    path: str
    manifest: Manifest

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata


class _HashingWriter:
    """A write-only file wrapper that counts bytes and computes sha256 as they pass through."""

    def __init__(self, raw: IO[bytes]):
        self._raw = raw
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._raw.write(view)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class PendingCheckpoint:
    """A checkpoint being written: add files with `write` / `open`, then `CheckpointStore.commit` it.

    Until it is committed it is invisible to every reader. If the writer dies, what it wrote is left without
    a manifest and is removed later by `CheckpointStore.apply_retention` (or by the next `begin` of the same
    step).
    """

    def __init__(self, store: CheckpointStore, step: int, path: str):
        self.store = store
        self.step = step
        self.path = path
        self.files: dict[str, FileEntry] = {}
        self._open_names: set[str] = set()

    def write(self, name: str, data: bytes | bytearray | memoryview) -> FileEntry:
        """Write one whole file from bytes."""
        with self.open(name) as f:
            f.write(data)
        return self.files[name]

    @contextmanager
    def open(self, name: str) -> Iterator[_HashingWriter]:
        """Open `name` for writing; its size and sha256 are recorded when the block exits without error."""
        validate_file_name(name)
        if name in self.files or name in self._open_names:
            raise CheckpointError(f"file {name!r} is written twice in checkpoint step {self.step}")
        self._open_names.add(name)
        try:
            with self.store.fs.open(f"{self.path}/{name}", "wb") as raw:
                writer = _HashingWriter(raw)
                yield writer
            self.files[name] = FileEntry(name, writer.size, writer.hexdigest())
        finally:
            self._open_names.discard(name)

    def abort(self) -> None:
        """Best effort: remove what was written. Errors are logged, not raised (the write already failed)."""
        self.store._forget_in_progress(self.step)
        try:
            if self.store.fs.exists(self.path):
                self.store.fs.rm(self.path, recursive=True)
        except Exception as exc:  # a storage failure is the likely reason we are aborting
            logger.warning(
                "could not remove unfinished checkpoint %s (%s); retention removes it later", self.path, exc
            )


class CheckpointStore:
    """Committed checkpoints under one fsspec root URL; see the module docstring for the layout.

    Args:
        root_url: a local path or any fsspec URL (``memory://ckpt``, ``s3://bucket/run1/ckpt``).
        keep_last: how many of the newest committed checkpoints `apply_retention` keeps (>= 1).
        keep_every: also keep every checkpoint whose step is a multiple of this (None: no such rule).
        storage_options: passed to fsspec (``{"endpoint_url": ..., "key": ..., "secret": ...}`` for S3).

    One process writes a store at a time (the trainer's rank 0, or each rank into its own root); any number
    may read it.
    """

    def __init__(
        self,
        root_url: str,
        keep_last: int = 3,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointError(
                f"keep_last={keep_last!r} is invalid: keep at least the newest checkpoint (keep_last >= 1)"
            )
        if keep_every is not None and (
            isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1
        ):
            raise CheckpointError(
                f"keep_every={keep_every!r} is invalid: use a positive number of steps, or None to keep only "
                f"the last {keep_last}"
            )
        if not isinstance(root_url, str) or not root_url:
            raise CheckpointError(f"root_url={root_url!r} is invalid: give a local path or an fsspec URL")
        self.root_url = root_url
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.fs, root = fsspec.core.url_to_fs(root_url, **(storage_options or {}))
        self.root = root.rstrip("/") or root
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self._in_progress: set[int] = set()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.root_url!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"

    # ---------------------------------------------------------------- paths and listing

    def step_path(self, step: int) -> str:
        return f"{self.root}/{step_dir_name(step)}"

    def partial_path(self, step: int) -> str:
        """Where a write in progress lives: ``.partial`` on local disks, the final directory elsewhere."""
        return self.step_path(step) + PARTIAL_SUFFIX if self.is_local else self.step_path(step)

    def _refresh(self) -> None:
        # s3fs and friends cache directory listings (s3fs drops only a path and its parents when given one),
        # and a checkpoint written by another process must be seen: drop this filesystem's whole cache.
        self.fs.invalidate_cache()

    def _scan(self) -> tuple[list[int], list[int]]:
        """(committed steps, steps with an unfinished directory), both ascending."""
        self._refresh()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return [], []
        dirs: set[int] = set()
        partials: set[int] = set()
        for entry in entries:
            base = str(entry).rstrip("/").rsplit("/", 1)[-1]
            if m := _STEP_DIR_RE.match(base):
                dirs.add(int(m.group(1)))
            elif m := _PARTIAL_DIR_RE.match(base):
                partials.add(int(m.group(1)))
        committed = []
        for step in sorted(dirs):
            if self.fs.exists(f"{self.step_path(step)}/{MANIFEST_NAME}"):
                committed.append(step)
            else:
                partials.add(step)
        return committed, sorted(partials)

    def list_committed(self) -> list[int]:
        """Steps whose manifest exists, ascending. Files are not verified here (see `latest_valid`)."""
        return self._scan()[0]

    def exists(self, step: int) -> bool:
        """True if step `step` is committed (its manifest exists)."""
        self._refresh()
        return bool(self.fs.exists(f"{self.step_path(step)}/{MANIFEST_NAME}"))

    # ---------------------------------------------------------------- reading

    def ref(self, step: int) -> CheckpointRef:
        """The committed checkpoint of `step` (manifest read, files not verified)."""
        path = self.step_path(step)
        where = f"{self.root_url} step {step} ({path}/{MANIFEST_NAME})"
        try:
            text = self.fs.cat_file(f"{path}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"no committed checkpoint at {where}; committed steps are {self.list_committed()}"
            ) from exc
        manifest = Manifest.from_json(text, where)
        if manifest.step != step:
            raise CheckpointError(
                f"manifest {where} says step {manifest.step}: the directory was renamed or copied"
            )
        return CheckpointRef(step, path, manifest)

    def verify(self, ref: CheckpointRef) -> str | None:
        """Check every file's size and sha256 against the manifest; None if all match, else what is wrong."""
        for entry in ref.manifest.files:
            path = f"{ref.path}/{entry.name}"
            try:
                size = self.fs.size(path)
            except FileNotFoundError:
                return f"file {entry.name!r} is missing"
            if size != entry.size:
                return f"file {entry.name!r} has {size} bytes, the manifest says {entry.size}"
            digest = hashlib.sha256()
            with self.fs.open(path, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    digest.update(chunk)
            if digest.hexdigest() != entry.sha256:
                return f"file {entry.name!r} fails its sha256 check (corrupted after it was written)"
        return None

    def latest_valid(self) -> CheckpointRef | None:
        """The newest committed checkpoint whose files all match their manifest, or None if there is none.

        Checks newest first; a checkpoint that is unreadable, incomplete or corrupted is skipped with a
        warning naming its step and the bad file. Reads every byte of the checkpoints it checks.
        """
        for step in reversed(self.list_committed()):
            try:
                ref = self.ref(step)
            except CheckpointFormatError:
                raise  # a newer format is not damage: falling back would silently lose progress
            except CheckpointError as exc:
                logger.warning("skipping checkpoint step %d in %s: %s", step, self.root_url, exc)
                continue
            problem = self.verify(ref)
            if problem is None:
                return ref
            logger.warning(
                "skipping checkpoint step %d in %s: %s; falling back to an older checkpoint",
                step,
                self.root_url,
                problem,
            )
        return None

    def read(self, ref: CheckpointRef, name: str) -> bytes:
        """The whole content of file `name` of checkpoint `ref` (size checked against the manifest)."""
        entry = ref.manifest.file(name)
        data = self.fs.cat_file(f"{ref.path}/{name}")
        if len(data) != entry.size:
            raise CheckpointError(
                f"checkpoint step {ref.step} file {name!r} has {len(data)} bytes, the manifest says "
                f"{entry.size}: it was truncated or replaced; resume from `latest_valid()` instead"
            )
        return bytes(data)

    def open(self, ref: CheckpointRef, name: str) -> IO[bytes]:
        """A binary file object reading `name` of checkpoint `ref` (close it, or use it in a `with`)."""
        ref.manifest.file(name)
        return self.fs.open(f"{ref.path}/{name}", "rb")

    # ---------------------------------------------------------------- writing

    def begin(self, step: int) -> PendingCheckpoint:
        """Start writing checkpoint `step`. Leftovers of an earlier unfinished write of it are removed."""
        _validate_step(step)
        if self.exists(step):
            raise CheckpointError(
                f"checkpoint step {step} is already committed in {self.root_url}: delete it first "
                f"(`store.delete({step})`) if it is to be replaced, or save under a new step"
            )
        path = self.partial_path(step)
        for leftover in {path, self.step_path(step)}:
            if self.fs.exists(leftover):
                logger.info("removing unfinished checkpoint directory %s before rewriting it", leftover)
                self.fs.rm(leftover, recursive=True)
        self.fs.makedirs(path, exist_ok=True)
        self._in_progress.add(step)
        return PendingCheckpoint(self, step, path)

    def commit(self, pending: PendingCheckpoint, metadata: dict[str, Any] | None = None) -> CheckpointRef:
        """Make `pending` visible: (local: rename ``.partial`` to final, then) write the manifest last."""
        if pending.store is not self:
            raise CheckpointError("commit() got a PendingCheckpoint begun on another CheckpointStore")
        if pending._open_names:
            raise CheckpointError(
                f"cannot commit checkpoint step {pending.step}: files {sorted(pending._open_names)} are still open"
            )
        meta = dict(metadata or {})
        check_json_metadata(meta)
        step = pending.step
        final = self.step_path(step)
        manifest = Manifest(
            step=step,
            created_unix=time.time(),
            files=tuple(pending.files.values()),  # in write order: `load` returns entries in save order
            metadata=meta,
        )
        if pending.path != final:
            self.fs.mv(pending.path, final, recursive=True)
            pending.path = final
        text = manifest.to_json().encode()
        target = f"{final}/{MANIFEST_NAME}"
        if self.is_local:
            tmp = f"{final}/.{MANIFEST_NAME}.{uuid.uuid4().hex}.tmp"
            self.fs.pipe_file(tmp, text)
            self.fs.mv(tmp, target)
        else:
            self.fs.pipe_file(target, text)
        self._forget_in_progress(step)
        self._refresh()
        logger.info("committed checkpoint step %d (%d files) at %s", step, len(manifest.files), final)
        return CheckpointRef(step, final, manifest)

    def _forget_in_progress(self, step: int) -> None:
        self._in_progress.discard(step)

    # ---------------------------------------------------------------- deleting and retention

    def delete(self, step: int) -> None:
        """Remove checkpoint `step` (committed or not): the manifest first, then its files."""
        _validate_step(step)
        self._refresh()
        final = self.step_path(step)
        manifest = f"{final}/{MANIFEST_NAME}"
        if self.fs.exists(manifest):
            self.fs.rm(manifest)
        for path in (final, final + PARTIAL_SUFFIX):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
        self._refresh()

    def retained_steps(self, committed: list[int], newest_valid: int | None) -> set[int]:
        """Which of `committed` the retention policy keeps (pure; see `apply_retention`)."""
        keep = set(sorted(committed)[-self.keep_last :])
        if self.keep_every is not None:
            keep |= {s for s in committed if s % self.keep_every == 0}
        if newest_valid is not None:
            keep.add(newest_valid)
        return keep

    def apply_retention(self, known_valid: int | None = None) -> list[int]:
        """Delete what the policy does not keep; return the deleted steps (unfinished ones included).

        Keeps the newest `keep_last` committed checkpoints, every step divisible by `keep_every`, and always
        the newest *valid* one. `known_valid` is a step the caller knows is intact (the writer passes the
        step it has just committed); when it is the newest committed step no file is re-read, otherwise
        `latest_valid` checks the checkpoints newest first.

        Unfinished directories (no manifest) are removed only when they are older than the newest committed
        checkpoint and are not being written by this store: a write in progress is never touched.
        """
        committed, unfinished = self._scan()
        if not committed:
            return []
        newest_valid: int | None
        if known_valid is not None and known_valid == committed[-1]:
            newest_valid = known_valid
        else:
            ref = self.latest_valid()
            newest_valid = ref.step if ref is not None else None
        keep = self.retained_steps(committed, newest_valid)
        doomed = [s for s in committed if s not in keep]
        stale = [s for s in unfinished if s < committed[-1] and s not in self._in_progress]
        for step in doomed + stale:
            self.delete(step)
        if doomed or stale:
            logger.info(
                "checkpoint retention in %s: deleted steps %s (unfinished: %s); kept %s",
                self.root_url,
                doomed,
                stale,
                sorted(keep),
            )
        return sorted(doomed + stale)


def check_json_metadata(metadata: dict[str, Any]) -> None:
    """Raise `CheckpointError` naming the offending key if `metadata` cannot be stored as JSON."""
    if not isinstance(metadata, dict):
        raise CheckpointError(f"checkpoint metadata must be a dict, got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise CheckpointError(f"checkpoint metadata key {key!r} must be a string")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint metadata[{key!r}] = {value!r} is not JSON-serialisable ({exc}): store plain "
                "numbers, strings, lists and dicts there, and anything else as a payload entry"
            ) from exc
