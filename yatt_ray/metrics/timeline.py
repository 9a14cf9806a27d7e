"""Idle time made visible: busy intervals of every role, per-step idle (bubble) fractions, a Chrome trace and
a Gantt chart of phases per worker.

Every role records `Span`s (a phase of one worker on one accelerator, with wall-clock start and end) through a
`SpanRecorder`; the spans travel to the driver in a compact wire format of short names and numbers
(`to_wire` / `from_wire`), so no sample text can ride along. The driver then computes, per step and per
accelerator, the fraction of the step's window in which the accelerator did no work::

    idle(step, acc) = 1 - |union of busy spans on acc, clipped to window(step)| / |window(step)|

and writes ``timeline.json`` (open it in chrome://tracing or https://ui.perfetto.dev) and ``timeline.png``.

Times are epoch seconds (`time.time()`), so spans recorded in different processes and on different nodes line
up (to the accuracy of the nodes' clocks).
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_NAME_CHARS",
    "TRAINER_ROLE",
    "Span",
    "SpanRecorder",
    "accelerator_key",
    "busy_union",
    "chrome_trace",
    "from_wire",
    "idle_fractions",
    "idle_summary",
    "last_settled_step",
    "local_accelerator",
    "plot_gantt",
    "step_windows",
    "to_wire",
    "write_chrome_trace",
]

MAX_NAME_CHARS = 64
TRAINER_ROLE = "trainer"

WireSpan = tuple[str, str, str, str, int, float, float, bool]
"""(role, worker, accelerator, phase, step, start, end, busy): what crosses from a worker to the driver."""


@dataclass(frozen=True)
class Span:
    """One phase of one worker on one accelerator.

    ``role``: "trainer" | "genrm" | ...; ``worker``: e.g. "rank0", "genrm-1"; ``accelerator``: a key shared by
    every span on the same device (e.g. "node-abc/gpu:0", or "cpu:rank0" without one); ``phase``: "rollout",
    "logprobs", "train", "weight_sync", "offload", "wait_reward", "judge", "load", "release", ...; ``step``:
    the training step it belongs to; ``start`` / ``end``: epoch seconds; ``busy``: whether the device computes
    during the phase (waiting for rewards or for a collective is not busy).
    """

    role: str
    worker: str
    accelerator: str
    phase: str
    step: int
    start: float
    end: float
    busy: bool = True

    @property
    def duration(self) -> float:
        return self.end - self.start


# ---- the wire format ---------------------------------------------------------------------------------------
def _check_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS or not value.isprintable():
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(
            f"span {what} must be a printable name of 1 to {MAX_NAME_CHARS} characters, got {shown} "
            f"({type(value).__name__}); spans carry only short names and numbers, never sample text"
        )
    return value


def _check_time(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"span {what} must be a finite number of epoch seconds, got {value!r}")
    return float(value)


def _check_span(values: Sequence[Any]) -> Span:
    role, worker, accelerator, phase, step, start, end, busy = values
    role, worker = _check_name("role", role), _check_name("worker", worker)
    accelerator, phase = _check_name("accelerator", accelerator), _check_name("phase", phase)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise ValueError(f"span step must be an int, got {step!r} ({type(step).__name__})")
    if not isinstance(busy, numbers.Integral) or busy not in (0, 1):
        raise ValueError(f"span busy must be a bool, got {busy!r}")
    start_s, end_s = _check_time("start", start), _check_time("end", end)
    if end_s < start_s:
        raise ValueError(f"span {phase!r} ends before it starts: start={start_s}, end={end_s}")
    return Span(role, worker, accelerator, phase, int(step), start_s, end_s, bool(busy))


def to_wire(spans: Iterable[Span]) -> list[WireSpan]:
    """Spans as plain tuples ``(role, worker, accelerator, phase, step, start, end, busy)``, validated."""
    checked = [_check_span(_fields(s)) for s in spans]
    return [_fields(s) for s in checked]


def from_wire(rows: Iterable[Sequence[Any]]) -> list[Span]:
    """Validate wire tuples and build `Span`s; `ValueError` naming the bad field (a long or non-string name,
    a non-number, an end before the start, a tuple of the wrong length)."""
    spans = []
    for row in rows:
        if not isinstance(row, (tuple, list)) or len(row) != 8:
            shown = repr(row)[:80]
            raise ValueError(
                f"a wire span is a tuple (role, worker, accelerator, phase, step, start, end, busy); got "
                f"{shown} ({type(row).__name__}); build it with yatt_ray.metrics.timeline.to_wire"
            )
        spans.append(_check_span(row))
    return spans


def _fields(span: Span) -> WireSpan:
    return (span.role, span.worker, span.accelerator, span.phase, span.step, span.start, span.end, span.busy)


# ---- recording ---------------------------------------------------------------------------------------------
def accelerator_key(node_id: str, gpu_ids: Sequence[Any], worker: str) -> str:
    """``"node-<first 8 chars of node id>/gpu:<first GPU id>"``, or ``"cpu:<worker>"`` when no GPU is assigned
    (a CPU worker's cores are its own device)."""
    if gpu_ids:
        return f"node-{node_id[:8]}/gpu:{gpu_ids[0]}"
    return f"cpu:{worker}"


def local_accelerator(worker: str) -> str:
    """`accelerator_key` of this Ray worker process: two processes that share a GPU (full coexistence) get the
    same key. Call it inside a Ray task, actor or Ray Train worker."""
    import ray

    ctx = ray.get_runtime_context()
    return accelerator_key(ctx.get_node_id(), ray.get_gpu_ids(), worker)


class SpanRecorder:
    """Records this worker's spans; `drain` hands them over (to push to the MetricsHub).

    Usage::

        rec = SpanRecorder("trainer", "rank0", local_accelerator("rank0"))
        rec.step = 3                      # the step later spans belong to (or pass step= to span())
        with rec.span("rollout"):
            ...
        with rec.span("wait_reward", busy=False):
            ...
        hub.push_spans.remote(to_wire(rec.drain()))

    A span is recorded also when the body raises. ``clock`` (epoch seconds) defaults to `time.time`.
    """

    def __init__(self, role: str, worker: str, accelerator: str, clock: Callable[[], float] = time.time):
        self.role = _check_name("role", role)
        self.worker = _check_name("worker", worker)
        self.accelerator = _check_name("accelerator", accelerator)
        self.step = 0
        self._clock = clock
        self._spans: list[Span] = []

    @contextmanager
    def span(self, phase: str, step: int | None = None, busy: bool = True) -> Iterator[None]:
        """Record the body of the ``with`` block as ``phase`` of ``step`` (default: ``self.step``)."""
        _check_name("phase", phase)
        step = self.step if step is None else step
        start = self._clock()
        try:
            yield
        finally:
            fields = (self.role, self.worker, self.accelerator, phase, step, start, self._clock(), busy)
            self._spans.append(_check_span(fields))

    def drain(self) -> list[Span]:
        """The spans recorded since the last drain (oldest first); the recorder forgets them."""
        spans, self._spans = self._spans, []
        return spans


# ---- the mathematics ---------------------------------------------------------------------------------------
def busy_union(spans: Iterable[Span], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by the union of the busy spans::

        |  U_i [s_i, e_i]  intersected with [start, end] |     over spans i with busy_i

    Overlapping spans count once; non-busy spans count nothing. The caller picks the spans of one accelerator.
    Raises `ValueError` when ``end < start``.
    """
    if end < start:
        raise ValueError(f"window ends before it starts: start={start}, end={end}")
    clipped = sorted(
        (max(s.start, start), min(s.end, end)) for s in spans if s.busy and s.end > start and s.start < end
    )
    total, cur_start, cur_end = 0.0, None, None
    for a, b in clipped:
        if cur_end is None or a > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def step_windows(spans: Iterable[Span], role: str | None = TRAINER_ROLE) -> dict[int, tuple[float, float]]:
    """Each step's window: ``(min start, max end)`` over the spans of that step whose role is ``role``
    (the trainer: its workers run the step; GenRM spans do not stretch a step). ``role=None`` uses every span.

    The time between one step's last trainer span and the next step's first is in no window (it shows as a
    gap in the Gantt chart). Steps without a span of ``role`` get no window.
    """
    windows: dict[int, tuple[float, float]] = {}
    for s in spans:
        if role is not None and s.role != role:
            continue
        lo, hi = windows.get(s.step, (s.start, s.end))
        windows[s.step] = (min(lo, s.start), max(hi, s.end))
    return dict(sorted(windows.items()))


def idle_fractions(
    spans: Sequence[Span], windows: Mapping[int, tuple[float, float]]
) -> dict[int, dict[str, float]]:
    """Per step window and per accelerator, the fraction of the window the accelerator was idle::

        idle(step, acc) = 1 - busy_union(spans on acc, *windows[step]) / (end - start)

    Spans count by time, whatever step they are tagged with (a GenRM judgement running into the next step's
    window is busy there). Every accelerator that appears in ``spans`` is reported for every step: 1.0 when it
    had no busy span in that window. A window of zero length has no time to be idle in and reports 0.0.
    """
    by_acc: dict[str, list[Span]] = {}
    for s in spans:
        by_acc.setdefault(s.accelerator, []).append(s)
    out: dict[int, dict[str, float]] = {}
    for step, (start, end) in windows.items():
        length = end - start
        row = {}
        for acc in sorted(by_acc):
            busy = busy_union(by_acc[acc], start, end)
            row[acc] = min(1.0, max(0.0, 1.0 - busy / length)) if length > 0 else 0.0
        out[step] = row
    return out


def last_settled_step(spans: Iterable[Span], role: str = TRAINER_ROLE) -> int | None:
    """The last step whose window can no longer change: every worker of ``role`` seen so far has reported a
    span of a later step, i.e. ``min over workers of (max step of the worker) - 1``. None without such spans.
    """
    latest: dict[str, int] = {}
    for s in spans:
        if s.role == role:
            latest[s.worker] = max(latest.get(s.worker, s.step), s.step)
    return min(latest.values()) - 1 if latest else None


def idle_summary(fractions: Mapping[int, Mapping[str, float]], spans: Iterable[Span]) -> dict[str, float]:
    """Means over steps and accelerators: ``{"mean": ..., "max": ..., "<role>": ...}``.

    ``mean`` averages every (step, accelerator) fraction; ``max`` is the largest; a role's value averages the
    fractions of the accelerators that role has spans on (in full coexistence roles share accelerators, so
    they share the number). Empty when there are no fractions.
    """
    values = [f for row in fractions.values() for f in row.values()]
    if not values:
        return {}
    out = {"mean": sum(values) / len(values), "max": max(values)}
    roles: dict[str, set[str]] = {}
    for s in spans:
        roles.setdefault(s.role, set()).add(s.accelerator)
    for role, accs in sorted(roles.items()):
        mine = [f for row in fractions.values() for acc, f in row.items() if acc in accs]
        if mine:
            out[role] = sum(mine) / len(mine)
    return out


# ---- outputs -----------------------------------------------------------------------------------------------
def chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """The spans in Chrome's trace event format (chrome://tracing, https://ui.perfetto.dev).

    One "X" (complete) event per span: ``name`` = phase, ``cat`` = role, ``ts`` = (start - first start) * 1e6
    and ``dur`` = (end - start) * 1e6 in microseconds, ``pid`` = the accelerator's row (1, 2, ... in sorted
    order), ``tid`` = the worker's (1, 2, ...), ``args`` = {step, busy}. "M" metadata events name each pid
    after its accelerator and each tid after its worker. No spans -> no events.
    """
    events: list[dict[str, Any]] = []
    if not spans:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    t0 = min(s.start for s in spans)
    pids = {acc: i for i, acc in enumerate(sorted({s.accelerator for s in spans}), start=1)}
    tids = {w: i for i, w in enumerate(sorted({s.worker for s in spans}), start=1)}
    for acc, pid in pids.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": acc}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
    for acc, worker in sorted({(s.accelerator, s.worker) for s in spans}):
        pid, tid = pids[acc], tids[worker]
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": worker}})
    for s in sorted(spans, key=lambda s: s.start):
        events.append(
            {
                "name": s.phase,
                "cat": s.role,
                "ph": "X",
                "ts": round((s.start - t0) * 1e6, 3),
                "dur": round((s.end - s.start) * 1e6, 3),
                "pid": pids[s.accelerator],
                "tid": tids[s.worker],
                "args": {"step": s.step, "busy": s.busy},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, spans: Sequence[Span]) -> Path:
    """Write `chrome_trace` as JSON to ``path`` (parent folders created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(spans)), encoding="utf-8")
    return out


