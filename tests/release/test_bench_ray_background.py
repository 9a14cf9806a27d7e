"""release/bench_ray_background.py's parts (the whole benchmark is a training run: run by hand): which steps
count for which window, and that the processes it stops are the ones named and are resumed."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "release" / "bench_ray_background.py"
_spec = importlib.util.spec_from_file_location("bench_ray_background", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_ray_background"] = bench
_spec.loader.exec_module(bench)


def test_steps_straddling_a_window_edge_are_left_out():
    rows = [{"step": i + 1} for i in range(12)]
    # stopped with 2 rows done, running with 6, stopped with 9, end with 12
    edges = [("stopped", 2), ("running", 6), ("stopped", 9), ("end", 12)]
    by_state = bench.split_steps(rows, edges)
    # step 3 (row 2) may have been under way at the first edge, and step 4 too (its row written late); so
    # steps 7-8 at the second and 10-11 at the third
    assert [r["step"] for r in by_state["stopped"]] == [5, 6, 12]
    assert [r["step"] for r in by_state["running"]] == [9]


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def test_the_named_processes_are_stopped_and_resumed():
    marker = "yatt-bench-ray-background-marker"
    child = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(60)", marker])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pids = bench.matching_pids(marker)
        assert pids == [child.pid]
        bench.signal_all(pids + [2**22 + 1], signal.SIGSTOP)  # a pid that is gone is skipped
        time.sleep(0.2)
        assert _state(child.pid) == "T" and _state(other.pid) != "T"
        bench.signal_all(pids, signal.SIGCONT)
        time.sleep(0.2)
        assert _state(child.pid) != "T"
    finally:
        for proc in (child, other):
            proc.kill()
            proc.wait()
