"""Tensor parallelism through the whole loop, and the documented `ray job submit` path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import yatt_ray

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


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


# docs/clusters.md "One machine, a head node of its own": the commands as written there (checked below).
README_COMMANDS = [
    "source .venv/bin/activate",
    "export RAY_AUTH_MODE=token",
    "ray get-auth-token --generate > /dev/null",
    "ray start --head --num-cpus=4",
    "ray job submit --address http://127.0.0.1:8265 --working-dir . -- "
    "python examples/ppo.py train.steps=3 critic.warmup_steps=1 output.dir=$PWD/runs/ppo",
    "ray stop",
]


def readme_local_commands() -> list[str]:
    """The bash block of docs/clusters.md's "One machine" section: one command a line, comments dropped."""
    text = (REPO / "docs" / "clusters.md").read_text()
    section = text[text.index("## One machine, a head node of its own\n") :]
    section = section[: section.index("\n## ", 1)]
    block = section.split("```bash\n")[1].split("```")[0]
    block = block.replace("\\\n", " ")  # continuation lines
    commands = [re.sub(r"\s+#\s.*$", "", line).strip() for line in block.splitlines()]
    return [" ".join(c.split()) for c in commands if c]


def test_readme_lists_the_tested_commands():
    assert readme_local_commands() == README_COMMANDS


def test_ray_job_submit_as_in_readme(demo_cache, tmp_path):
    """docs/clusters.md's one-machine commands on a fresh head node (HOME without ~/.ray: a fresh machine), with
    only what sharing the machine with the session's cluster needs: free ports and a temp dir of its own, the
    run's output in tmp_path, and, instead of `ray stop` (which stops every Ray on the machine), a stop of
    this head's processes alone."""
    ports = {name: _free_port() for name in ("gcs", "dashboard", "client", "agent")}
    temp_dir = tempfile.mkdtemp(prefix="yr-job-", dir="/tmp")  # short: Unix socket paths live in it
    out = tmp_path / "runs" / "ppo"
    own_head = (
        f" --port={ports['gcs']} --dashboard-port={ports['dashboard']} --ray-client-server-port={ports['client']}"
        f" --dashboard-agent-listen-port={ports['agent']} --temp-dir={temp_dir} --disable-usage-stats"
    )
    edits = {
        "source .venv/bin/activate": f"source {BIN / 'activate'}",  # the venv running this suite
        "ray start --head --num-cpus=4": "ray start --head --num-cpus=4" + own_head,
        "http://127.0.0.1:8265": f"http://127.0.0.1:{ports['dashboard']}",
        "output.dir=$PWD/runs/ppo": f"output.dir={out}",
    }
    script = ["set -euo pipefail"]
    for command in README_COMMANDS[:-1]:  # all but `ray stop`
        for old, new in edits.items():
            command = command.replace(old, new)
        script.append(command)
        if command.startswith("ray start"):  # the head really wants the token: a client without it is refused
            script.append(
                f"if env -u RAY_AUTH_MODE ray job list --address http://127.0.0.1:{ports['dashboard']} "
                ">/dev/null 2>&1; then echo 'NO TOKEN NEEDED'; exit 3; fi"
            )
    home = tmp_path / "home"
    home.mkdir()
    cache = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))  # compile caches stay warm
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "VIRTUAL_ENV"}
    env.update(HOME=str(home), XDG_CACHE_HOME=cache, PATH=os.defpath, YATT_RAY_CACHE=str(demo_cache))
    try:
        proc = subprocess.run(
            ["bash", "-c", "\n".join(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
        )
    finally:
        _stop_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and "succeeded" in proc.stdout, log
    assert (home / ".ray" / "auth_token").is_file()  # the token the CLI and the job used
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]  # one timestamped folder per run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3], rows
    assert "2 training worker(s)" in proc.stdout, log  # the default train.dp_size=2 fitted on 4 logical CPUs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_processes_of(temp_dir: str) -> None:
    """Kill the head started with `--temp-dir=temp_dir`: the processes naming that folder on their command
    line (GCS, raylet, dashboard, log monitor) and everything below them (agents, workers, the job)."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(temp_dir in arg for arg in proc.info["cmdline"] or []):
            roots.append(proc)
    doomed = set(roots)
    for proc in roots:
        with contextlib.suppress(psutil.Error):
            doomed.update(proc.children(recursive=True))
    for proc in doomed:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(doomed), timeout=30)
