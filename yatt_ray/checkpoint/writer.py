"""Save training state as a checkpoint without stopping training for the write.

`AsyncCheckpointWriter.save` does only the part that must happen while the caller waits: it *snapshots* the
payload. Every tensor (also nested in dicts, lists and tuples: a model ``state_dict``, an optimizer
``state_dict``, RNG states) is copied to host memory (``.detach().to("cpu", copy=True)`` semantics; into
page-locked memory when the tensor is on a CUDA device, so the copy is a DMA), and everything else is
deep-copied. After ``save`` returns the caller may change its tensors in place: the checkpoint holds the
values of the moment of the call. A background thread then serialises each payload entry with `torch.save`
into its own file (``<entry>.pt``), computing sizes and sha256 as the bytes stream to the store, commits the
manifest, and applies the store's retention policy.

One write is in flight at a time: ``save`` first waits for the previous write to finish (the wait is reported
on the handle as ``waited_s`` and logged), so at most two copies of the state exist (the live one and one
snapshot). The host buffers of a snapshot are reused by the next one (``reuse_buffers=True``), which avoids
allocating and page-faulting (or pinning) the whole state at every save; this holds one host copy of the
state between saves.

A failure in the background write never reaches the caller's thread: it is stored on the handle
(``handle.error``), logged, and counted (``writer.failures``). The previous checkpoint stays the newest one,
because the failed write never gets a manifest.

Entries whose key ends in ``.json`` (run state: step, epoch, data position, history) are written as JSON;
every other entry as ``<key>.pt`` with `torch.save`. Loading (`load`) never unpickles arbitrary objects:
``.pt`` files go through ``torch.load(weights_only=True)``, which admits only tensors and plain containers
(dict, list, tuple, str, int, float, bool, None), so a checkpoint folder written by someone else cannot run
code on `checkpoint.resume=<folder>`; a file holding any other pickled object is refused with a
`CheckpointError`. Keep payloads to those types (`checkpoint.state.rng_state` turns numpy's RNG state into a
tensor for this reason).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import pickle
import threading
import time
from collections.abc import Callable
from typing import IO, Any, cast

import numpy as np
import torch

from yatt_ray.checkpoint.store import (
    CheckpointError,
    CheckpointRef,
    CheckpointStore,
    PendingCheckpoint,
    check_json_metadata,
    validate_file_name,
)

logger = logging.getLogger("yatt_ray.checkpoint")

ENTRY_SUFFIX = ".pt"
JSON_SUFFIX = ".json"


def entry_file_name(key: str) -> str:
    """The file a payload entry is stored in: ``<key>`` for a ``*.json`` key, else ``<key>.pt``. Raises
    `CheckpointError` on a bad key."""
    if not isinstance(key, str):
        raise CheckpointError(f"checkpoint payload keys must be strings, got {key!r}")
    try:
        return validate_file_name(key if key.endswith(JSON_SUFFIX) else key + ENTRY_SUFFIX)
    except CheckpointError as exc:
        raise CheckpointError(
            f"checkpoint payload key {key!r} cannot be a file name: use letters, digits, '_', '-' and '.', "
            "no '/' and no leading '.' (e.g. 'model', 'optimizer', 'rng')"
        ) from exc


class SaveHandle:
    """The outcome of one `AsyncCheckpointWriter.save`, filled in by the background write.

    Attributes: ``step``; ``ref`` (the committed `CheckpointRef`, once done and successful); ``error`` (the
    exception, once done and failed); timings in seconds: ``waited_s`` (for the previous write),
    ``snapshot_s`` (copying the payload), ``blocking_s`` (the whole time ``save`` held the caller),
    ``write_s`` (serialise + upload + commit in the background), ``retention_s``; ``bytes_written``.
    """

    def __init__(self, step: int):
        self.step = step
        self.ref: CheckpointRef | None = None
        self.error: BaseException | None = None
        self.waited_s = 0.0
        self.snapshot_s = 0.0
        self.blocking_s = 0.0
        self.write_s = 0.0
        self.retention_s = 0.0
        self.bytes_written = 0
        self._done = threading.Event()

    def done(self) -> bool:
        """True once the background write has finished, successfully or not."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write finishes or `timeout` seconds pass; True if it finished (see ``error``)."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> CheckpointRef:
        """Wait, then return the committed ref; raise the write's error, or `TimeoutError`."""
        if not self.wait(timeout):
            raise TimeoutError(
                f"checkpoint step {self.step} was still being written after {timeout}s; wait longer, or check "
                "the storage's throughput (SaveHandle.bytes_written grows while it works)"
            )
        if self.error is not None:
            raise CheckpointError(
                f"checkpoint step {self.step} was not written: {self.error!r}"
            ) from self.error
        if self.ref is None:  # cannot happen: ref or error is set before _done
            raise CheckpointError(f"checkpoint step {self.step} finished without a result")
        return self.ref

    def __repr__(self) -> str:
        state = "failed" if self.error else ("committed" if self.ref else "writing")
        return f"SaveHandle(step={self.step}, {state}, blocking_s={self.blocking_s:.3f})"


