"""Run a function on N local processes joined by a gloo process group, with timeouts and clean teardown.

`run_ranks(fn, world_size, *args)` starts N processes (forks of a server that has imported torch and
Megatron once: `PRELOAD`); each initialises gloo on 127.0.0.1 (a free port),
runs `fn(rank, world_size, *args)` and sends back its return value (or its traceback). The parent raises
the first failure, or a TimeoutError, and always terminates every child; a failing rank never leaves the
others hanging because collectives time out (`collective_timeout_s`) and the parent kills stragglers.
`fn` must be importable by name (a module-level function).
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank imports before its function runs (~4 s of CPU a process on 2 cores): imported once, in the
# fork server, so each rank is a fork of a process that has them (no process group, threads or parallel state
# exist there yet), not a fresh interpreter that imports them again.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "yatt_ray.train"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn, rank, world_size, port, collective_timeout_s, results, args):

    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores shared by every rank (and other test runs)
    os.environ.pop("MASTER_ADDR", None)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # plain bytes: shared-memory tensors would die with this process
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 180.0, collective_timeout_s: float = 60.0):
    """Return [fn(0, ...), ..., fn(world_size-1, ...)] computed in `world_size` gloo-connected processes."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, collective_timeout_s, results, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank died without reporting (exit codes {dead})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(out))} gave no result "
                        f"within {timeout_s}s"
                    ) from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=30)
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
