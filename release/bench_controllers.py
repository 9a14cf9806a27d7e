"""Parallel controllers against a single-controller driver, on a multimodal run whose image bytes grow ~100x.

    python release/bench_controllers.py                        # 32, 104, 336 px; 512 rows; 3 steps a run
    python release/bench_controllers.py --sizes 32,64,128,336 --rows 256 --steps 4 --out runs/bench_controllers

The same `yatt_ray.fit` run of examples/configs/grpo_vision.yaml (the demo's tiny LLaVA, built once into the
demo cache by `prepare_demo`; GRPO, 32 prompts x 8 samples a step, train.dp_size=2, no checkpoints, no eval)
in two modes, at each point of a sweep over the image size:
  - parallel (yatt_ray's way): Ray Data tasks read the parquet file and decode and process the images; each
    group's controller streams its own share; the driver reads only the files' metadata (and the id column);
  - single (the baseline of single-controller frameworks, built here: `driver_dataset`, swapped in for the
    library's `build_dataset` during those runs): the driver reads every row, images included, decodes and
    processes them in its own process and hands the rows to Ray as driver-owned blocks, which the workers
    then pull.
Data per point: `visual.make_problems(--rows, seed 0, image_size=S, noise=64)` (one image of "a+b" a prompt;
the noise keeps PNG from compressing, so the bytes grow with the area), written by `visual.write_rows` to
<out>/data/visual_<S>px.parquet in a child process (so this driver never holds the image bytes before the runs).
Image bytes per step = 32 prompts x the mean PNG bytes of a row, measured from the written rows: ~99x from 32
to 336 px (2.4 KB -> 243 KB a row; the largest file ~125 MB at 512 rows). The tiny model's CLIP image
processor resizes every image to 32x32, so the pixels each controller trains on, and so the compute, stay
the same at every point: only the bytes that must be read and decoded grow.

One local Ray cluster for the whole bench (`yatt_ray.cluster.connect`, as fit() starts it; fit() then joins
it), so cluster start-up is in no run. Before the sweep, one unmeasured warm-up run per mode (--warmup-steps,
at the smallest size): the imports the first fit() makes in the driver (Ray Train, Ray Data, the baseline's
CLIP processor) and Ray's worker pools are in no measured run. The points then run in ascending size with
the modes alternating first (parallel, single | single, parallel | ...): neither mode always runs after the
other's leftovers. Both modes read a file that its writer has just put in the page cache. Before each run the
driver collects garbage and hands freed heap back to the OS (`malloc_trim`, pyarrow's pool), so memory
that a previous run freed but kept cannot hide the next run's growth.

Measured (psutil, a sampling thread at 20 Hz during each fit): the driver's RSS (driver growth = its peak
during the run minus its RSS just before; also the kernel's own peak, VmHWM, reset before each run, as a check
on the sampling), the peak RSS of each Ray Train worker process (process title containing "RayTrainWorker";
the max over the workers is reported), and the step time (median `time/step` of result.history over steps
2..--steps).
Figures:
  - parallel_driver_growth_mb = the parallel run's driver growth at the largest point minus at the smallest
    (how much more the driver needs as the bytes grow ~100x); each point's growth is in the table;
  - single_driver_growth_mb = the same for the baseline;
  - bytes_growth = image bytes per step at the largest point / at the smallest.
Writes <out>/bench_controllers.png (driver growth and worker peak RSS against image bytes per step, both
modes), prints a table and the load averages, and ends with the line
    controllers: parallel_driver_growth_mb=<x> single_driver_growth_mb=<y> bytes_growth=<z>
Target: parallel_driver_growth_mb < 50 while the baseline's growth follows the bytes.
About 9 minutes on 2 CPU cores. Run it on an idle machine (`uptime`): two cores are easily shared by a stray job.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import gc
import multiprocessing
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import yatt_ray

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "configs" / "grpo_vision.yaml"
DP = 2
PROMPTS_PER_STEP = 32
NOISE = 64
MODES = ("parallel", "single")
MB = 2**20


@dataclass
class Point:
    """One sweep point's data file and its measured image bytes."""

    size: int
    path: str
    rows: int
    image_bytes: int  # PNG bytes of all the file's images
    file_bytes: int

    @property
    def bytes_per_step(self) -> float:
        return PROMPTS_PER_STEP * self.image_bytes / self.rows


