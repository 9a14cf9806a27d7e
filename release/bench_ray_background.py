"""What Ray's background processes cost the trainer on this machine: stop them in turns during a run.

    python release/bench_ray_background.py                         # 25m, dp 1, every group trained, 60 steps
    python release/bench_ray_background.py --group actors --size 100m
    python release/bench_ray_background.py --window 15 --hidden 896 --heads 14 --kv-heads 2   # any other
                                                            # bench_vs_trl.py option is passed on to it

Runs `release/bench_vs_trl.py --only dp1 --all-groups --engines hf` (the yatt_ray runs only; its cached model
and data) and, once the every-group run has trained a few steps, stops one group of Ray's processes (SIGSTOP)
for `--window` seconds, resumes them (SIGCONT) for as long, and so on until the run ends. Only processes a
running step does not need are stopped (`GROUPS`: the dashboard and its modules, Ray's agents and monitors,
idle pooled workers, Ray Train's controller, placement-group cleaner and synchronisation actor, Ray Data's stats
and autoscaling actors); GCS, raylet, the driver, the training worker, its data stream and the run's own actor
keep running. Steps that ran wholly inside a window are compared (the two after each edge are left out, one
for the step under way, one for the driver's lag in writing rows): the medians of `perf/mfu_train` and `time/train` with the group stopped and running. Last line:

    ray_background: group=<name> mfu_running=<x> mfu_stopped=<y> train_s_running=<a> train_s_stopped=<b>

On a machine with cores to spare the two agree; on two cores every wake-up of a background process lands on
one of the trainer's two GEMM threads (docs/performance.md, "Against TRL"). Every stopped process is resumed however the
script ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DASHBOARD = r"ray-dashboard-|ray/dashboard/dashboard\.py"
_ACTORS = (
    r"ray::IDLE|ray::PlacementGroupCleaner|ray::_AutoscalingCoordinatorActor|ray::_StatsActor"
    r"|ray::SynchronizationActor|ray::TrainController"
)
_AGENTS = r"ray::DashboardAgent|ray::RuntimeEnvAgent|ray/_private/log_monitor\.py|ray/autoscaler/_private/monitor\.py"
GROUPS = {"all": f"{_DASHBOARD}|{_ACTORS}|{_AGENTS}", "actors": _ACTORS, "dashboard": _DASHBOARD}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--group", choices=sorted(GROUPS), default="all", help="which processes are stopped")
    p.add_argument("--size", default="25m", help="a bench_vs_trl.py preset")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--window", type=float, default=7.0, help="seconds stopped, then as many running")
    p.add_argument("--out", type=Path, default=None, help="the runs (default: a temporary folder)")
    args, args.bench_options = p.parse_known_args()
    return args


def matching_pids(pattern: str) -> list[int]:
    """Processes whose command line matches `pattern`, this script and its parents left out."""
    keep_out = {os.getpid(), os.getppid()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in keep_out:
            continue
        try:
            command = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        if re.search(pattern, command) and "bench_ray_background" not in command:
            found.append(int(entry))
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, sig)


def train_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if "perf/mfu_train" in r]


def run_dirs(out: Path) -> list[Path]:
    """The yatt_ray dp 1 run folders under the benchmark's `--out`, oldest first (named by start time)."""
    runs = out / "yatt-dp1"
    return sorted(p for p in runs.iterdir() if p.is_dir()) if runs.exists() else []


def every_group_run(out: Path, before: int, bench: subprocess.Popen, timeout_s: float = 900.0) -> Path:
    """The metrics file of the benchmark's every-group run: the second run folder after the `before` there were."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and bench.poll() is None:
        runs = run_dirs(out)
        if len(runs) >= before + 2:
            return runs[before + 1] / "metrics.jsonl"
        time.sleep(0.5)
    raise RuntimeError(f"the benchmark ended or timed out before its every-group run began (log under {out})")


def toggle(bench: subprocess.Popen, metrics: Path, pattern: str, window: float) -> list[tuple[str, int]]:
    """Stop / resume the matching processes in turns while `bench` runs; (state, train rows so far) at each
    edge. The processes are looked up again at every stop (a restarted one gets a new pid)."""
    edges: list[tuple[str, int]] = []
    stopped: list[int] = []
    try:
        while bench.poll() is None:
            stopped = matching_pids(pattern)
            edges.append(("stopped", len(train_rows(metrics))))
            signal_all(stopped, signal.SIGSTOP)
            time.sleep(window)
            edges.append(("running", len(train_rows(metrics))))
            signal_all(stopped, signal.SIGCONT)
            stopped = []
            time.sleep(window)
    finally:
        signal_all(stopped, signal.SIGCONT)
    edges.append(("end", len(train_rows(metrics))))
    return edges


def split_steps(rows: list[dict], edges: list[tuple[str, int]]) -> dict[str, list[dict]]:
    """Rows by the state of the window they ran in: rows n + 3 .. m of a window that began with n rows written and
    ended with m. Row n + 1 may straddle the edge, and so may row n + 2: the driver writes a step's row up to
    its poll interval (0.5 s) after the step ends, so n can be one short; m one short only leaves a row out."""
    out: dict[str, list[dict]] = {"stopped": [], "running": []}
    for (state, first), (_, last) in zip(edges, edges[1:]):
        out[state].extend(rows[first + 2 : last])
    return out


def main() -> None:
    args = parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="ray_background_"))
    command = [sys.executable, str(ROOT / "release" / "bench_vs_trl.py"), "--size", args.size, "--only", "dp1",
               "--all-groups", "--engines", "hf", "--steps", str(args.steps), "--out", str(out), *args.bench_options]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    before = len(run_dirs(out))
    with open(out / "bench_vs_trl.log", "w") as log:
        bench = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        metrics = every_group_run(out, before, bench)
        while bench.poll() is None and len(train_rows(metrics)) < 4:  # past the first steps' warm-up
            time.sleep(0.5)
        edges = toggle(bench, metrics, GROUPS[args.group], args.window)
    except BaseException:  # Ctrl-C or no every-group run: the benchmark does not go on alone
        bench.terminate()
        raise
    finally:
        bench.wait()
    by_state = split_steps(train_rows(metrics), edges)
    figures = {}
    for state, rows in by_state.items():
        if not rows:
            raise SystemExit(f"no step ran wholly while {state}: use more --steps or a longer --window")
        figures[f"mfu_{state}"] = statistics.median(r["perf/mfu_train"] for r in rows)
        figures[f"train_s_{state}"] = statistics.median(r["time/train"] for r in rows)
        print(f"{state}: {len(rows)} steps, perf/mfu_train median {figures[f'mfu_{state}']:.3f}, "
              f"time/train median {figures[f'train_s_{state}']:.3f} s")  # fmt: skip
    print(f"runs and the benchmark's log under {out}")
    print(
        f"ray_background: group={args.group} mfu_running={figures['mfu_running']:.3f} "
        f"mfu_stopped={figures['mfu_stopped']:.3f} train_s_running={figures['train_s_running']:.3f} "
        f"train_s_stopped={figures['train_s_stopped']:.3f}"
    )


if __name__ == "__main__":
    main()
