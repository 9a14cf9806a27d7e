"""Host memory of CPU workers: glibc's malloc keeps what tensors free while a role works, and gives it back
to the system when a role sleeps.

By default glibc serves every allocation over its mmap threshold (32 MiB at most, lower after a trim) with a
fresh `mmap`, whose pages the kernel faults in and zeroes on first touch, and unmaps it at free. A train step
allocates and frees the same activation sizes over and over: at the 25M-parameter shape of
`release/bench_vs_trl.py` that was 0.9-1.5M page faults in 11-14 steps and 1.11-1.2x of the step
(`release/bench_train_step.py`). `keep_freed_memory` makes the heap serve tensors under 1 GiB and keeps freed
memory in the process (`cpu_shims.apply_cpu_shims` calls it in every CPU training worker), so its resident
memory stays near its peak. A role that sleeps to make room for another process (the vLLM engine's CPU KV
cache) calls `release_freed_memory` after freeing, so that the memory does leave the process.

Both are glibc calls through ctypes (`mallopt`, `malloc_trim`); off glibc (musl, macOS) they change nothing
and return False.

MKL's own memory manager is off in every process of a job (`CPU_ENV`, `cpu_env()`: the environment the driver,
the local node, a joined cluster's runtime env and Ray Train's workers start with; `cluster.connect`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both; other C libraries may not
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Tensors under 1 GiB from the heap, no trimming below 2 GiB of free top, 64 MiB added per growth."""
    libc = _libc()
    if libc is None:
        return False
    settings = ((M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, (1 << 31) - 1), (M_TOP_PAD, 64 << 20))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def release_freed_memory() -> bool:
    """Return the free memory of every malloc arena to the system (`malloc_trim(0)`); True if any was."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


# MKL's memory manager keeps each thread's GEMM packing buffers for the life of the process, and where they
# land against the operands decides how fast every later GEMM runs: one 34M-parameter train step, alone in
# one process on a 2-core AVX2 EPYC, took 3.58-4.30 s from process to process (each steady within itself)
# and 4.52-4.66 s in every process with address randomisation off; with the manager off (buffers from malloc
# at each call) 3.52-3.57 s, and 3.91-3.94 s without randomisation (docs/performance-history.md, 2026-12-06).
CPU_ENV = {"MKL_DISABLE_FAST_MM": "1"}


def cpu_env() -> dict[str, str]:
    """Environment variables for the CPU math of every process of a job (`CPU_ENV`: MKL's memory manager off),
    each with this process's value where it has one. MKL reads it when a process first calls it, so it goes
    into the environment a worker starts with."""
    return {k: os.environ.get(k, v) for k, v in CPU_ENV.items()}
