"""release/gpu_check.sh in its CPU mode (no CUDA here): both checks run and the table and last line come out."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_runs_in_cpu_mode(ray_cluster, tmp_path):
    env = {
        **ray_cluster["env"],
        "RAY_ADDRESS": ray_cluster["address"],
        "PY": sys.executable,
        "OUT": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", "release/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    lines = proc.stdout.strip().splitlines()
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert re.fullmatch(
        r"gpu_check: mode=cpu ok=true mfu=0\.\d{3} mfu_mb8=0\.\d{3} fit_steps=3", lines[-1]
    ), log
    table = "\n".join(lines[-9:])
    assert re.search(
        r"\| CUDA tests: packed attention = dense, HF engine, Qwen VL policy \(pytest\) \| \d+ passed, \d+ skipped .*\(exit 0\) \|",
        table,
    )
    assert (
        "| bench_train_mfu tiny fp32, micro-batches of 4 rows | MFU 0." in table
        and "| bench_train_mfu tiny fp32, micro-batches of 8 rows | MFU 0." in table
        and "| one step profiled (micro-batches of 4) | profiled step: " in table
        and "| GRPO fit, HF engine, 3 steps | 3 steps" in table
    )
    assert (
        (tmp_path / "tests.log").is_file()
        and (tmp_path / "mfu.log").is_file()
        and list((tmp_path / "fit").glob("*/metrics.jsonl"))
    )
    assert "kernels (measured on this machine)" in (tmp_path / "fit.log").read_text()  # the plan names them
