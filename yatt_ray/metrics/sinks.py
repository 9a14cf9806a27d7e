"""Where per-step scalar metrics go: a JSONL file, TensorBoard, or several at once.

Every sink has ``write(step, metrics)`` and ``close()`` and is a context manager. Values must be real scalars
(Python or NumPy ``int`` / ``float`` / ``bool``): the driver receives only scalars, so a tensor or a list
reaching a sink is a bug upstream, and it is reported with the offending key. Convert with ``.item()``.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonlSink", "MultiSink", "Sink", "TensorBoardSink", "read_jsonl", "validate_metrics"]


def validate_metrics(step: Any, metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """Check ``step`` and ``metrics``; return the metrics as plain Python ``int`` / ``float`` values.

    Raises `TypeError` naming the key of any value that is not a real scalar (a tensor, array, list, string,
    None, ...), or a key that is not a non-empty string; `ValueError` for a negative step or a metric named
    ``"step"`` (reserved). Integers (and bools) stay ``int``; everything else becomes ``float`` (NaN and inf
    are allowed: a diverging loss should be recorded, not crash the run).
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> scalar, got {type(metrics).__name__}")
    out: dict[str, int | float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric names must be non-empty strings, got {key!r}")
        if key == "step":
            raise ValueError("'step' is reserved for the step number; rename the metric")
        if isinstance(value, numbers.Integral):
            out[key] = int(value)
        elif isinstance(value, numbers.Real):
            out[key] = float(value)
        else:
            shape = getattr(value, "shape", None)
            hint = f" of shape {tuple(shape)}" if shape is not None else ""
            raise TypeError(
                f"metric {key!r} must be a real scalar (int or float), got {type(value).__name__}{hint}; "
                f"reduce it and convert with .item() (e.g. tensor.mean().item()) before logging"
            )
    return out


class Sink:
    """Base class: ``write(step, metrics)`` and ``close()``; usable as a context manager."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class JsonlSink(Sink):
    """Appends one JSON object per step, ``{"step": 3, "reward_mean": 0.5, ...}``, one per line, to ``path``.

    The file is opened in append mode (a resumed run continues the same file; parent folders are created)
    and flushed after every line, so a crash loses nothing already written. Non-finite floats are written as
    ``NaN`` / ``Infinity``, which Python's `json` (and `read_jsonl`) read back.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": int(step), **validate_metrics(step, metrics)}
        if self._file.closed:
            raise RuntimeError(f"JsonlSink({str(self.path)!r}) is closed; create a new sink to write more")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink(Sink):
    """Writes each metric as a TensorBoard scalar (``add_scalar(key, value, step)``) under ``logdir``.

    Flushes after every step so that a running TensorBoard shows it at once (a step takes seconds or more,
    so the cost does not matter). ``torch.utils.tensorboard`` is imported only when a sink is created.
    """

    def __init__(self, logdir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(logdir)
        self._writer = SummaryWriter(log_dir=str(self.logdir))
        self._closed = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = validate_metrics(step, metrics)
        if self._closed:
            raise RuntimeError(
                f"TensorBoardSink({str(self.logdir)!r}) is closed; create a new sink to write more"
            )
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True


class MultiSink(Sink):
    """Forwards every write to each of ``sinks`` (validating once, so a bad value reaches none of them).

    ``close()`` closes every sink even if one fails, then re-raises the first failure.
    """

    def __init__(self, sinks: Iterable[Sink]) -> None:
        self.sinks = list(sinks)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = validate_metrics(step, metrics)
        for sink in self.sinks:
            sink.write(step, values)

    def close(self) -> None:
        first: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # keep closing the others
                first = first or exc
        if first is not None:
            raise first


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a `JsonlSink` file back as a list of records (for `plot_history` or analysis); blank lines skipped."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