def read_chrome_trace(path: str | Path) -> list[Span]:
    """The spans of a trace `write_chrome_trace` wrote (times in seconds since its first span)."""
    events = json.loads(Path(path).read_text(encoding="utf-8"))["traceEvents"]
    names = {
        (e["name"], e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e["name"] in ("process_name", "thread_name")
    }
    return [
        Span(
            e["cat"], names[("thread_name", e["pid"], e["tid"])], names[("process_name", e["pid"], None)],
            e["name"], int(e["args"]["step"]), e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, bool(e["args"]["busy"]),
        )
        for e in events
        if e["ph"] == "X"
    ]  # fmt: skip


def plot_gantt(spans: Sequence[Span], path: str | Path, title: str | None = None) -> Path:
    """A Gantt chart of phases: one row per (accelerator, worker), one colour per phase (legend), seconds
    since the first span on the x axis. Non-busy spans are hatched and pale; idle gaps stay white; dotted
    lines mark where each step's window starts. The title gives the mean idle fraction over steps and
    accelerators (`idle_summary`). Raises `ValueError` when there are no spans. Returns the path written.

    Uses matplotlib's Agg renderer through a standalone `Figure` (no display, no global backend change).
    """
    if not spans:
        raise ValueError(f"no spans: nothing to plot to {str(path)!r}; record spans with SpanRecorder first")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    t0 = min(s.start for s in spans)
    rows = sorted({(s.accelerator, s.worker) for s in spans})
    phases = sorted({s.phase for s in spans})
    colours = _colours(phases)
    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}  # (row, phase, busy) -> (x, width)
    row_of = {key: y for y, key in enumerate(rows)}
    for s in spans:
        bars.setdefault((row_of[s.accelerator, s.worker], s.phase, s.busy), []).append(
            (s.start - t0, s.duration)
        )
    fig = Figure(figsize=(11, 1.2 + 0.45 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for (y, phase, busy), ranges in bars.items():
        ax.broken_barh(
            ranges,
            (y - 0.4, 0.8),
            facecolors=colours[phase],
            alpha=1.0 if busy else 0.35,
            hatch=None if busy else "//",
            edgecolor="black",
            linewidth=0.2,
        )
    windows = step_windows(spans)
    for start, _ in windows.values():
        ax.axvline(start - t0, color="grey", linestyle=":", linewidth=0.6)
    ax.set_yticks(range(len(rows)), [f"{acc}  {worker}" for acc, worker in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("seconds since the first span")
    ax.legend(
        handles=[Patch(facecolor=colours[p], label=p) for p in phases],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
    )
    summary = idle_summary(idle_fractions(spans, windows), spans)
    idle = f"idle {summary['mean']:.1%} (mean over steps and accelerators)" if summary else "no trainer steps"
    fig.suptitle(f"{title + ': ' if title else ''}{idle} (hatched: waiting)")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def _colours(phases: Sequence[str]) -> dict[str, Any]:
    """A distinct colour per phase (tab10, or tab20 beyond ten phases, cycling after twenty)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(phases) <= 10 else "tab20"]
    return {p: cmap(i % cmap.N) for i, p in enumerate(phases)}
