"""Tensor parallelism through the whole loop, and the documented `ray job submit` path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import yatt_ray

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def test_tensor_parallel_2_trains_end_to_end(ray_cluster, demo_cache, tmp_path):
    """dp 1 x tp 2 on gloo: the controller (tp rank 0) broadcasts its batch; both ranks train."""
    config = yatt_ray.load_config(
        REPO / "examples/configs/grpo.yaml",
        ["train.tp_size=2", "train.dp_size=1", "train.steps=2", "train.prompts_per_step=4", "rollout.n=4",
         f"output.dir={tmp_path}", "output.progress=false"],
    )  # fmt: skip
    result = yatt_ray.fit(config)
    rows = [r for r in result.history if "reward_mean" in r]
    assert len(rows) == 2
    assert all(r["rollout_logp_diff"] < 1e-3 for r in rows)  # trainer (TP=2) agrees with the engine's weights
    assert Path(result.checkpoint_path, "config.json").exists()


@pytest.mark.parametrize("example", ["grpo", "ppo"])
def test_ray_job_submit_runs_the_example(ray_cluster, demo_cache, tmp_path, example):
    out = tmp_path / "job_run"
    cmd = [
        str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", ray_cluster["dashboard"], "--",
        "python", str(REPO / f"examples/{example}.py"), "train.steps=2", "train.prompts_per_step=4", "rollout.n=4",
        "train.dp_size=1", "critic.warmup_steps=0", f"output.dir={out}", "output.progress=false",
    ]  # fmt: skip
    env = ray_cluster["env"]  # the cluster itself was started with YATT_RAY_CACHE set to the session cache
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0 and "succeeded" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]  # one timestamped folder per run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
