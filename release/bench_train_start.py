"""What a Ray Train start costs before the training function runs, with nothing of yatt_ray in it.

    python release/bench_train_start.py                # 3 timed starts after a warm-up one, 2 workers
    python release/bench_train_start.py --workers 4    # another size

A `TorchTrainer` of `--workers` workers (default 2, 1 CPU each, gloo) whose training function does nothing, on a local cluster of
8 logical CPUs: each start is timed to the moment rank 0 enters the function and to `fit()`'s return, the
CPU-seconds the whole machine spent meanwhile are read from /proc/stat, and, for the last start, the CPU-seconds
of each process (sampled every 0.1 s from /proc/<pid>/stat, so processes that exit are counted too) show where
they go: the Ray Train controller, the two workers, and the helper actors Ray Train 2.60 starts for every run
(placement-group cleaner, synchronization actor, dataset manager), each a Python process of its own. Every
`yatt_ray.fit()` pays this before its own start-up (`startup.json`); the test suite pays it once per run.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")  # as fit() on a local cluster

import ray  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU-seconds the machine has spent (all cores, not idle or waiting on I/O) since boot."""
    fields = list(map(int, Path("/proc/stat").read_text().splitlines()[0].split()[1:]))
    return (sum(fields) - fields[3] - fields[4]) / HZ


class ProcessSampler:
    """CPU-seconds per process title over a window, sampled often enough to see short-lived processes."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                    title = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
                except OSError:
                    continue
                fields = stat[stat.rfind(")") + 2 :].split()
                cpu = (int(fields[11]) + int(fields[12])) / HZ
                self.first.setdefault(int(pid), cpu)
                self.last[int(pid)] = (title or self.last.get(int(pid), ("?", 0.0))[0], cpu)
            time.sleep(0.1)

    def __enter__(self) -> ProcessSampler:
        self._thread.start()
        time.sleep(0.3)  # the processes already running get their starting values
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def by_title(self) -> list[tuple[float, str]]:
        rows = [(cpu - self.first[pid], title.split()[0][:60]) for pid, (title, cpu) in self.last.items()]
        return sorted((r for r in rows if r[0] >= 0.05), reverse=True)


def noop(config: dict) -> None:
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        Path(config["entered"]).write_text(str(time.time()))


def start_once(storage: str, name: str, workers: int) -> tuple[float, float, float]:
    """(seconds to the function's start, seconds to fit()'s return, machine CPU-seconds meanwhile)."""
    entered = Path(storage) / f"{name}.entered"
    started, cpu = time.time(), busy_seconds()
    TorchTrainer(
        noop,
        train_loop_config={"entered": str(entered)},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=storage, name=name),
    ).fit()
    return float(entered.read_text()) - started, time.time() - started, busy_seconds() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="training workers (1 logical CPU each, of 8)")
    workers = parser.parse_args().workers
    print(f"CPU: {os.cpu_count()} cores; {workers} workers; load average before: {os.getloadavg()[0]:.2f}")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        start_once(storage, "warm-up", workers)  # the first start imports what later ones find loaded
        for k in range(3):
            if k == 2:
                with ProcessSampler() as sampler:
                    entered, total, cpu = start_once(storage, f"run{k}", workers)
            else:
                entered, total, cpu = start_once(storage, f"run{k}", workers)
            print(f"start {k + 1}: function entered after {entered:.1f} s, fit() returned after {total:.1f} s, "
                  f"machine CPU {cpu:.1f} s")  # fmt: skip
    ray.shutdown()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("CPU-seconds by process in the last start:")
    for seconds, title in sampler.by_title()[:12]:
        print(f"  {seconds:5.2f}  {title}")


if __name__ == "__main__":
    main()
