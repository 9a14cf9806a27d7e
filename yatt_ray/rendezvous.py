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

Depends on Ray Train's private torch backend (`_TorchBackend`, `_set_torch_distributed_env_vars`, the v1
`WorkerGroup`) as of Ray 2.60; tests/integration/test_cluster.py checks the listening sockets of a local
`fit()` run.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from ray.train._internal.worker_group import WorkerGroup as V1WorkerGroup
from ray.train.torch import TorchConfig
from ray.train.torch.config import _is_backend_nccl, _set_torch_distributed_env_vars, _TorchBackend

_SERVER: dist.TCPStore | None = None  # rank 0's store server, alive while the world is


class WorldConfig(TorchConfig):
    """`TorchConfig` whose rendezvous store listens on the master address when that is loopback."""

    @property
    def backend_cls(self):
        return _LoopbackWorldBackend


class _LoopbackWorldBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: Any) -> None:  # a WorldConfig
        import ray

        host = worker_group.execute_single(0, ray.util.get_node_ip_address)
        if not is_loopback(host):
            super().on_start(worker_group, backend_config)
            return
        backend = backend_config.backend
        if backend is None:  # Ray's default
            backend = "nccl" if worker_group.get_resources_per_worker().get("GPU", 0) > 0 else "gloo"
        world_size = len(worker_group)
        worker_group.execute(_use_loopback_env)
        port = worker_group.execute_single(0, _serve_store, host, world_size, backend_config.timeout_s)
        worker_group.execute(_set_master, host, port)
        if not isinstance(worker_group, V1WorkerGroup):  # Ray Train v1 sets them in on_training_start
            worker_group.execute(_set_torch_distributed_env_vars)  # LOCAL_RANK, RANK, WORLD_SIZE, ...
        joins = [
            worker_group.execute_single_async(
                rank, _join_world, backend, host, port, rank, world_size, backend_config.timeout_s
            )
            for rank in range(world_size)
        ]
        ray.get(joins, timeout=backend_config.timeout_s + 60)  # each join times out after timeout_s itself

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        super().on_shutdown(worker_group, backend_config)  # destroys the process group
        worker_group.execute_single(0, _release_store)


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


def _serve_store(host: str, world_size: int, timeout_s: float) -> int:
    """In rank 0: start the world's store on `host` only; its port."""
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
