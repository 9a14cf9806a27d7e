"""Measurements cached per machine: the CPU kernel choices (`train.kernel_timing`), the CPU matmul peak
(`train.kernel_timing.cpu_peak`) and the rollout engine for `rollout.engine=auto` (`rollout.engine_choice`), each
measured once and kept in `$XDG_CACHE_HOME/yatt_ray/kernels.json` (or `~/.cache/...`) under a key that names the
machine (`cache_key`: CPU model, torch version, instruction-set caps and CPU math settings) and what was measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from yatt_ray.host_memory import CPU_ENV


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "yatt_ray" / "kernels.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


# environment variables that cap the instruction set a GEMM library uses (an AVX-512 CPU run as an AVX2 one)
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cache_key(*parts) -> str:
    """A cache key for a measurement on this machine: the CPU model, torch version and the instruction-set
    caps set in the environment (`ISA_CAPS`: the same CPU measures differently under them) and the CPU math
    settings (`host_memory.CPU_ENV`), then `parts`."""
    caps = ",".join(f"{k}={os.environ[k]}" for k in (*ISA_CAPS, *CPU_ENV) if os.environ.get(k))
    return "|".join(
        map(str, (parts[0], _cpu_model(), torch.__version__, *([caps] if caps else []), *parts[1:]))
    )


def cached_measurement(key: str, measure, read=lambda v: v):
    """`read(value)` of `key` in the machine's cache (`cache_path()`), or `measure()` now (a JSON value),
    stored under `key` and read. An entry `read` cannot take (another version's) is measured again; a cache
    that cannot be written (a read-only home) only means measuring next time too."""
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a damaged file: it is rewritten below
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if key in cached:
        try:
            return read(cached[key])
        except (KeyError, TypeError, ValueError):
            pass
    value = measure()
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return read(value)
