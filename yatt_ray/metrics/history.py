"""One metrics curve from rows pushed by runs that restarted and redid steps.

After a restart the workers redo the steps since the checkpoint they resumed from, and push those steps'
rows again. `rewind_history` keeps the curve the surviving model actually followed: when a training row for
step s arrives, the earlier training rows for steps >= s are dropped (the same for evaluation rows).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

RESUME_KEY = "checkpoint/resumed_from"

log = logging.getLogger(__name__)


def row_kind(row: dict[str, float]) -> str:
    """The row's kind: "checkpoint" (only checkpoint/* values, e.g. a resume marker), "idle" (the driver's
    idle-time row of a step, which arrives after the next step's training row), "eval" or "train"."""
    if all(k == "step" or k.startswith("checkpoint/") for k in row):
        return "checkpoint"
    if all(k == "step" or k.startswith("idle/") for k in row):
        return "idle"
    return "eval" if any(k.startswith("eval/") for k in row) else "train"


def rewind_history(rows: list[dict[str, float]]) -> tuple[list[dict[str, float]], int]:
    """(rows with redone steps replaced by their last version, how many training rows were dropped)."""
    kept: list[dict[str, float]] = []
    dropped = 0
    for row in rows:
        kind, step = row_kind(row), row.get("step", 0)
        if kind != "checkpoint":
            stale = [r for r in kept if row_kind(r) == kind and r.get("step", 0) >= step]
            dropped += sum(1 for r in stale if kind == "train")
            kept = [r for r in kept if not any(r is s for s in stale)]
        kept.append(row)
    return kept, dropped


def one_curve(progress, output_dir: Path) -> int:
    """Replace redone steps' rows in `progress.history` and metrics.jsonl by their last version; return how
    many training rows were dropped (steps redone after restarts)."""
    rows, dropped = rewind_history(progress.history)
    if dropped:
        progress.history[:] = rows
        path = output_dir / "metrics.jsonl"
        if path.exists():
            lines = [json.dumps({"step": int(r.get("step", 0)), **{k: v for k, v in r.items() if k != "step"}})
                     for r in rows]  # fmt: skip
            path.write_text("".join(line + "\n" for line in lines))
        log.warning("%d steps were redone after a restart; the metrics keep their last version", dropped)
    return dropped
