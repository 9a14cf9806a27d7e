"""Checkpoints: an fsspec store committed by manifest, an asynchronous writer, and when to save.

* `CheckpointStore`: ``<root>/step_XXXXXXXX/`` directories on any fsspec URL; ``manifest.json`` (sizes and
  sha256 of every file) is written last and is the commit marker; `latest_valid` skips damaged checkpoints;
  retention keeps the last N plus every K-th step.
* `AsyncCheckpointWriter`: ``save`` blocks only for a host-memory snapshot; a background thread writes.
* `CheckpointSchedule` and `PreemptionFlag`: save every N steps / M minutes, and on SIGTERM.
"""

from typing import TYPE_CHECKING, Any

from yatt_ray.checkpoint.schedule import CheckpointSchedule, PreemptionFlag
from yatt_ray.checkpoint.store import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointFormatError,
    CheckpointRef,
    CheckpointStore,
    FileEntry,
    Manifest,
    PendingCheckpoint,
)

if TYPE_CHECKING:
    from yatt_ray.checkpoint.writer import AsyncCheckpointWriter, SaveHandle, load

_WRITER_NAMES = ("AsyncCheckpointWriter", "SaveHandle", "load")


def __getattr__(name: str) -> Any:
    """The writer's names, imported when first asked for: it imports torch (about 1.2 s), which the run's
    driver-side actor (`run_control`, through `schedule`) never needs."""
    if name in _WRITER_NAMES:
        from yatt_ray.checkpoint import writer

        return getattr(writer, name)
    raise AttributeError(f"module 'yatt_ray.checkpoint' has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "AsyncCheckpointWriter",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointRef",
    "CheckpointSchedule",
    "CheckpointStore",
    "FileEntry",
    "Manifest",
    "PendingCheckpoint",
    "PreemptionFlag",
    "SaveHandle",
    "load",
]
