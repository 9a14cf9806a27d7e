"""Connecting the driver to Ray: join a running cluster, or start a local one that listens on 127.0.0.1 only.

On Linux, Ray 2.60 binds its gRPC servers (GCS, raylet and object manager, every worker) to all interfaces
unless the node's IP is exactly "127.0.0.1", and `ray.init(_node_ip_address="127.0.0.1")` alone does not
get there: Ray replaces a loopback address by the machine's routable one
(`ray._private.services.resolve_ip_for_localhost`) except where `ray_constants.ENABLE_RAY_CLUSTER` is off, as
on macOS and Windows, where a node stays on loopback. A local cluster is started with that flag off for the
duration of `ray.init`, so the node IP stays 127.0.0.1; the dashboard, its agents and the runtime-env agent
then bind 127.0.0.1 too.

While it trains, the run's own sockets stay there as well: every process of the local job gets
`loopback_env()` (gloo and NCCL on the loopback interface, vLLM's host 127.0.0.1), and the training workers'
rendezvous store, which torch would bind on every interface, listens on 127.0.0.1
(`yatt_ray.rendezvous.WorldConfig`). tests/integration/test_cluster.py checks the listening sockets of an
idle local cluster and of a `fit()` run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from yatt_ray.config import Config
from yatt_ray.host_memory import cpu_env
from yatt_ray.placement import DATA_CPUS, genrm_replica_count, shared_cpus
from yatt_ray.shared_storage import cloud_env

LOOPBACK = "127.0.0.1"


def connect(config: Config) -> None:
    """Join `cluster.address` (or RAY_ADDRESS, as under `ray job submit`), else start a local cluster; then
    resolve `cluster.cpus_per_worker` when it is None (`resolve_cpus_per_worker`).

    Every process of the job gets `cpu_env()` (this one too, where the kernels are measured first). A local
    one even when a `ray start` cluster runs on this machine (join that one with
    `cluster.address=auto`). With `output.verbose=false` the job's processes get the quiet-console settings
    (`yatt_ray.console.job_env_vars`), and those of a local cluster `loopback_env()`; a variable already set
    in this environment wins."""
    import ray

    from yatt_ray.console import job_env_vars, ray_init_options

    # this process measures the kernels (`train.kernels`) and the matmul peak as the workers will run them
    os.environ.update(cpu_env())
    if ray.is_initialized():
        resolve_cpus_per_worker(config, local=False)
        return
    verbose, address = config.output.verbose, config.cluster.address or os.environ.get("RAY_ADDRESS")
    env = {**job_env_vars(verbose, local=not address), **cpu_env()}
    if address:  # a local cluster's processes inherit this environment; a cluster's elsewhere get it here
        env = {**cloud_env(), **env}
    if not address:
        env.update((k, v) for k, v in loopback_env().items() if k not in os.environ)
    options: dict = {"runtime_env": {"env_vars": env}} if env else {}
    if address:
        ray.init(address=address, log_to_driver=True, **options, **ray_init_options(verbose, local=False))
        resolve_cpus_per_worker(config, local=False)
        return
    resolve_cpus_per_worker(config, local=True)
    # A local cluster: declare enough logical CPUs for the workers, GenRM replicas and data tasks, even on a
    # 2-core laptop, but no more than 4 per core, so an oversized plan fails the placement check instead of
    # thrashing.
    cores = local_cores()
    needed = _logical_cpus_needed(config)
    # Every process of the local cluster on 127.0.0.1 (the dashboard too: Ray Train's placement-group
    # cleaner queries it, so it stays on).
    # The variables go in the node's environment, which its worker processes inherit, not in the job's runtime
    # env: a job with one gets a process of its own for every actor and task, where Ray's pool of started
    # workers serves a job without.
    with _node_ip_stays_loopback(), _environ(env):
        ray.init(
            address="local",
            num_cpus=max(cores, min(needed, 4 * cores)),
            _node_ip_address=LOOPBACK,
            dashboard_host=LOOPBACK,
            **ray_init_options(verbose, local=True),
        )


def loopback_env() -> dict[str, str]:
    """Environment variables that keep a job's own sockets on loopback: gloo's and NCCL's (their devices and
    bootstrap listen on the address of this interface, `loopback_interface()`) and vLLM's host address
    (`VLLM_HOST_IP`, where vLLM's processes would meet). For a cluster on 127.0.0.1 only; the rendezvous store
    torch starts for the training workers needs `yatt_ray.rendezvous.WorldConfig` besides."""
    interface = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface, "VLLM_HOST_IP": LOOPBACK}


def loopback_interface() -> str:
    """The network interface that holds 127.0.0.1 ("lo" on Linux, "lo0" on macOS); "lo" when none is found."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == LOOPBACK for a in addresses):
            return name
    return "lo"


def local_cores() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def resolve_cpus_per_worker(config: Config, local: bool) -> None:
    """Set `cluster.cpus_per_worker` when it is None: the CPUs of a training worker's node shared among the
    training workers placed there, at least 1 (`shared_cpus`). That value is the Ray resource each worker
    claims, the torch (and vLLM) thread count it runs with (roles.build_roles) and what the plan prints.

    - a local cluster (started here): floor((cores - engine actors' CPUs) / workers) with cores =
      `local_cores()`; the cluster then
      declares logical CPUs for the workers, GenRM replicas and data tasks on top (`connect`);
    - a running cluster: the node with the most CPUs (among GPU nodes when the run uses GPUs) holds
      `workers_on_node` workers: min(workers, its GPUs) with GPUs, else all of them (PACK) or an even share
      over the nodes (SPREAD). Each gets floor((node CPUs - the data tasks' CPU [- the engine actors' CPUs on
      a CPU-only cluster]) / (those workers + the GenRM replicas)), and no more than the cores of this machine allow when the node is this machine (a test
      cluster may declare more logical CPUs than cores).
    """
    c = config.cluster
    if c.cpus_per_worker is not None:
        return
    workers = config.train.dp_size * config.train.tp_size
    engine_cpus = config.placement.rollout_engines * config.placement.cpus_per_engine  # engine actors' own
    if local:
        c.cpus_per_worker = shared_cpus(local_cores() - engine_cpus, workers)
        return
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    use_gpu = c.use_gpu if c.use_gpu is not None else ray.cluster_resources().get("GPU", 0) >= 1
    candidates = [n for n in nodes if n["Resources"].get("GPU", 0) >= 1] if use_gpu else nodes
    if not candidates:  # the placement check names what is missing
        c.cpus_per_worker = 1
        return
    node = max(candidates, key=lambda n: n["Resources"]["CPU"])
    if use_gpu:
        on_node = min(workers, int(node["Resources"]["GPU"]))
    else:
        on_node = workers if c.placement_strategy == "PACK" else -(-workers // len(candidates))
    with_genrm = config.reward.mode != "rule"
    genrm = genrm_replica_count(config, use_gpu) if with_genrm else 0
    share = shared_cpus(node["Resources"]["CPU"] - DATA_CPUS - engine_cpus * (not use_gpu), on_node + genrm)
    if node.get("NodeManagerAddress") == ray.util.get_node_ip_address():
        share = min(share, shared_cpus(local_cores(), on_node))
    c.cpus_per_worker = share


def _logical_cpus_needed(config: Config) -> int:
    """Logical CPUs a local cluster declares: cpus_per_worker for each training worker and GenRM replica, plus
    the data tasks' share (the placement plan's count, `placement.PlacementPlan.cpus_needed`), and one spare."""
    cpus = config.cluster.cpus_per_worker or 1
    genrm = genrm_replica_count(config, bool(config.cluster.use_gpu)) if config.reward.mode != "rule" else 0
    engines = config.placement.rollout_engines * config.placement.cpus_per_engine
    return (config.train.dp_size * config.train.tp_size + genrm) * cpus + engines + DATA_CPUS + 1


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment (a variable already set wins) while a local node starts, then
    removed: the node's processes keep it, and give it to every worker process they start."""
    added = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


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
