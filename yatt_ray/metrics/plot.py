"""A PNG of training curves (reward, accuracy, ...) against the step, from logged history."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_history"]


def plot_history(
    history: Sequence[Mapping[str, Any]],
    out_png: str | Path,
    keys: Sequence[str] = ("reward_mean", "accuracy"),
    title: str | None = None,
) -> Path:
    """Plot each of ``keys`` against ``"step"`` in its own subplot (stacked, shared x axis) and save a PNG.

    ``history`` is a list of per-step records as written by `JsonlSink` (``{"step": 0, "reward_mean": ...}``;
    `read_jsonl` loads one). A record without ``"step"`` uses its index. Keys that no record holds are skipped;
    records missing a key (or holding None for it) are skipped for that key. Raises `ValueError` if
    ``history`` is empty or none of ``keys`` appears in it. Returns the path written (parent folders are
    created).

    Uses matplotlib's Agg renderer through a standalone `Figure`, so it needs no display and does not change
    the global pyplot backend of a notebook that calls it.
    """
    if not history:
        raise ValueError(
            f"history is empty: nothing to plot to {str(out_png)!r}; log at least one step first"
        )
    present = [k for k in keys if any(rec.get(k) is not None for rec in history)]
    if not present:
        available = sorted({k for rec in history for k in rec} - {"step"})
        raise ValueError(f"none of the keys {list(keys)} is in the history; available keys: {available}")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 2.4 * len(present) + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, present):
        points = [(rec.get("step", i), rec[key]) for i, rec in enumerate(history) if rec.get(key) is not None]
        steps = [s for s, _ in points]
        values = [float(v) for _, v in points]
        ax.plot(steps, values, marker="o" if len(points) <= 50 else None, markersize=3)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if title:
        fig.suptitle(title)

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
