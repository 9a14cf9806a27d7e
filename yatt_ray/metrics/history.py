"""One metrics curve from rows pushed by runs that restarted and redid steps.

After a restart the workers redo the steps since the checkpoint they resumed from, and push those steps'
rows again. `rewind_history` keeps the curve the surviving model actually followed: when a training row for
step s arrives, the earlier training rows for steps >= s are dropped (the same for evaluation rows).
"""

from __future__ import annotations

RESUME_KEY = "checkpoint/resumed_from"


def row_kind(row: dict[str, float]) -> str:
    """The row's kind: "checkpoint" (only checkpoint/* values, e.g. a resume marker), "idle" (the driver's
    idle-time row of a step, which arrives after the next step's training row), "eval" or "train"."""
    if all(k == "step" or k.startswith("checkpoint/") for k in row):
        return "checkpoint"
    if all(k == "step" or k.startswith("idle/") for k in row):
        return "idle"
    return "eval" if any(k.startswith("eval/") for k in row) else "train"


class OneCurve:
    """The run's metric rows as one curve, kept as they arrive: a row of kind k for step s drops the earlier
    rows of kind k for steps >= s (the steps a restart redid). `redone` counts the dropped training rows."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.redone = 0

    def add(self, row: dict[str, float]) -> bool:
        """Append `row`; True when it replaced earlier rows (the curve went back)."""
        kind, step = row_kind(row), row.get("step", 0)
        stale = (
            []
            if kind == "checkpoint"
            else [r for r in self.rows if row_kind(r) == kind and r.get("step", 0) >= step]
        )
        if stale:
            self.redone += sum(1 for r in stale if kind == "train")
            self.rows = [r for r in self.rows if not any(r is x for x in stale)]
        self.rows.append(row)
        return bool(stale)


def rewind_history(rows: list[dict[str, float]]) -> tuple[list[dict[str, float]], int]:
    """(rows with redone steps replaced by their last version, how many training rows were dropped)."""
    curve = OneCurve()
    for row in rows:
        curve.add(row)
    return curve.rows, curve.redone
