"""Shared fixtures: one local Ray cluster per test session, started the way users start one.

The cluster is a real head node (`ray start --head`, with the job server), so tests can both `ray.init` into
it and `ray job submit` to it. Logical CPUs are declared above the machine's 2 cores so that two training
workers, their data tasks and a job driver fit; that is placement, not compute.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """A per-session cache for the demo model and data (built once, reused by every test)."""
    path = Path(os.environ.get("YATT_RAY_CACHE", tmp_path_factory.mktemp("yatt_cache")))
    os.environ["YATT_RAY_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory, demo_cache):
    """Start a head node, connect this process to it, and yield its addresses; stop it at the end.

    `ray stop --force` at the end stops every Ray instance on the machine: run the suite where no other
    Ray cluster of yours is running.
    """
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # No cloud reclaims this machine: no preemption-watcher actor (a process) for each run's Ray Train
    # controller, as fit() does on the local cluster it starts (Ray Train passes the driver's value on).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

    gcs_port, dash_port = _free_port(), _free_port()
    # A loopback test cluster: token auth off (ray start turns it on when ~/.ray/auth_token exists, and
    # a client given an explicit address then fails with InvalidAuthToken).
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "YATT_RAY_CACHE": os.environ["YATT_RAY_CACHE"],
    }
    start = [
        str(BIN / "ray"), "start", "--head", f"--port={gcs_port}",         "--num-cpus=8", "--num-gpus=4", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
        "--disable-usage-stats",
    ]  # fmt: skip
    subprocess.run(start, check=True, env=env, cwd=REPO, capture_output=True, timeout=180)
    address = f"127.0.0.1:{gcs_port}"
    try:  # from here on the head node runs: stopped however the session ends (a failed connect included)
        ray.init(address=address, log_to_driver=False)
        _wait_for_dashboard(dash_port)
        yield {"address": address, "dashboard": f"http://127.0.0.1:{dash_port}", "env": env}
    finally:
        ray.shutdown()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def _wait_for_dashboard(port: int, timeout_s: float = 60) -> None:
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"the Ray dashboard (job server) did not answer on 127.0.0.1:{port} in {timeout_s}s")


@pytest.fixture(scope="session")
def s3_options():
    """fsspec options for a moto S3 server in its own process on 127.0.0.1, with a bucket "ckpt".

    Not in-process: moto's server imports Flask, whose `current_app` proxy makes vLLM's kernel rebinding
    (which inspects every loaded module) fail for the rest of the pytest session.
    """
    import importlib.util

    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        pytest.skip("moto[server] and s3fs are needed for the S3 tests (pip install 'moto[server]' s3fs)")
    import boto3

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket="ckpt")
            break
        except Exception:  # the server is still starting
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise
            time.sleep(0.2)
    try:
        yield {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    finally:
        server.terminate()
        server.wait(timeout=30)


def pytest_collection_modifyitems(config, items):
    """Tests that use the shared cluster, or start one of their own (tests/integration/), are `cluster` tests:
    `make test-fast` leaves them out."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()) or "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="module")
def single_process_world():
    """A world of size 1 (gloo, in-memory store) in the pytest process, with Megatron TP=1 on top of it.

    Everything TP=1 runs here; TP=2 / DP=2 runs in spawned processes (see `dist_harness.py`). Torn down
    after each module so no process group outlives these tests in a shared pytest session.
    """
    from yatt_ray.train import init_parallel_state

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state(1)
    yield
    if owned:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