@dataclass
class Run:
    mode: str
    point: Point
    driver_before: int
    driver_peak: int
    driver_hwm: int | None  # the kernel's peak RSS of the driver during the run (VmHWM), when readable
    worker_peak: int
    history: list[dict] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def growth_mb(self) -> float:
        return (self.driver_peak - self.driver_before) / MB

    def step_s(self) -> float:
        values = [r["time/step"] for r in self.history if "time/step" in r and r["step"] >= 2]
        return statistics.median(values) if values else float("nan")


# ---- data --------------------------------------------------------------------------------------------------
def write_point(size: int, rows: int, path: str) -> tuple[int, int]:
    """The rows of one point, rendered and written (runs in a child process): (image bytes, file bytes)."""
    from yatt_ray.tasks import visual

    problems = visual.make_problems(rows, 0, image_size=size, noise=NOISE)
    image_bytes = sum(len(image["bytes"]) for row in problems for image in row["images"])
    visual.write_rows(problems, path)
    return image_bytes, os.path.getsize(path)


def write_data(out: Path, sizes: list[int], rows: int) -> list[Point]:
    """Every point's file, written in child processes: this process never holds the image bytes."""
    (out / "data").mkdir(parents=True, exist_ok=True)
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=spawn) as pool:
        paths = [str(out / "data" / f"visual_{s}px.parquet") for s in sizes]
        jobs = [pool.submit(write_point, s, rows, path) for s, path in zip(sizes, paths)]
        return [Point(s, path, rows, *job.result()) for s, path, job in zip(sizes, paths, jobs)]


# ---- measurement -------------------------------------------------------------------------------------------
def train_worker_pids() -> set[int]:
    """Processes whose title names Ray Train's worker actor ('ray::RayTrainWorker...')."""
    pids = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "RayTrainWorker" in " ".join(proc.info["cmdline"] or []):
            pids.add(proc.info["pid"])
    return pids


