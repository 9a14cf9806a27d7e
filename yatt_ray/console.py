"""A quiet console by default (`output.verbose=false`): the plan, the progress bar, the final report, and
every warning and error; the start-up chatter of Ray, Ray Data, Ray Train, Megatron and vLLM is turned off
at its source. `output.verbose=true` leaves every library as it is.

What each setting silences (seen in the demo's console):

| where | setting | what it silences |
|---|---|---|
| job | RAY_DATA_LOG_LEVEL=ERROR | Ray Data's "Starting execution", "Execution plan", "execution finished" lines and its "Progress bars disabled" warning (the driver turns them off: it shows one bar) |
| job | RAY_IGNORE_UNHANDLED_ERRORS=1 | the `InterruptedError` traceback of a Ray Data read task cut off at shutdown (an error nobody reads: an error the run does read is raised there) |
| job | VLLM_LOGGING_LEVEL=ERROR | vLLM's start-up notes (LD_PRELOAD, Triton, eager mode, seeds, thread binding) |
| job | TORCH_CPP_LOG_LEVEL=ERROR | torch's C++ warnings (vLLM's NUMA "MEMBIND" note) |
| local job | RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0 | Ray Train's "Actor ... 'PreemptionWatcher' has constructor arguments in the object store and max_restarts > 0" error line (ray-project/ray#53727); a cluster that fit() starts on this machine has no node a cloud could reclaim, so there is nothing to watch |
| raylet | worker_maximum_startup_concurrency | "N PYTHON worker processes have been started ... 4x the maximum expected startup concurrency": a local cluster counts from max(cores, 8) instead of its cores |
| driver | `ray` logger at WARNING in ray.init, its token-auth notice at ERROR; `vllm` at ERROR | "Started a local Ray instance", "Token authentication is enabled"; vLLM's Triton notes (the driver imports vLLM to check the model's head size) |
| Ray Train | RunConfig LoggingConfig(log_level=WARNING) | "Requesting resources", "Started training worker group", "Reporting training result", "Checkpoint successfully created" |
| worker | root logger at WARNING, `vllm` at ERROR | Megatron's DDP bucket / parameter list, Megatron-FSDP notes, the library's own per-rank INFO lines, vLLM's Triton notes at import (before its own logging is set up) |
| worker | warnings filters on the messages below | Megatron's "Transformer Engine and Apex are not installed" family, vLLM's `reduce_op` deprecation |

An environment variable already set where the driver runs (or in a `ray job submit` runtime env) wins.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any

QUIET_ENV = {
    "RAY_DATA_LOG_LEVEL": "ERROR",
    "RAY_IGNORE_UNHANDLED_ERRORS": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
}
LOCAL_QUIET_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# (message prefix, category) of library notices that only say an optional accelerated kernel is absent
QUIET_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    ("Transformer Engine and Apex are not installed", UserWarning),
    ("Apex is not installed", UserWarning),
    ("full scope is deprecated", UserWarning),
    ("`torch.distributed.reduce_op` is deprecated", FutureWarning),
    # Megatron DDP's collectives of the sharded optimizer (train.distributed_optimizer), under torch 2.13's names
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
)
STARTUP_CONCURRENCY = 8  # a local raylet warns at 4x this many Python workers started at once
_RAY_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def job_env_vars(verbose: bool, local: bool = False) -> dict[str, str]:
    """Environment variables for every process of the job (the runtime env of `ray.init`); {} when verbose.
    On a cluster that fit() starts on this machine (`local`) also no preemption watcher: no cloud reclaims a
    node there. Variables set in this process's environment are left out: the user's value (or the job's)
    stays."""
    if verbose:
        return {}
    env = {**QUIET_ENV, **(LOCAL_QUIET_ENV if local else {})}
    return {k: v for k, v in env.items() if k not in os.environ}


def ray_init_options(verbose: bool, local: bool) -> dict[str, Any]:
    """Extra `ray.init` arguments: the driver's `ray` logger at WARNING (no "Started a local Ray instance")
    and its token-auth notice at ERROR; for a cluster that `ray.init` starts (`local`), the raylet's
    startup-concurrency count."""
    if verbose:
        return {}
    logging.getLogger(_RAY_AUTH_NOTICE_LOGGER).setLevel(logging.ERROR)
    options: dict[str, Any] = {"logging_level": logging.WARNING}
    if local:
        concurrency = max(os.cpu_count() or 1, STARTUP_CONCURRENCY)
        options["_system_config"] = {"worker_maximum_startup_concurrency": concurrency}
    return options


def quiet_driver(verbose: bool) -> None:
    """On the driver, before anything is imported: vLLM's import notes (the driver imports vLLM to check the
    model's head size) and Hugging Face progress bars (building the demo model) off."""
    if verbose:
        return
    logging.getLogger("vllm").setLevel(logging.ERROR)  # its import notes go through the root logger here
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def train_log_level(verbose: bool) -> str:
    """Ray Train's own log level (RunConfig.logging_config)."""
    return "INFO" if verbose else "WARNING"


def quiet_worker(verbose: bool) -> None:
    """In a training worker, before Megatron and vLLM are imported: warnings and errors only on the root
    logger (Ray Train sets it to INFO), vLLM's errors only, and the notices of `QUIET_WARNINGS` filtered by
    message."""
    if verbose:
        return
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # as VLLM_LOGGING_LEVEL, also before vLLM sets it
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)  # a prefix match
