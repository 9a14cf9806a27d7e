"""One metrics curve from rows pushed by runs that restarted and redid steps.

After a restart the workers redo the steps since the checkpoint they resumed from, and push those steps'
rows again. `rewind_history` keeps the curve the surviving model actually followed: when a training row for
step s arrives, the earlier training rows for steps >= s are dropped (the same for evaluation rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

RESUME_KEY = "checkpoint/resumed_from"

RowKind = Literal["train", "eval", "idle", "checkpoint"]
ROW_KINDS: tuple[str, ...] = ("train", "eval", "idle", "checkpoint")


@dataclass(frozen=True)
class MetricRow:
    """One row of scalars and what it is, said by whoever pushes it: a training step ("train"), an evaluation
    ("eval"), the driver's idle-time row of a step ("idle", which arrives after the next step's training row),
    or a checkpoint event ("checkpoint": a resume marker, the last saves' outcome). `values` holds "step"."""

    kind: RowKind
    values: dict[str, float]

    @property
    def step(self) -> float:
        return self.values.get("step", 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "values": self.values}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetricRow:
        return cls(data["kind"], dict(data["values"]))


class OneCurve:
    """The run's metric rows as one curve, kept as they arrive: a row of kind k for step s drops the earlier
    rows of kind k for steps >= s (the steps a restart redid; checkpoint rows are events and stay).
    `redone` counts the dropped training rows."""

    def __init__(self) -> None:
        self.rows: list[MetricRow] = []
        self.redone = 0

    def add(self, row: MetricRow) -> bool:
        """Append `row`; True when it replaced earlier rows (the curve went back)."""
        stale: list[MetricRow] = []
        if row.kind != "checkpoint":
            stale = [r for r in self.rows if r.kind == row.kind and r.step >= row.step]
        if stale:
            self.redone += sum(1 for r in stale if row.kind == "train")
            self.rows = [r for r in self.rows if not any(r is x for x in stale)]
        self.rows.append(row)
        return bool(stale)


def rewind_history(rows: list[MetricRow]) -> tuple[list[MetricRow], int]:
    """(rows with redone steps replaced by their last version, how many training rows were dropped)."""
    curve = OneCurve()
    for row in rows:
        curve.add(row)
    return curve.rows, curve.redone