class _StagingBuffers:
    """Host buffers for snapshots, reused from one save to the next (one write is in flight at a time)."""

    def __init__(self, pin_cuda: bool, reuse: bool):
        self.pin_cuda = pin_cuda
        self.reuse = reuse
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def copy(self, tensor: torch.Tensor, used: list[tuple[tuple, torch.Tensor]]) -> torch.Tensor:
        src = tensor.detach()
        if src.layout != torch.strided or not src.is_contiguous() or src.is_meta:
            return src.to("cpu", copy=True)  # rare layouts: a plain copy, no pooled buffer
        pin = self.pin_cuda and src.is_cuda
        key = (src.dtype, tuple(src.shape), pin)
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        if not (src.device.type == "cpu" and _memcpy(buf, src)):
            buf.copy_(src, non_blocking=pin)
        if self.reuse:
            used.append((key, buf))
        return buf

    def end_snapshot(self) -> None:
        """Drop buffers this snapshot did not use (shapes that are gone), keeping memory at one snapshot."""
        self._free = {}

    def give_back(self, used: list[tuple[tuple, torch.Tensor]]) -> None:
        for key, buf in used:
            self._free.setdefault(key, []).append(buf)


def _memcpy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy a contiguous CPU tensor byte for byte, single threaded; False if this tensor needs `copy_`.

    `Tensor.copy_` on the CPU splits big copies over the intra-op thread pool, whose barrier stalls badly
    when the cores are shared with other processes (seen: 2 s for 5 MB); a plain memcpy does not.
    """
    if src.is_conj() or src.is_neg() or src.is_quantized:
        return False  # lazy conjugate / negative bits or packed data: only copy_ materialises them
    try:
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def _walk(obj: Any, copy_tensor: Callable[[torch.Tensor], torch.Tensor], copy_leaf: bool, memo: dict) -> Any:
    """Rebuild dicts / lists / tuples with tensors replaced by `copy_tensor`; deep-copy other leaves.

    A tensor reachable twice (tied weights) is copied once and stays shared. Tensors hidden inside other
    objects are deep-copied with those objects (on their own device): keep tensors in plain containers.
    """
    oid = id(obj)
    if oid in memo:
        return memo[oid]
    if isinstance(obj, torch.Tensor):
        out: Any = copy_tensor(obj)
    elif isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type (OrderedDict, defaultdict's factory)
        out.clear()
        memo[oid] = out
        for k, v in obj.items():
            out[k] = _walk(v, copy_tensor, copy_leaf, memo)
        return out
    elif type(obj) is list:
        out = []
        memo[oid] = out
        out.extend(_walk(v, copy_tensor, copy_leaf, memo) for v in obj)
        return out
    elif isinstance(obj, tuple) and (type(obj) is tuple or hasattr(obj, "_fields")):
        items = [_walk(v, copy_tensor, copy_leaf, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    elif copy_leaf:
        out = copy.deepcopy(obj, memo)  # shares `memo`: tensors already copied are reused inside objects
    else:
        out = obj
    memo[oid] = out
    return out


class AsyncCheckpointWriter:
    """Writes checkpoints of a training loop into a `CheckpointStore` in a background thread.

    Args:
        store: where checkpoints go (its ``keep_last`` / ``keep_every`` apply after each commit).
        pin_memory: stage CUDA tensors in page-locked host memory (default: when CUDA is available).
        reuse_buffers: keep the snapshot's host buffers for the next save (default True; see module doc).

    Typical loop::

        writer = AsyncCheckpointWriter(CheckpointStore("s3://bucket/run1/ckpt", keep_last=3))
        for step in ...:
            ...
            if schedule.due(step):
                writer.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, {"epoch": e})
                schedule.mark_saved(step)
        writer.close()  # waits for the last write

    The writer thread is not a daemon: an interpreter that exits normally finishes the write first.
    """

    def __init__(self, store: CheckpointStore, pin_memory: bool | None = None, reuse_buffers: bool = True):
        if not isinstance(store, CheckpointStore):
            raise CheckpointError(
                f"AsyncCheckpointWriter needs a CheckpointStore, got {type(store).__name__}"
            )
        self.store = store
        pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._staging = _StagingBuffers(pin_cuda=pin, reuse=reuse_buffers)
        self._lock = threading.Lock()
        self._last: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.failures = 0
        self.saves = 0

    @property
    def last_handle(self) -> SaveHandle | None:
        return self._last

    def _check_request(self, step: int, payload: dict[str, Any], metadata: dict[str, Any] | None) -> dict:
        if self._closed:
            raise CheckpointError(
                f"save of step {step} after AsyncCheckpointWriter.close(): make a new writer"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
        if not isinstance(payload, dict) or not payload:
            raise CheckpointError(
                f"checkpoint payload must be a non-empty dict of name -> state, got {type(payload).__name__} "
                f"{payload!r:.80}"
            )
        for key, value in payload.items():
            entry_file_name(key)
            if key.endswith(JSON_SUFFIX):
                try:
                    json.dumps(value)
                except (TypeError, ValueError) as exc:
                    raise CheckpointError(
                        f"checkpoint entry {key!r} is not JSON-serialisable: {exc}"
                    ) from exc
        meta = dict(metadata or {})
        check_json_metadata(meta)
        return meta

    def _wait_previous(self) -> float:
        last = self._last
        if last is None or last.done():
            return 0.0
        start = time.perf_counter()
        last.wait()
        waited = time.perf_counter() - start
        logger.info(
            "checkpoint: waited %.2fs for the write of step %d before snapshotting the next one "
            "(saves come faster than the storage writes: save less often or use faster storage)",
            waited,
            last.step,
        )
        return waited

    def _already_committed(self, step: int) -> bool:
        try:
            return self.store.exists(step)
        except Exception as exc:  # storage trouble must not reach the training loop; begin() checks again
            logger.warning(
                "checkpoint: could not check whether step %d exists (%r); writing it anyway", step, exc
            )
            return False

    def save(self, step: int, payload: dict[str, Any], metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Snapshot `payload` now and write it as checkpoint `step` in the background; return its handle.

        Blocks for: the previous write (if still running), the snapshot copy, and a check that `step` is not
        already committed. `metadata` (JSON-serialisable) goes into the manifest.
        """
        with self._lock:
            t0 = time.perf_counter()
            meta = self._check_request(step, payload, metadata)
            handle = SaveHandle(step)
            handle.waited_s = self._wait_previous()
            if self._already_committed(step):
                raise CheckpointError(
                    f"checkpoint step {step} is already committed in {self.store.root_url}: save under a new "
                    f"step, or delete the old one first (store.delete({step}))"
                )
            t1 = time.perf_counter()
            used: list[tuple[tuple, torch.Tensor]] = []
            devices: set[torch.device] = set()

            def copy_tensor(t: torch.Tensor) -> torch.Tensor:
                if t.is_cuda:
                    devices.add(t.device)
                return self._staging.copy(t, used)

            snapshot = _walk(payload, copy_tensor, copy_leaf=True, memo={})
            for device in devices:
                torch.cuda.synchronize(device)  # the non_blocking copies into pinned memory are complete
            self._staging.end_snapshot()
            handle.snapshot_s = time.perf_counter() - t1
            handle.blocking_s = time.perf_counter() - t0
            self._last = handle
            self.saves += 1
            self._thread = threading.Thread(
                target=self._write_in_background,
                args=(handle, snapshot, meta, used),
                name=f"yatt-checkpoint-step-{step}",
                daemon=False,
            )
            self._thread.start()
            return handle

    def _write_entries(self, pending: PendingCheckpoint, state: dict[str, Any], handle: SaveHandle) -> None:
        for key, value in state.items():
            with pending.open(entry_file_name(key)) as f:
                if key.endswith(JSON_SUFFIX):
                    f.write(json.dumps(value).encode())
                else:
                    torch.save(
                        value, cast(IO[bytes], f)
                    )  # write-only, not seekable: torch.save needs no more
            handle.bytes_written += pending.files[entry_file_name(key)].size

    def _retain(self, handle: SaveHandle) -> None:
        start = time.perf_counter()
        try:
            self.store.apply_retention(known_valid=handle.step)
        except Exception as exc:  # the checkpoint is committed; a failed clean-up only costs space
            logger.warning("checkpoint step %d committed, but retention failed: %r", handle.step, exc)
        handle.retention_s = time.perf_counter() - start

    def _write_in_background(
        self, handle: SaveHandle, snapshot: dict[str, Any], meta: dict, used: list[tuple[tuple, torch.Tensor]]
    ) -> None:
        start = time.perf_counter()
        pending: PendingCheckpoint | None = None
        try:
            try:
                pending = self.store.begin(handle.step)
                self._write_entries(pending, snapshot, handle)
                handle.ref = self.store.commit(pending, meta)
            except BaseException as exc:  # stored, logged and counted: never raised into the training loop
                handle.error = exc
                self.failures += 1
                logger.error(
                    "checkpoint step %d FAILED in the background write (%r); the previous checkpoint stays "
                    "the newest; failures so far: %d",
                    handle.step,
                    exc,
                    self.failures,
                    exc_info=exc,
                )
                if pending is not None:
                    pending.abort()
            handle.write_s = time.perf_counter() - start
            del snapshot
            if handle.ref is not None:
                self._retain(handle)
            self._staging.give_back(used)
        finally:
            handle._done.set()

    def save_sync(
        self, step: int, payload: dict[str, Any], metadata: dict[str, Any] | None = None
    ) -> CheckpointRef:
        """Write checkpoint `step` in the caller's thread, in the same format; raise on failure.

        For comparison with `save`, and for "save, then exit" after a preemption signal. Waits for an async
        write in flight first. Tensors on accelerators are moved to the CPU as they are serialised (CPU
        tensors are not copied).
        """
        with self._lock:
            meta = self._check_request(step, payload, metadata)
            self._wait_previous()
            start = time.perf_counter()
            handle = SaveHandle(step)
            state = _walk(payload, lambda t: t.detach().cpu(), copy_leaf=False, memo={})
            pending = self.store.begin(step)
            try:
                self._write_entries(pending, state, handle)
                ref = self.store.commit(pending, meta)
            except BaseException:
                pending.abort()
                raise
            handle.ref = ref
            handle.write_s = time.perf_counter() - start
            self._retain(handle)
            handle._done.set()
            self._last = handle
            self.saves += 1
            return ref

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the last write (up to `timeout` s) and refuse further saves; True if nothing is left."""
        self._closed = True
        last = self._last
        return last is None or last.wait(timeout)

    def __enter__(self) -> AsyncCheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load(
        self, ref: CheckpointRef, names: list[str] | None = None, map_location: Any = "cpu"
    ) -> dict[str, Any]:
        """Read the entries of `ref` back; see the module `load`."""
        return load(self.store, ref, names=names, map_location=map_location)


def load(
    store: CheckpointStore,
    ref: CheckpointRef,
    names: list[str] | None = None,
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """The payload saved as checkpoint `ref`: ``{entry: object}``, each file checked against its sha256.

    `names` picks entries (default: all). ``*.json`` entries are parsed as JSON, the others read with
    ``torch.load(weights_only=True)``: a file holding a pickled object of another type is refused
    (`CheckpointError`), never executed.
    """
    available = [_entry_key(f.name) for f in ref.manifest.files if _entry_key(f.name)]
    wanted = available if names is None else list(names)
    missing = [n for n in wanted if n not in available]
    if missing:
        raise CheckpointError(
            f"checkpoint step {ref.step} has no entries {missing}; it has {sorted(available)}"
        )
    out: dict[str, Any] = {}
    for key in wanted:
        fname = entry_file_name(key)
        data = store.read(ref, fname)
        if hashlib.sha256(data).hexdigest() != ref.manifest.file(fname).sha256:
            raise CheckpointError(
                f"checkpoint step {ref.step} file {fname!r} fails its sha256 check: it was damaged after the "
                "write; resume from `store.latest_valid()`, which skips damaged checkpoints"
            )
        out[key] = _decode(data, fname, ref, map_location)
    return out


def _entry_key(file_name: str) -> str:
    """The payload key of a checkpoint file ("" for files that are not payload entries)."""
    if file_name.endswith(JSON_SUFFIX):
        return file_name
    return file_name[: -len(ENTRY_SUFFIX)] if file_name.endswith(ENTRY_SUFFIX) else ""


def _decode(data: bytes, fname: str, ref: CheckpointRef, map_location: Any) -> Any:
    where = f"checkpoint step {ref.step} file {fname!r} in {ref.path}"
    if fname.endswith(JSON_SUFFIX):
        try:
            return json.loads(data)
        except ValueError as exc:
            raise CheckpointError(f"{where} is not valid JSON ({exc})") from exc
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{where} holds a pickled object that is not a tensor or a plain container, so it was refused "
            f"unread (loading it could run code). yatt_ray writes no such files: the folder was written by "
            f"something else or tampered with; resume from a checkpoint you trust. Detail: {exc}"
        ) from exc