class PeakRss(threading.Thread):
    """Peak RSS of this process (the driver) and of each Ray Train worker started after `exclude` was taken,
    sampled every `period` s; the workers are looked up again every `rescan` samples."""

    def __init__(self, exclude: set[int], period: float = 0.05, rescan: int = 10) -> None:
        super().__init__(daemon=True)
        self.exclude, self.period, self.rescan = exclude, period, rescan
        self.driver = psutil.Process()
        self.driver_peak = self.driver.memory_info().rss
        self.worker_peaks: dict[int, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        workers: dict[int, psutil.Process] = {}
        tick = 0
        while not self._halt.is_set():
            self.driver_peak = max(self.driver_peak, self.driver.memory_info().rss)
            if tick % self.rescan == 0:
                for pid in train_worker_pids() - self.exclude - set(workers):
                    try:
                        workers[pid] = psutil.Process(pid)
                    except psutil.Error:
                        continue
            for pid, proc in list(workers.items()):
                try:
                    rss = proc.memory_info().rss
                except psutil.Error:  # the run ended and its workers with it
                    del workers[pid]
                    continue
                self.worker_peaks[pid] = max(self.worker_peaks.get(pid, 0), rss)
            tick += 1
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.driver_peak = max(self.driver_peak, self.driver.memory_info().rss)


def release_freed_memory() -> None:
    """Collect garbage and return freed heap to the OS (glibc's malloc_trim, pyarrow's memory pool)."""
    gc.collect()
    with contextlib.suppress(ImportError, AttributeError):
        import pyarrow

        pyarrow.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: /proc/self/clear_refs, value 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def read_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# ---- the single-controller baseline ------------------------------------------------------------------------
def driver_dataset(data, files: list[str], pixels=None):
    """What a single-controller framework does with the data: the driver reads every row of `files` (images
    included) into its own memory, decodes and processes the images there (the library's own functions, so
    the rows are the same), and hands the rows to Ray as driver-owned blocks (`ray.data.from_items`), from
    which the workers' streams then pull. Same signature and columns as `yatt_ray.data.build_dataset`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from yatt_ray.data.images import decode_images_batch
    from yatt_ray.data.sources import canonical_columns

    table = pa.concat_tables([pq.read_table(f) for f in files])
    batch = canonical_columns(data, images=pixels is not None)(table.to_pydict())
    if pixels is not None:
        batch = decode_images_batch(batch, "images", pixels, data.on_bad_image)
    ds = ray.data.from_items([{k: v[i] for k, v in batch.items()} for i in range(len(batch["prompt"]))])
    return ds.random_shuffle(seed=data.shuffle_seed) if data.shuffle_seed is not None else ds


@contextlib.contextmanager
def single_controller():
    """fit() builds its datasets with `driver_dataset` inside this block (it imports `build_dataset` from
    `yatt_ray.data` when it starts the trainer)."""
    import yatt_ray.data

    library = yatt_ray.data.build_dataset
    yatt_ray.data.build_dataset = driver_dataset
    try:
        yield
    finally:
        yatt_ray.data.build_dataset = library


# ---- runs --------------------------------------------------------------------------------------------------
def overrides(mode: str, point: Point, model: str, steps: int, out: Path) -> list[str]:
    return [
        f"model.path={model}", f"data.train_files=[{point.path}]", "data.eval_files=[]",
        f"train.steps={steps}", f"train.prompts_per_step={PROMPTS_PER_STEP}",
        f"train.dp_size={DP}", "checkpoint.enable=false", f"output.dir={out / f'{mode}_{point.size}px'}",
        "output.progress=false", "output.plot=false", "output.tensorboard=false",
    ]  # fmt: skip


def measured_fit(mode: str, point: Point, model: str, steps: int, out: Path) -> Run:
    """One fit() with the driver's and the workers' RSS sampled throughout."""
    cfg = yatt_ray.load_config(CONFIG, overrides(mode, point, model, steps, out))
    print(f"\n== {mode}, {point.size} px, {steps} steps", flush=True)
    release_freed_memory()
    sampler = PeakRss(exclude=train_worker_pids())
    hwm = reset_hwm()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    sampler.start()
    try:
        with single_controller() if mode == "single" else contextlib.nullcontext():
            result = yatt_ray.fit(cfg)
    finally:
        sampler.stop()
    run = Run(
        mode, point, before, sampler.driver_peak, read_hwm() if hwm else None,
        max(sampler.worker_peaks.values(), default=0), result.history, time.perf_counter() - start,
    )  # fmt: skip
    print(
        f"   driver {before / MB:.0f} MB -> peak {run.driver_peak / MB:.0f} MB (growth {run.growth_mb:.1f} MB"
        + (f"; kernel peak {run.driver_hwm / MB:.0f} MB" if run.driver_hwm else "")
        + f"), {len(sampler.worker_peaks)} workers, peak {run.worker_peak / MB:.0f} MB, "
        f"step {run.step_s():.2f} s, run {run.wall_s:.0f} s",
        flush=True,
    )
    return run


def start_cluster(model: str, point: Point, out: Path) -> None:
    """The local cluster fit() would start for these runs (fit() joins a running one)."""
    from yatt_ray.cluster import connect

    connect(yatt_ray.load_config(CONFIG, overrides("parallel", point, model, 1, out)))


# ---- report ------------------------------------------------------------------------------------------------
def table(runs: list[Run]) -> str:
    lines = [
        "| mode | image px | image bytes/step | driver growth MB | driver peak MB | kernel peak MB | "
        "worker peak MB | step s |",
        "|---" * 8 + "|",
    ]
    for r in sorted(runs, key=lambda r: (r.mode != "parallel", r.point.size)):
        hwm = f"{r.driver_hwm / MB:.0f}" if r.driver_hwm else "-"
        lines.append(
            f"| {r.mode} | {r.point.size} | {r.point.bytes_per_step / 1e6:.2f} MB | {r.growth_mb:.1f} | "
            f"{r.driver_peak / MB:.0f} | {hwm} | {r.worker_peak / MB:.0f} | {r.step_s():.2f} |"
        )
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> Path:
    """Driver growth and worker peak RSS against image bytes per step, one line per mode (matplotlib's Agg
    renderer through a standalone Figure, as yatt_ray.metrics.plot does)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), layout="constrained")
    FigureCanvasAgg(fig)
    growth, workers = fig.subplots(1, 2)
    for mode, label in (
        ("parallel", "parallel controllers (Ray Data reads)"),
        ("single", "single controller (the driver reads)"),
    ):
        mine = sorted((r for r in runs if r.mode == mode), key=lambda r: r.point.size)
        x = [r.point.bytes_per_step / 1e6 for r in mine]
        growth.plot(x, [r.growth_mb for r in mine], marker="o", label=label)
        workers.plot(x, [r.worker_peak / MB for r in mine], marker="o", label=label)
        for r in mine:
            growth.annotate(f"{r.point.size}px", (r.point.bytes_per_step / 1e6, r.growth_mb), fontsize=7)
    for ax, ylabel in ((growth, "driver RSS growth in the run (MB)"), (workers, "max worker peak RSS (MB)")):
        ax.set_xscale("log")
        ax.set_xlabel("image bytes per step (MB, PNG)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"driver and worker memory as the image bytes grow ({PROMPTS_PER_STEP} prompts a step)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/bench_controllers")
    parser.add_argument("--rows", type=int, default=512, help="rows of each point's data file")
    parser.add_argument("--steps", type=int, default=3, help="steps of each measured run")
    parser.add_argument("--sizes", default="32,104,336", help="image sides in px, comma-separated, ascending")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="steps of each mode's warm-up run (0: none)"
    )
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if len(sizes) < 2 or args.rows < PROMPTS_PER_STEP or args.steps < 2:
        raise SystemExit(
            f"need two sizes or more, --rows >= {PROMPTS_PER_STEP} and --steps >= 2 (step 1 is skipped)"
        )
    out = Path(args.out).resolve()
    began = time.perf_counter()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    from yatt_ray.tasks.demo import prepare_demo

    model = prepare_demo(yatt_ray.load_config(CONFIG)).model.path  # the demo's tiny LLaVA, built once
    points = write_data(out, sizes, args.rows)
    for p in points:
        print(
            f"data {p.size} px: {p.rows} rows, {p.image_bytes / p.rows / 1e3:.1f} KB of PNG a row, "
            f"{p.bytes_per_step / 1e6:.2f} MB a step, file {p.file_bytes / MB:.1f} MB",
            flush=True,
        )
    start_cluster(model, points[0], out)
    if args.warmup_steps:
        for mode in MODES:
            measured_fit(mode, points[0], model, args.warmup_steps, out / "warmup")
    runs = []
    for i, point in enumerate(points):
        for mode in list(MODES)[:: 1 if i % 2 == 0 else -1]:  # parallel first, then single first, ...
            runs.append(measured_fit(mode, point, model, args.steps, out))
    load_after = os.getloadavg()

    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in load_after)}\n")
    print(table(runs))
    by = {(r.mode, r.point.size): r for r in runs}
    lo, hi = sizes[0], sizes[-1]
    for mode in MODES:
        steps = ", ".join(f"{s} px {by[mode, s].growth_mb:.1f}" for s in sizes)
        print(f"{mode} driver growth by point (MB): {steps}")
    png = plot(runs, out / "bench_controllers.png")
    print(f"plot: {png}")
    print(f"bench time: {time.perf_counter() - began:.0f} s")
    parallel = by["parallel", hi].growth_mb - by["parallel", lo].growth_mb
    single = by["single", hi].growth_mb - by["single", lo].growth_mb
    bytes_growth = points[-1].bytes_per_step / points[0].bytes_per_step
    print(
        f"controllers: parallel_driver_growth_mb={parallel:.1f} single_driver_growth_mb={single:.1f} "
        f"bytes_growth={bytes_growth:.1f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
