"""Seconds from the command to the first RL step, by stage, as a user runs the demo.

    python release/bench_startup.py                    # examples/grpo.py, 3 steps, 4 runs (the first warms caches)
    python release/bench_startup.py --runs 1 train.dp_size=1

Each run is `python examples/grpo.py train.steps=3 ...` in a fresh process, timed from its start (the
driver's process start: imports included) by the stage marks the library writes to `startup.json`
(`yatt_ray/metrics/startup.py`). The first run of a fresh machine builds and warms up the demo model; the
figures are from the runs after it (a warm machine: packages installed, demo model cached). On a shared
2-core VM one run's start-up varies by +-5 s, so the table is that of the median run after the first
(every run's total is printed). Prints the stage table, then one line:

    startup: first_step_s=<command -> end of step 1> step1_over_step3=<time/step of step 1 / of step 3>

`--floor N` also times, N times on a local cluster of this process, a Ray Train run that does nothing with as
many workers as the measured runs train with (train.dp_size x train.tp_size after the overrides; the demo's
two), configured as `fit()` configures its own (the health-check interval, no preemption watcher): the part of the `worker_started` stage that is Ray Train's (a controller, two worker processes that
import Ray Train and torch and join a process group, each a fresh process every run), and what ending a run
costs. It prints `ray_train_floor: entered_s=<median> fit_s=<median> workers=<n>` before the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from yatt_ray.metrics.startup import first_step_seconds, format_table  # noqa: E402


def one_run(out: Path, overrides: list[str]) -> tuple[dict[str, float], list[dict]]:
    """Run the demo in a fresh process; (start-up marks, train rows of metrics.jsonl)."""
    command = [sys.executable, str(REPO / "examples" / "grpo.py"), "train.steps=3", f"output.dir={out}",
               "output.progress=false", *overrides]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO, env=os.environ.copy())
    run_dir = max(p for p in out.iterdir() if p.is_dir())
    marks = json.loads((run_dir / "startup.json").read_text())["marks"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return marks, [r for r in rows if "time/step" in r]


def _noop_train(config: dict) -> None:
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        Path(config["path"]).write_text(str(time.time()))


def training_workers(overrides: list[str]) -> int:
    """The demo's training workers under these overrides: train.dp_size x train.tp_size."""
    from yatt_ray import load_config

    config = load_config(REPO / "examples" / "configs" / "grpo.yaml", [o for o in overrides if "=" in o])
    return config.train.dp_size * config.train.tp_size


def ray_train_floor(runs: int, workers: int) -> tuple[float, float]:
    """Median seconds from `TorchTrainer.fit()` to rank 0 entering a train function that does nothing, and
    of the whole `fit()`, over `runs` runs on a local cluster."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from yatt_ray.console import LOCAL_QUIET_ENV
    from yatt_ray.fit import TRAIN_POLL_S

    os.environ.update(LOCAL_QUIET_ENV)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(TRAIN_POLL_S))
    ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    entered, total = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            mark = Path(tmp) / f"entered{i}"
            start = time.time()
            TorchTrainer(
                _noop_train,
                train_loop_config={"path": str(mark)},
                scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(storage_path=tmp, name=f"floor{i}"),
            ).fit()
            total.append(time.time() - start)
            entered.append(float(mark.read_text()) - start)
            print(
                f"no-op Ray Train run {i + 1}: entered {entered[-1]:.1f} s, fit() {total[-1]:.1f} s",
                flush=True,
            )
    ray.shutdown()
    return statistics.median(entered), statistics.median(total)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", type=int, default=4, help="runs in a row; the median after the first is reported"
    )
    parser.add_argument(
        "--floor", type=int, default=0, help="also time this many no-op Ray Train runs (see above)"
    )
    args, overrides = parser.parse_known_args()
    if args.runs < 1 or args.floor < 0:
        parser.error(
            f"--runs {args.runs} --floor {args.floor}: give --runs >= 1 (the table is a run's), --floor >= 0"
        )
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            marks, rows = one_run(Path(tmp) / f"run{i}", overrides)
            runs.append((first_step_seconds(marks), marks, rows))
            print(f"run {i + 1}: command -> end of step 1 {runs[-1][0]:.1f} s", flush=True)
    warm = sorted(runs[1:] or runs, key=lambda run: run[0])
    _, marks, rows = warm[(len(warm) - 1) // 2]
    print(f"the median of {len(warm)} warm run(s):")
    print(format_table(marks))
    by_step = {int(r["step"]): r["time/step"] for r in rows}
    ratio = by_step[1] / by_step[3] if 1 in by_step and 3 in by_step else float("nan")
    for r in rows:  # where each of the first steps goes
        phases = ("rollout", "reward", "logprobs", "train", "weight_sync", "orchestration")
        parts = ", ".join(f"{p} {r[f'time/{p}']:.2f}" for p in phases if f"time/{p}" in r)
        print(f"step {int(r['step'])}: {r['time/step']:.2f} s ({parts})")
    if args.floor:
        workers = training_workers(overrides)
        entered, total = ray_train_floor(args.floor, workers)
        print(f"ray_train_floor: entered_s={entered:.1f} fit_s={total:.1f} workers={workers}")
    print(f"startup: first_step_s={first_step_seconds(marks):.1f} step1_over_step3={ratio:.2f}")


if __name__ == "__main__":
    main()
