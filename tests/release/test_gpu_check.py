"""release/gpu_check.sh in its CPU mode (no CUDA here): every check runs and the table and the last lines come out."""

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
    assert lines[-2] == "gpu_check: mode=cpu ok=true fit_steps=3", log
    assert re.fullmatch(  # issue 55's line: the tiny preset's MFU twice on a CPU, no GPU busy share, no 1.5B fit
        r"gpu_check: mfu_0_5b=0\.\d{3} mfu_1_5b=0\.\d{3} busy_1_5b=nan weight_sync_s_1_5b=nan grpo_step_s_1_5b=nan",
        lines[-1],
    ), log
    table = "\n".join(lines[-10:])
    assert re.search(
        r"\| CUDA tests: packed attention = dense, fused RMSNorm, pinned copies, HF engine, Qwen VL policy \(pytest\) "
        r"\| \d+ passed, \d+ skipped .*\(exit 0\) \|",
        table,
    ), table
    assert (
        "| bench_train_mfu tiny fp32, micro-batches of 4 rows | MFU 0." in table
        and "| bench_train_mfu tiny fp32, micro-batches of 8 rows | MFU 0." in table
        and "| one more step of the second run, profiled | profiled step: " in table
        and "| GRPO fit of the demo, HF engine in process, 3 steps | 3 steps" in table
    ), table
    assert (
        (tmp_path / "tests.log").is_file()
        and (tmp_path / "mfu_small.log").is_file()
        and (tmp_path / "mfu_large.log").is_file()
        and list((tmp_path / "fit").glob("*/metrics.jsonl"))
    )
    assert "kernels (measured on this machine)" in (tmp_path / "fit.log").read_text()  # the plan names them
