"""The one channel from workers to the driver: per-step scalar metrics, held by the run's actor
(`run_control.RunActor`).

Workers push one row of scalars per step; the driver polls for new rows to drive its progress bar and
sinks. Rows with anything but numbers are refused, so samples can never reach the driver this way. Workers
also push the spans of the idle-time timeline (`yatt_ray.metrics.timeline`) in its wire format: short names
and numbers only, validated the same way.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from yatt_ray.metrics.history import ROW_KINDS, MetricRow, RowKind
from yatt_ray.metrics.timeline import WireSpan, from_wire, to_wire


def check_scalars(row: dict) -> dict[str, float]:
    """`row` with every value as a float; TypeError naming the key when a value is not a real number."""
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"metric {key!r} is a {type(value).__name__}; only scalar numbers may reach the driver"
            )
        out[str(key)] = float(value)
    return out


class MetricsHub:
    """Append-only lists of metric rows and timeline spans; `rows_since(i)` returns rows i, i+1, ... and
    `spans_since(i)` spans i, i+1, ... (as wire tuples)."""

    def __init__(self) -> None:
        self._rows: list[MetricRow] = []
        self._spans: list[WireSpan] = []
        self._marks: dict[str, float] = {}  # start-up stage -> wall-clock time (`metrics.startup`)

    def mark(self, stage: str, at: float) -> None:
        """A start-up stage reached at `at` (the first mark of a stage wins: a restart does not move it)."""
        self._marks.setdefault(str(stage), float(at))

    def marks(self) -> dict[str, float]:
        return dict(self._marks)

    def push(self, row: MetricRow) -> None:
        """Append a row; a kind it does not know, or a value that is not a number, is refused."""
        if row.kind not in ROW_KINDS:
            raise ValueError(f"metric row kind {row.kind!r} is unknown; valid: {', '.join(ROW_KINDS)}")
        self._rows.append(MetricRow(row.kind, check_scalars(row.values)))

    def rows_since(self, index: int) -> list[MetricRow]:
        return self._rows[index:]

    def push_spans(self, spans: Iterable[Sequence[Any]]) -> None:
        """Append wire spans (`timeline.to_wire`); a bad one (long name, non-number, ...) rejects the whole
        push with `ValueError`. Names are interned so that repeated names pickle once per reply."""
        checked = to_wire(from_wire(spans))
        self._spans.extend(
            (sys.intern(r), sys.intern(w), sys.intern(a), sys.intern(p), step, start, end, busy)
            for r, w, a, p, step, start, end, busy in checked
        )

    def spans_since(self, index: int) -> list[WireSpan]:
        return self._spans[index:]


class HubLink:
    """A worker's typed line to the MetricsHub actor: each call waits at most `timeout_s`."""

    def __init__(self, hub, timeout_s: float) -> None:
        self.hub, self.timeout_s = hub, timeout_s

    def push(self, kind: RowKind, values: dict) -> None:
        import ray

        ray.get(self.hub.push.remote(MetricRow(kind, values)), timeout=self.timeout_s)

    def push_spans(self, spans: list[WireSpan]) -> None:
        import ray

        ray.get(self.hub.push_spans.remote(spans), timeout=self.timeout_s)

    def rows_since(self, index: int) -> list[MetricRow]:
        import ray

        return ray.get(self.hub.rows_since.remote(index), timeout=self.timeout_s)

    def mark(self, stage: str, at: float | None = None) -> None:
        """Tell the driver a start-up stage was reached (now, or at `at`; `yatt_ray.metrics.startup`); not
        waited for."""
        import time

        self.hub.mark.remote(stage, time.time() if at is None else at)
