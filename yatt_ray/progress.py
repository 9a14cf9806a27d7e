"""The driver's view of a run: a progress bar, metric files and the closing report.

It reads rows of scalars from the MetricsHub actor and writes them to metrics.jsonl and TensorBoard under
the output folder; at the end it draws reward and accuracy against step (reward.png) and prints the
start/end comparison.
"""

from __future__ import annotations

from pathlib import Path

from yatt_ray.config import Config

REPORT_KEYS = ("reward_mean", "accuracy", "eval/reward_mean", "eval/accuracy")


class DriverProgress:
    def __init__(self, hub, config: Config, output_dir: Path) -> None:
        from yatt_ray.metrics.sinks import JsonlSink, MultiSink, Sink, TensorBoardSink

        self.hub, self.config, self.output_dir = hub, config, output_dir
        self.history: list[dict[str, float]] = []
        sinks: list[Sink] = [JsonlSink(output_dir / "metrics.jsonl")]
        if config.output.tensorboard:
            sinks.append(TensorBoardSink(output_dir / "tensorboard"))
        self.sink = MultiSink(sinks)
        self.bar = None
        if config.output.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=config.train.steps, desc="grpo", unit="step", dynamic_ncols=True)

    def poll(self) -> None:
        """Fetch rows pushed since the last poll (a timeout keeps a dead cluster from hanging the driver)."""
        import ray

        rows = ray.get(self.hub.rows_since.remote(len(self.history)), timeout=self.config.cluster.timeout_s)
        for row in rows:
            self.history.append(row)
            step = int(row.get("step", 0))
            self.sink.write(step, {k: v for k, v in row.items() if k != "step"})
            if self.bar is not None and "reward_mean" in row:
                self.bar.update(1)
                self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.sink.close()
        if self.config.output.plot and any("reward_mean" in r for r in self.history):
            from yatt_ray.metrics.plot import plot_history

            train_rows = [r for r in self.history if "reward_mean" in r]
            plot_history(train_rows, self.output_dir / "reward.png", keys=("reward_mean", "accuracy"))
        print(self.report(), flush=True)

    def report(self) -> str:
        """Start vs end of RL: training reward and accuracy as means of the first and last 10 steps (single
        steps are noisy), and the eval set's greedy scores before and after training when one is given."""
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
        return "\n".join(lines)
