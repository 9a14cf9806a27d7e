"""The driver: config -> data sources -> placement plan -> TorchTrainer -> Result.

The driver never receives samples. Prompts are read by Ray Data tasks and streamed to each group's
controller; the only things that come back are per-step scalar rows (through the MetricsHub actor), the
final checkpoint handle and errors.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yatt_ray.config import Config, load_config, validate
from yatt_ray.errors import ConfigError, WorkerError

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What a run returns: the per-step metrics history, the final checkpoint location and output folder."""

    history: list[dict[str, float]] = field(default_factory=list)
    checkpoint_path: str | None = None
    output_dir: str = ""

    def metric(self, key: str) -> list[float]:
        """The values of `key` over the training steps (rows that carry it), in step order."""
        return [row[key] for row in self.history if key in row]


def fit(config: Config | dict | str | Path | None = None, overrides: list[str] | None = None) -> Result:
    """Train with `config` (a Config, a dict, a YAML path, or None for the embedded demo) and return a Result."""
    config = _resolve_config(config, overrides)
    _prepare_inputs(config)
    files = _check_inputs(config)
    _connect(config)
    import ray

    from yatt_ray.placement import plan_placement

    plan = plan_placement(config, ray.cluster_resources())
    print(plan.describe(), flush=True)
    return _run(config, plan, files)


def _resolve_config(config: Config | dict | str | Path | None, overrides: list[str] | None) -> Config:
    if config is None or isinstance(config, str | Path):
        return load_config(config, overrides)
    if isinstance(config, dict):
        config = Config.from_dict(config)
    if not isinstance(config, Config):
        raise ConfigError(f"fit() takes a Config, a dict, a YAML path or None; got {type(config).__name__}")
    if overrides:
        config = load_config(None, _flatten(config.to_dict()) + list(overrides))
    validate(config)
    return config


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[str]:
    import json

    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value)}")
    return out


def _prepare_inputs(config: Config) -> None:
    if not config.model.path or not config.data.train_files:
        from yatt_ray.tasks.demo import prepare_demo

        prepare_demo(config)


def _check_inputs(config: Config) -> dict[str, list[str]]:
    """Fail before any cluster work on a bad model directory or data files."""
    from yatt_ray.data import check_sources
    from yatt_ray.train.hf_convert import LlamaShape, check_tp_size

    check_tp_size(LlamaShape.from_hf_dir(config.model.path), config.train.tp_size)
    files = {"train": check_sources(config.data)}
    if config.data.eval_files:
        eval_cfg = type(config.data)(**{**config.data.__dict__, "train_files": config.data.eval_files})
        files["eval"] = check_sources(eval_cfg)
    return files


def _connect(config: Config) -> None:
    """Join `cluster.address` (or RAY_ADDRESS, as under `ray job submit`), else start a local cluster."""
    import ray

    if ray.is_initialized():
        return
    address = config.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    # A local cluster: declare enough logical CPUs for the workers plus data tasks, even on a 2-core laptop.
    needed = config.train.dp_size * config.train.tp_size * config.cluster.cpus_per_worker + 2
    ray.init(num_cpus=max(os.cpu_count() or 1, needed), include_dashboard=False)


def _run(config: Config, plan, files: dict[str, list[str]]) -> Result:
    import ray
    import ray.data
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from yatt_ray.controller import train_loop_per_worker
    from yatt_ray.data import build_dataset
    from yatt_ray.metrics.hub import start_hub

    output_dir = _output_dir(config)
    ray.data.DataContext.get_current().enable_progress_bars = False  # the driver shows one bar: the steps
    dp = plan.dp_size
    train_shards = build_dataset(config.data, files["train"]).streaming_split(dp, equal=True)
    eval_shards = None
    if "eval" in files:
        eval_data = type(config.data)(**{**config.data.__dict__, "shuffle_seed": None})
        eval_shards = build_dataset(eval_data, files["eval"]).streaming_split(dp, equal=True)
    hub = start_hub()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config.to_dict(),
            "hub": hub,
            "train_shards": train_shards,
            "eval_shards": eval_shards,
        },
        torch_config=TorchConfig(backend="nccl" if plan.gpus_per_worker else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=plan.num_workers,
            use_gpu=bool(plan.gpus_per_worker),
            resources_per_worker={"CPU": plan.cpus_per_worker},
        ),
        run_config=RunConfig(name="train", storage_path=str(output_dir / "ray")),
    )
    from yatt_ray.progress import DriverProgress

    progress = DriverProgress(hub, config, output_dir)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=_fit_into, args=(trainer, outcome), daemon=True)
    thread.start()
    while thread.is_alive():
        progress.poll()
        time.sleep(0.5)
    progress.poll()
    progress.close()
    if "error" in outcome:
        raise WorkerError(f"training failed: {outcome['error']}") from outcome["error"]
    checkpoint = outcome["result"].checkpoint
    return Result(
        history=progress.history,
        checkpoint_path=os.path.join(checkpoint.path, "policy_hf") if checkpoint else None,
        output_dir=str(output_dir),
    )


def _fit_into(trainer, outcome: dict) -> None:
    try:
        outcome["result"] = trainer.fit()
    except Exception as exc:  # reported on the driver's thread
        outcome["error"] = exc


def _output_dir(config: Config) -> Path:
    path = Path(config.output.dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path
