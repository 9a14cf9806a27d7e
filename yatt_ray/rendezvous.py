"""The training workers' torch.distributed world, with its rendezvous store on loopback when the world is.

Ray Train 2.60's torch backend (`ray.train.torch.config._TorchBackend.on_start`) asks rank 0 for its node IP
and a free port, sets them as MASTER_ADDR / MASTER_PORT in every worker, and has each rank call
`init_process_group(init_method="env://")`. torch then starts the rendezvous store (a `TCPStore` server) in
rank 0, and that server listens on every interface (`::`) whatever host it is given: on a cluster that
`yatt_ray.fit` starts on 127.0.0.1 (cluster.py), the one socket of the run reachable from the network.

`WorldConfig` is that `TorchConfig` with one change. When rank 0's node IP is a loopback address (every
rank then reaches the store there, so none runs on another machine):
1. each worker gets `cluster.loopback_env()` (gloo's and NCCL's interface, vLLM's host), a value already set
   in the worker kept;
2. rank 0 binds a socket to that address, port 0, and serves the store on it
   (`TCPStore(master_listen_fd=...)`); MASTER_ADDR / MASTER_PORT name it in every worker;
3. each rank joins `init_process_group(backend, store=...)`: rank 0 through its server, the others as
   clients.
Otherwise (a cluster across machines) Ray's own setup runs unchanged.

Depends on Ray Train's private torch backend (`_TorchBackend`, `_set_torch_distributed_env_vars`,
`_shutdown_torch`, the v1 `WorkerGroup`) as of Ray 2.60; tests/integration/test_cluster.py checks the listening
sockets of a local `fit()` run.

This module imports no torch: Ray Train's controller (a process of every run) unpickles `WorldConfig` and runs
its backend, and `ray.train.torch.config` imports torch (1.2 s of CPU at each run's start). Torch is imported in
the workers, by the functions they run; in the controller only when the world spans machines (Ray's own setup).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ray.train.backend import Backend, BackendConfig
from ray.train.v2._internal.util import TrainingFramework

log = logging.getLogger(__name__)

_SERVER: Any = None  # rank 0's store server (a torch.distributed.TCPStore), alive while the world is


@dataclass
class WorldConfig(BackendConfig):
    """Ray's `TorchConfig` (same fields, same worker context) whose rendezvous store listens on the master
    address when that is loopback."""

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _LoopbackWorldBackend

    @property
    def train_func_context(self):
        from ray.train.torch.config import TorchConfigContextManager  # read where the trainer is built

        return TorchConfigContextManager

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": self.init_method, "timeout_s": self.timeout_s}

    def torch_config(self):
        """This config as Ray's `TorchConfig` (imports torch)."""
        from ray.train.torch import TorchConfig

        return TorchConfig(**self.to_dict())


class _LoopbackWorldBackend(Backend):
    share_cuda_visible_devices: bool = True  # as Ray's torch backend

    def on_start(self, worker_group: Any, backend_config: Any) -> None:  # a WorldConfig
        import ray
        from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup

        host = worker_group.execute_single(0, ray.util.get_node_ip_address)
        if not is_loopback(host):
            _torch_backend().on_start(worker_group, backend_config.torch_config())
            return
        backend = backend_config.backend
        if backend is None:  # Ray's default
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        world_size = len(worker_group)
        worker_group.execute(_use_loopback_env)
        port = worker_group.execute_single(0, _serve_store, host, world_size, backend_config.timeout_s)
        worker_group.execute(_set_master, host, port)
        if not isinstance(worker_group, V1WorkerGroup):  # Ray Train v1 sets them in on_training_start
            worker_group.execute(_set_rank_env)  # LOCAL_RANK, RANK, WORLD_SIZE, ...
        joins = [
            worker_group.execute_single_async(
                rank, _join_world, backend, host, port, rank, world_size, backend_config.timeout_s
            )
            for rank in range(world_size)
        ]
        ray.get(joins, timeout=backend_config.timeout_s + 60)  # each join times out after timeout_s itself

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        import ray
        from ray._private.ray_constants import env_integer
        from ray.exceptions import GetTimeoutError
        from ray.train.constants import (
            DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
        )

        # as Ray's torch backend: destroy the process group (more than one rank), free CUDA's cache
        futures = worker_group.execute_async(_shutdown_world, destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            log.warning("the torch process group's shutdown timed out after %s s", timeout_s)
        worker_group.execute_single(0, _release_store)

    def on_training_start(self, worker_group: Any, backend_config: Any) -> None:
        from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup

        if isinstance(worker_group, V1WorkerGroup):
            worker_group.execute(_set_rank_env)


def _torch_backend():
    from ray.train.torch.config import _TorchBackend

    return _TorchBackend()


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and an IPv4-mapped loopback address; False for a name or any other IP."""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _use_loopback_env() -> None:
    from yatt_ray.cluster import loopback_env

    for key, value in loopback_env().items():
        os.environ.setdefault(key, value)


def _set_rank_env() -> None:
    from ray.train.torch.config import _set_torch_distributed_env_vars

    _set_torch_distributed_env_vars()


def _shutdown_world(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


def _serve_store(host: str, world_size: int, timeout_s: float) -> int:
    """In rank 0: start the world's store on `host` only; its port."""
    import torch.distributed as dist

    global _SERVER
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen()
    port = int(listener.getsockname()[1])
    _SERVER = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the server takes the socket over
    )
    return port


def _set_master(host: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = str(port)


def _join_world(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
    import torch.distributed as dist
    from ray.train.torch.config import _is_backend_nccl

    timeout = timedelta(seconds=timeout_s)
    store = _SERVER if rank == 0 else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if _is_backend_nccl(backend) and not {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_NCCL_BLOCKING_WAIT",
    } & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # as Ray does: a timed-out collective fails
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _release_store() -> None:
    global _SERVER
    _SERVER = None
