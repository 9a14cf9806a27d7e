"""The driver's view of a run: a progress bar, metric files and the closing report.

It reads rows of scalars from the MetricsHub actor and writes them to metrics.jsonl and TensorBoard under
the output folder, and to MLflow / W&B when `output.mlflow` / `output.wandb` are on
(`metrics.sinks.build_sinks`); at the end it draws reward and accuracy against step (reward.png) and prints
the start/end comparison.

It also reads the spans of the idle-time timeline. Once a step is settled (every trainer worker has reported
spans of a later step, `timeline.last_settled_step`) its idle fractions are computed and a row
``{"step", "idle/mean", "idle/max"}`` joins the history and the sinks (a separate row: rows with
``reward_mean`` stay the training steps); steps still open at `close` are settled then. `close` writes
timeline.json (Chrome trace), timeline.png (Gantt chart) and idle.jsonl (per step: the mean, the max and each
accelerator's fraction as ``idle/<accelerator>``). Without spans none of this is written.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from yatt_ray.config import Config
from yatt_ray.metrics import timeline
from yatt_ray.metrics.history import MetricRow, OneCurve
from yatt_ray.metrics.startup import Startup, report_line, write_startup

REPORT_KEYS = ("reward_mean", "accuracy", "eval/reward_mean", "eval/accuracy")


class DriverProgress:
    def __init__(self, hub, config: Config, output_dir: Path, startup: Startup | None = None) -> None:
        from yatt_ray.metrics.sinks import MultiSink, build_sinks

        self.hub, self.config, self.output_dir = hub, config, output_dir
        self.startup = startup  # the driver's start-up marks; the workers' come from the hub at `close`
        self.curve = OneCurve()  # one curve as rows arrive: a restart's redone steps replace their old rows
        self.spans: list[timeline.Span] = []
        self.idle: dict[int, dict[str, float]] = {}  # step -> accelerator -> idle fraction, settled steps
        self._rows_seen = 0
        self.sink = MultiSink(build_sinks(config, output_dir))  # metrics.jsonl, TensorBoard, MLflow, W&B
        self.bar = None
        if config.output.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=config.train.steps, desc=config.algo.name, unit="step", dynamic_ncols=True)

    def poll(self) -> None:
        """Fetch rows and spans pushed since the last poll (a timeout keeps a dead cluster from hanging the
        driver)."""
        import ray

        refs = [self.hub.rows_since.remote(self._rows_seen), self.hub.spans_since.remote(len(self.spans))]
        rows, spans = ray.get(refs, timeout=self.config.cluster.timeout_s)
        self.receive(rows, spans)

    def receive(self, rows: Sequence[MetricRow], wire_spans: Sequence[Sequence[Any]] = ()) -> None:
        """Take new metric rows and wire spans (what `poll` fetched): sinks, bar, idle of settled steps."""
        self._rows_seen += len(rows)
        for row in rows:
            self._record(row)
            if self.bar is not None and row.kind == "train":
                v = row.values
                self.bar.update(1)
                self.bar.set_postfix(reward=f"{v['reward_mean']:.3f}", acc=f"{v['accuracy']:.3f}")
        if wire_spans:
            self.spans.extend(timeline.from_wire(wire_spans))
            self._settle(timeline.last_settled_step(self.spans))

    @property
    def history(self) -> list[dict[str, float]]:
        """The curve's rows as plain dicts (what `Result.history` holds)."""
        return [r.values for r in self.curve.rows]

    def _record(self, row: MetricRow) -> None:
        if self.curve.add(row):  # steps redone after a restart: the file keeps one curve too
            self.sink.rewind([r.values for r in self.curve.rows[:-1]])
        self.sink.write(int(row.step), {k: v for k, v in row.values.items() if k != "step"})

    def _settle(self, up_to: int | None) -> None:
        """Compute and record the idle fractions of the steps up to ``up_to`` (None: all) not yet settled."""
        windows = {
            step: window
            for step, window in timeline.step_windows(self.spans).items()
            if step not in self.idle and (up_to is None or step <= up_to)
        }
        for step, fractions in timeline.idle_fractions(self.spans, windows).items():
            self.idle[step] = fractions
            self._record(MetricRow("idle", {"step": float(step), **idle_stats(fractions)}))

    def close(self) -> None:
        self._settle(None)
        if self.bar is not None:
            self.bar.close()
        self.sink.close()
        if self.config.output.plot and any("reward_mean" in r for r in self.history):
            from yatt_ray.metrics.plot import plot_history

            train_rows = [r for r in self.history if "reward_mean" in r]
            plot_history(train_rows, self.output_dir / "reward.png", keys=("reward_mean", "accuracy"))
        self._write_timeline()
        self._write_startup()
        print(self.report(), flush=True)

    def _write_startup(self) -> None:
        """Merge the workers' start-up marks into the driver's and write startup.json."""
        if self.startup is None:
            return
        if self.hub is not None:
            import ray

            for stage, at in ray.get(self.hub.marks.remote(), timeout=self.config.cluster.timeout_s).items():
                self.startup.mark(stage, at)
        write_startup(self.output_dir / "startup.json", self.startup.marks, self.startup.origin)

    def _write_timeline(self) -> None:
        if not self.spans:
            return
        timeline.write_chrome_trace(self.output_dir / "timeline.json", self.spans)
        if self.config.output.plot:
            timeline.plot_gantt(self.spans, self.output_dir / "timeline.png")
        with (self.output_dir / "idle.jsonl").open("w", encoding="utf-8") as f:
            for step, fractions in sorted(self.idle.items()):
                per_acc = {f"idle/{acc}": v for acc, v in fractions.items()}
                f.write(json.dumps({"step": step, **idle_stats(fractions), **per_acc}) + "\n")

    def report(self) -> str:
        """Start vs end of RL: training reward and accuracy as means of the first and last 10 steps (single
        steps are noisy), and the eval set's greedy scores before and after training when one is given; then
        throughput and MFU (`perf_report_lines`), and the mean idle fraction over steps and accelerators, and
        per role, when spans were recorded."""
        lines = [f"results in {self.output_dir}"]
        for key in REPORT_KEYS:
            values = [r[key] for r in self.history if key in r]
            if not values:
                continue
            if key.startswith("eval/"):
                lines.append(f"  {key:<18} before RL {values[0]:.3f} -> after RL {values[-1]:.3f}")
            else:
                k = min(10, len(values))
                first, last = sum(values[:k]) / k, sum(values[-k:]) / k
                lines.append(f"  {key:<18} first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
        lines += perf_report_lines([r for r in self.history if "reward_mean" in r])
        startup = report_line(self.startup.marks, self.startup.origin) if self.startup is not None else ""
        if startup:
            lines.append(startup)
        idle = idle_report_line(self.idle, self.spans)
        if idle:
            lines.append(idle)
        return "\n".join(lines)


def idle_stats(fractions: dict[str, float]) -> dict[str, float]:
    """``{"idle/mean": mean, "idle/max": max}`` over the accelerators of one step's fractions."""
    values = list(fractions.values())
    if not values:
        return {}
    return {"idle/mean": sum(values) / len(values), "idle/max": max(values)}


def idle_report_line(idle: dict[int, dict[str, float]], spans: Sequence[timeline.Span]) -> str:
    """One line: ``idle (bubble) 42.0% over 80 steps x 3 accelerators (genrm 60.0%, trainer 35.0%)``; empty
    when nothing was measured."""
    summary = timeline.idle_summary(idle, spans)
    if not summary:
        return ""
    accs = len({acc for row in idle.values() for acc in row})
    roles = ", ".join(f"{k} {v:.1%}" for k, v in summary.items() if k not in ("mean", "max"))
    head = f"  {'idle (bubble)':<18} {summary['mean']:.1%}"
    return f"{head} over {len(idle)} steps x {accs} accelerators ({roles})"


def perf_report_lines(train_rows: Sequence[dict[str, float]]) -> list[str]:
    """Medians over the training steps (the first left out when there are more: it pays the cold start) of
    throughput and, when reported, each phase's achieved FLOP/s per accelerator beside the peak and the MFU:

        throughput         response 131.0 tok/s, total 512.0 tok/s (65.5, 256.0 per worker), steps 2-25
        train              5.20 GFLOP/s per accelerator of 41.5 GFLOP/s peak: MFU 12.5%
    """
    rows = list(train_rows[1:] if len(train_rows) > 1 else train_rows)
    if not rows or "response_tokens_per_s" not in rows[0]:
        return []

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows if key in r)

    span = (
        f"step {int(rows[0]['step'])}"
        if len(rows) == 1
        else f"steps {int(rows[0]['step'])}-{int(rows[-1]['step'])}"
    )
    lines = [
        f"  {'throughput':<18} response {med('response_tokens_per_s'):.1f} tok/s, total {med('total_tokens_per_s'):.1f} "
        f"tok/s ({med('response_tokens_per_s_per_worker'):.1f}, {med('total_tokens_per_s_per_worker'):.1f} per "
        f"worker), median of {span}"
    ]
    for phase in ("rollout", "train"):
        key = f"perf/{phase}_flops_per_s"
        if not any(key in r for r in rows):
            continue
        line = f"  {phase:<18} {flops_text(med(key))} per accelerator"
        if any("perf/peak_flops" in r for r in rows):
            line += f" of {flops_text(med('perf/peak_flops'))} peak: MFU {med(f'perf/mfu_{phase}'):.1%}"
        lines.append(line)
    return lines


def flops_text(value: float) -> str:
    """FLOP/s with an SI prefix: 5.2e9 -> "5.20 GFLOP/s"."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.2f} {prefix}FLOP/s"
    return f"{value:.0f} FLOP/s"
