"""Connecting the driver to Ray: join a running cluster, or start a local one that listens on 127.0.0.1 only.

On Linux, Ray 2.60 binds its gRPC servers (GCS, raylet and object manager, every worker) to all interfaces
unless the node's IP is exactly "127.0.0.1", and `ray.init(_node_ip_address="127.0.0.1")` alone does not
get there: Ray replaces a loopback address by the machine's routable one
(`ray._private.services.resolve_ip_for_localhost`) except where `ray_constants.ENABLE_RAY_CLUSTER` is off, as
on macOS and Windows, where a node stays on loopback. A local cluster is started with that flag off for the
duration of `ray.init`, so the node IP stays 127.0.0.1; the dashboard, its agents and the runtime-env agent
then bind 127.0.0.1 too (tests/test_cluster_local.py checks the listening sockets).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from yatt_ray.config import Config

LOOPBACK = "127.0.0.1"


def connect(config: Config) -> None:
    """Join `cluster.address` (or RAY_ADDRESS, as under `ray job submit`), else start a local cluster.

    A local one even when a `ray start` cluster runs on this machine (join that one with
    `cluster.address=auto`)."""
    import ray

    if ray.is_initialized():
        return
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # A local cluster: declare enough logical CPUs for the workers plus data tasks, even on a 2-core laptop,
    # but no more than 4 per core, so an oversized plan fails the placement check instead of thrashing.
    cores = os.cpu_count() or 1
    needed = config.train.dp_size * config.train.tp_size * config.cluster.cpus_per_worker + 2
    # Every process of the local cluster on 127.0.0.1 (the dashboard too: Ray Train's placement-group
    # cleaner queries it, so it stays on).
    with _node_ip_stays_loopback():
        ray.init(
            address="local",
            num_cpus=max(cores, min(needed, 4 * cores)),
            _node_ip_address=LOOPBACK,
            dashboard_host=LOOPBACK,
        )


@contextlib.contextmanager
def _node_ip_stays_loopback() -> Iterator[None]:
    """Ray's single-machine mode while a local node starts: its IP stays 127.0.0.1 (see the module docstring).

    Restored afterwards, so a later `ray.init(address=...)` in this process, after `ray.shutdown()`, still
    registers the driver under the machine's routable IP.
    """
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
