"""Where the seconds before the first step go: stage marks from the driver and the first training worker.

A mark is a stage name and the wall-clock time it was reached. The driver marks its own stages (`Startup`);
rank 0's worker sends its marks through the MetricsHub (`HubLink.mark`; the first mark of a stage wins, so a
restart does not move them). At the end the driver writes ``startup.json`` beside the metrics and the closing
report says how long the start took, so nobody mistakes it for training time. `release/bench_startup.py`
prints the table.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# (stage, what has happened when it is marked), in the order a run reaches them
STAGES: tuple[tuple[str, str], ...] = (
    (
        "command",
        "the driver process started (its Python imports come after); or the fit() call, see `origin`",
    ),
    ("fit_called", "yatt_ray.fit entered: imports done"),
    ("inputs_checked", "config, demo inputs, model directory, data files, reward function, checkpoint store"),
    ("ray_started", "the local Ray cluster is up (or joined)"),
    (
        "kernels_chosen",
        "placement planned; CPU kernels measured (first run on a machine) or read from the cache",
    ),
    ("trainer_launched", "placement checked; TorchTrainer.fit called (Ray Train starts its worker group)"),
    ("worker_started", "rank 0's train function entered: worker processes up, torch.distributed ready"),
    ("peak_measured", "imports and CPU shims done, the accelerator's peak known (measured once on CPUs)"),
    ("policy_built", "the Megatron policy (and reference, critic) built from the HF directory"),
    ("data_opened", "resume decided, the prompt streams opened (Ray Data reads from here on)"),
    ("engine_started", "the rollout engine loaded the model (while the streams read)"),
    ("first_eval_done", "greedy evaluation of the initial policy (when there is an eval set)"),
    (
        "first_batch",
        "the first prompts are at the controller (waited for before step 1: the stream's cold start)",
    ),
    ("first_step_done", "step 1 generated, scored and trained"),
)
STAGE_NAMES = tuple(name for name, _ in STAGES)


def process_start_time(pid: int | None = None) -> float:
    """When this process (or `pid`) started, as a wall-clock time: the user's command, for the driver."""
    import psutil

    return float(psutil.Process(pid or os.getpid()).create_time())


IMPORT_WINDOW_S = 60.0  # longer between the process start and fit(): the process did other work first
_fits_in_process = 0


def origin(now: float, process_start: float, earlier_fits: int) -> tuple[float, str]:
    """Where a run's start-up is counted from: (wall-clock time, its name).

    The process start ("the command": the user's `python examples/grpo.py`, its imports included) for the
    first fit() of a process entered within IMPORT_WINDOW_S of the process start; otherwise the fit() call
    itself (a notebook's cell, a second fit() in one process, a benchmark that warmed a model up first), so
    the report never counts the user's own time before the call as start-up."""
    if earlier_fits == 0 and now - process_start <= IMPORT_WINDOW_S:
        return process_start, "the command"
    return now, "the fit() call"


class Startup:
    """The driver's marks; `mark(stage)` keeps the first time a stage is reached. The "command" mark is
    where the start is counted from (`origin`), named by `self.origin`."""

    def __init__(self) -> None:
        global _fits_in_process
        at, self.origin = origin(time.time(), process_start_time(), _fits_in_process)
        _fits_in_process += 1
        self.marks: dict[str, float] = {"command": at}

    def mark(self, stage: str, at: float | None = None) -> None:
        if stage not in STAGE_NAMES:
            raise ValueError(f"unknown start-up stage {stage!r}; valid: {', '.join(STAGE_NAMES)}")
        self.marks.setdefault(stage, time.time() if at is None else at)


def startup_table(marks: dict[str, float]) -> list[tuple[str, float, float]]:
    """(stage, seconds since the command, seconds since the previous mark) for the marked stages, in run order."""
    start = marks.get("command", min(marks.values(), default=0.0))
    rows, previous = [], start
    for name in STAGE_NAMES:
        if name in marks:
            rows.append((name, marks[name] - start, marks[name] - previous))
            previous = marks[name]
    return rows


def first_step_seconds(marks: dict[str, float]) -> float | None:
    """Seconds from the command to the end of step 1, or None when a stage is missing."""
    if "command" not in marks or "first_step_done" not in marks:
        return None
    return marks["first_step_done"] - marks["command"]


def format_table(marks: dict[str, float]) -> str:
    """The table `release/bench_startup.py` prints: one line a stage."""
    what = dict(STAGES)
    lines = [f"{'stage':<18} {'at s':>7} {'took s':>7}  what"]
    for name, at, took in startup_table(marks):
        lines.append(f"{name:<18} {at:7.1f} {took:7.1f}  {what[name]}")
    return "\n".join(lines)


def write_startup(path: Path, marks: dict[str, float], since: str = "the command") -> None:
    """``startup.json``: the marks (wall-clock seconds), what "command" stands for (`origin`), the table."""
    rows = [{"stage": n, "at_s": round(a, 3), "took_s": round(t, 3)} for n, a, t in startup_table(marks)]
    body = {"marks": marks, "origin": since, "table": rows}
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


def report_line(marks: dict[str, float], since: str = "the command") -> str:
    """The closing report's line, e.g. ``start-up  41.2 s from the command to the end of step 1 (...)``;
    `since`: `Startup.origin`."""
    total = first_step_seconds(marks)
    if total is None:
        return ""
    longest = sorted(startup_table(marks)[1:], key=lambda r: -r[2])[:3]
    parts = ", ".join(f"{name} {took:.1f}" for name, _, took in longest)
    return (
        f"  {'start-up':<18} {total:.1f} s from {since} to the end of step 1 (longest: {parts}; startup.json)"
    )
