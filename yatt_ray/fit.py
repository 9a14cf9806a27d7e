"""The driver: config -> data sources -> placement plan -> TorchTrainer -> Result.

The driver never receives samples. Prompts are read by Ray Data tasks and streamed to each group's
controller; the only things that come back are per-step scalar rows (through the MetricsHub actor), the
final checkpoint handle and errors.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yatt_ray.cluster import connect
from yatt_ray.config import Config, apply_override, load_config, validate
from yatt_ray.errors import ConfigError, WorkerError, YattError
from yatt_ray.model_source import ModelSource, fetch, fetch_on_every_node, model_source
from yatt_ray.shared_storage import (
    check_shared,
    cloud_env,
    fetch_tree,
    keep_earlier_metrics,
    report_url,
    run_mirror,
    train_storage,
    upload_tree,
)

log = logging.getLogger(__name__)


@dataclass
class Result:
    """What a run returns: the per-step metrics history, the final checkpoint location and output folder.

    Shown in a notebook (or printed) it is a short summary: the steps trained, the last step's reward and
    accuracy, the eval accuracy before and after RL when there is an eval set, the final checkpoint and the run
    folder. `history_frame()` is every metric as a pandas DataFrame, one row per step; `config` is the resolved
    config the run used (also in `<output_dir>/config.yaml`, `read_run_config`)."""

    history: list[dict[str, float]] = field(default_factory=list)
    checkpoint_path: str | None = None
    output_dir: str = ""
    checkpoint_dir: str = ""  # the run's checkpoints (`checkpoint.dir`)
    steps_redone: int = 0  # training steps run again after restarts from a checkpoint
    rollout_engine: str = ""  # the engine the run generated with ("vllm" / "hf": rollout.engine resolved)
    stopped: str | None = (
        None  # why the run saved and stopped before train.steps ("SIGTERM", "SIGINT"), else None
    )
    config: Config | None = None  # the resolved, frozen config of the run (what config.yaml holds)

    def metric(self, key: str) -> list[float]:
        """The values of `key` over the training steps (rows that carry it), in step order."""
        return [row[key] for row in self.history if key in row]

    def history_frame(self) -> Any:
        """The history as a pandas DataFrame: one row per step (index "step", ascending), a column per metric.

        The rows the run recorded for one step (its training row, its idle-time row, an evaluation at step 0
        or at the last step, a checkpoint event) are merged into that step's row; a metric a step has no
        value for is NaN."""
        import pandas as pd

        by_step: dict[int, dict[str, float]] = {}
        for row in self.history:
            values = {k: v for k, v in row.items() if k != "step"}
            by_step.setdefault(int(row.get("step", 0)), {}).update(values)
        train = [k for row in self.history if "reward_mean" in row for k in row]  # the training metrics first
        columns = [
            k for k in dict.fromkeys([*train, *(k for row in self.history for k in row)]) if k != "step"
        ]
        frame = pd.DataFrame.from_dict(by_step, orient="index", columns=columns or None).sort_index()
        frame.index.name = "step"
        return frame

    def summary(self) -> dict[str, Any]:
        """The figures the notebook view shows, by name (absent ones left out)."""
        train = [row for row in self.history if "reward_mean" in row]
        out: dict[str, Any] = {"steps": int(train[-1].get("step", len(train))) if train else 0}
        if self.config is not None:
            out["steps"] = f"{out['steps']}/{self.config.train.steps}"
        for key in ("reward_mean", "accuracy"):
            if train and key in train[-1]:
                out[key] = round(train[-1][key], 4)
        evals = self.metric("eval/accuracy")
        if evals:
            out["eval/accuracy"] = (
                f"{evals[0]:.4g} -> {evals[-1]:.4g}" if len(evals) > 1 else round(evals[0], 4)
            )
        if self.stopped:
            out["stopped"] = self.stopped
        if self.steps_redone:
            out["steps_redone"] = self.steps_redone
        out["checkpoint_path"] = self.checkpoint_path
        out["output_dir"] = self.output_dir
        return out

    def __repr__(self) -> str:
        figures = ", ".join(
            f"{k}={v!r}" if isinstance(v, str | None) else f"{k}={v}" for k, v in self.summary().items()
        )
        return f"Result({figures})"

    def _repr_html_(self) -> str:
        import html

        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
            f"<code>{html.escape(str(v))}</code></td></tr>"
            for k, v in self.summary().items()
        )
        return (
            f"<b>yatt_ray.Result</b><table>{cells}</table>"
            "<small>every metric by step: <code>result.history_frame()</code></small>"
        )


CONFIG_FILE = "config.yaml"  # the run folder's resolved config (`write_run_config`)
REDACTED = "<redacted>"


def write_run_config(config: Config, output_dir: str | Path) -> Path:
    """Write the resolved config to `<output_dir>/config.yaml` (YAML, the sections in the config's order) and
    return its path. The values under `checkpoint.storage_options` (fsspec keys and secrets) are written as
    "<redacted>", as the MLflow / W&B params are. fit() writes it once, at the start of the run, into the run's
    own fresh folder: a later run, a resumed one included, writes its own folder, never this file. Given back as
    `--config`, the file repeats the run (its `checkpoint.dir` included, so `checkpoint.resume=auto` continues
    from that run's checkpoints)."""
    import yaml

    data = config.to_dict()
    options = data["checkpoint"]["storage_options"]
    data["checkpoint"]["storage_options"] = dict.fromkeys(options, REDACTED)
    path = Path(output_dir) / CONFIG_FILE
    header = "# this run's resolved config, written by yatt_ray.fit (yatt_ray.fit.read_run_config reads it)\n"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
    return path


def read_run_config(run_dir: str | Path) -> Config:
    """The config a run folder's config.yaml holds (`write_run_config`), as a Config (not validated)."""
    import yaml

    return Config.from_dict(yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text()))


def fit(config: Config | dict | str | Path | None = None, overrides: list[str] | None = None) -> Result:
    """Train with `config` (a Config, a dict, a YAML path, or None for the embedded demo) and return a Result.

    The driver resolves a copy of the config once (the demo's inputs, absolute paths, the judge, the checkpoint
    folder, the rollout engine kind), validates it again and freezes it before any worker starts."""
    from yatt_ray.metrics.startup import Startup

    startup = Startup()  # where the seconds before the first step go (startup.json, the closing report)
    startup.mark("fit_called")
    config = _resolve_config(config, overrides)
    from yatt_ray.console import quiet_driver

    quiet_driver(config.output.verbose)
    source = _fetch_model(config)  # a URL or hub id: fetched here first (the checks read it)
    demo = _prepare_inputs(config)
    files = _check_inputs(config, demo)
    _check_local_placement(config)  # a local cluster's plan: refused before Ray starts and before a folder
    output_dir, remote = _output_dir(config)
    try:
        return _start(config, files, output_dir, startup, source)
    except BaseException:
        _remove_if_empty(output_dir)  # a run refused before it wrote anything leaves no empty folder behind
        raise
    finally:
        if remote and output_dir.exists():  # output.dir a URL: the run folder goes there, failed runs too
            upload_tree(output_dir, remote, config.checkpoint.storage_options)
            log.info("run folder %s uploaded to %s", output_dir, remote)


def _start(config: Config, files: dict[str, list[str]], output_dir: Path, startup, source) -> Result:
    """Check the checkpoints, connect to Ray, check the shared storage, fetch a remote model on every node,
    plan, resolve the engine, freeze the config, and run."""
    print(_check_checkpoints(config, output_dir), flush=True)
    startup.mark("inputs_checked")
    connect(config)
    startup.mark("ray_started")
    _start_autoscaling_coordinator()
    import ray

    storage, _ = train_storage(config.checkpoint.dir, config.checkpoint.storage_options, output_dir)
    shared = check_shared(
        {"checkpoint.dir": config.checkpoint.dir, "the run folder (Ray Train's report)": storage},
        config.cluster.timeout_s,
    )  # several nodes: a local path must be one folder on all of them, refused here otherwise
    if shared:
        print(shared, flush=True)
    if source.remote:
        nodes = fetch_on_every_node(source, config.model.path, config.cluster.timeout_s)
        print(f"{source.describe(config.model.path)} ({nodes} node(s))", flush=True)

    from yatt_ray.placement import plan_placement

    sizes = _model_sizes(config)
    plan = plan_placement(config, ray.cluster_resources(), sizes)
    gpu_gb = _gpu_memory_gb(plan, config.cluster.timeout_s)
    real_gpus = gpu_gb > 0  # logical GPUs without CUDA behind them (CPU tests of placement): compute on CPUs
    if real_gpus:
        print(_check_device_memory(config, plan, sizes, gpu_gb), flush=True)
    engine = _resolve_engine(config, plan, real_gpus)  # on CPUs "auto" may time both engines (cached)
    if plan.genrm is not None:
        engine += f"\n  judge engine: {_resolve_judge_engine(config, plan, real_gpus)}"
    validate(config)  # the resolved config (paths, demo inputs, engine, checkpoint dir) is valid too ...
    config.freeze()  # ... and from here on read-only: the workers and GenRM replicas get exactly this
    write_run_config(config, output_dir)  # config.yaml: once, in this run's own folder
    print(plan.describe() + f"\n  rollout engine: {engine}", flush=True)
    if not real_gpus:
        print("  " + _kernels(config, plan.cpus_per_worker), flush=True)
    startup.mark("kernels_chosen")
    return _run(config, plan, files, real_gpus, output_dir, startup)


def _start_autoscaling_coordinator() -> None:
    """Start the cluster's Ray Data autoscaling coordinator (a detached actor, one per cluster) now, while the
    driver plans: Ray Train's controller creates it otherwise and waits for its process to start before it
    creates the workers (Ray 2.60, `ScalingPolicy.after_controller_start`). A no-op where it runs already."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
    except ImportError:  # another Ray: its controller starts what it needs
        return
    get_or_create_autoscaling_coordinator()


def _resolve_config(config: Config | dict | str | Path | None, overrides: list[str] | None) -> Config:
    """A validated copy of the input: fit() fills in paths and the engine kind without touching the caller's."""
    if config is None or isinstance(config, str | Path):
        return load_config(config, overrides)
    if isinstance(config, Config):
        config = config.to_dict()  # a deep copy
    if not isinstance(config, dict):
        raise ConfigError(f"fit() takes a Config, a dict, a YAML path or None; got {type(config).__name__}")
    data = copy.deepcopy(config)
    for item in overrides or []:
        apply_override(data, item)
    resolved = Config.from_dict(data)
    validate(resolved)
    return resolved


def _fetch_model(config: Config) -> ModelSource:
    """`model.path` as an fsspec URL or a hub id: fetched into this machine's cache now and `model.path` set to
    the local copy (every node fetches it too once Ray is up: `fetch_on_every_node`). Returns where it came
    from."""
    source = model_source(config.model.path)
    if source.remote:
        config.model.path, revision = fetch(source)
        source = dataclasses.replace(source, revision=revision)
    return source


def _prepare_inputs(config: Config) -> bool:
    """The embedded demo when neither a model nor data is given (returns True); absolute paths for the
    workers."""
    demo = not config.model.path and not config.data.train_files
    if demo:
        from yatt_ray.tasks.demo import prepare_demo

        prepare_demo(config)
    elif not config.model.path or not config.data.train_files:
        missing = "model.path" if not config.model.path else "data.train_files"
        raise ConfigError(
            f"{missing} is empty while the other input is set; give both (your model and your data), "
            "or neither to run the embedded demo"
        )
    if "://" not in config.model.path:
        config.model.path = str(Path(config.model.path).expanduser().resolve())
    if config.critic.path and "://" not in config.critic.path:
        config.critic.path = str(Path(config.critic.path).expanduser().resolve())
    return demo


def _check_inputs(config: Config, demo: bool = False) -> dict[str, list[str]]:
    """Fail before any cluster work on a bad model directory or data files; for your own model and data (not
    the `demo`), warn about the demo's sizes and check the prompt budget (`prompt_budget`)."""
    from yatt_ray.data import check_sources
    from yatt_ray.data.sources import first_row
    from yatt_ray.model_dir import is_vision_model
    from yatt_ray.model_shape import LlamaShape
    from yatt_ray.reward.rules import check_reward_fn, resolve_reward_fn
    from yatt_ray.train.hf_convert import check_tp_size

    shape = LlamaShape.from_hf_dir(config.model.path)
    images = is_vision_model(config.model.path)
    for warning in unused_keys(config, images):
        log.warning("%s", warning)
    limits = {"min_pixels": config.data.min_pixels, "max_pixels": config.data.max_pixels}
    if images and shape.mrope_section is None and any(v is not None for v in limits.values()):
        raise ConfigError(
            f"data.min_pixels / data.max_pixels ({limits}) size Qwen VL images, but model.path="
            f"{config.model.path!r} is a LLaVA model, whose processor resizes every image to its tower's size: "
            "drop them"
        )
    if images and config.critic.enable:
        raise ConfigError(
            f"model.path={config.model.path!r} is a vision-language model, and the PPO critic reads text only; "
            "train it with a critic-free algorithm (algo.name=grpo, rloo, reinforce_pp or remax)"
        )
    check_tp_size(shape, config.train.tp_size)
    if config.critic.enable and config.critic.path:
        critic = LlamaShape.from_hf_dir(config.critic.path)
        check_tp_size(critic, config.train.tp_size)
        if critic.vocab_size != shape.vocab_size:
            raise ConfigError(
                f"critic.path={config.critic.path!r} has a vocabulary of {critic.vocab_size} tokens but the policy "
                f"has {shape.vocab_size}; the critic must read the policy's tokens (same tokenizer)"
            )
    if config.reward.mode != "rule":
        _check_judge(config)
    longest = config.data.max_prompt_tokens + config.rollout.max_new_tokens
    if longest > shape.max_positions:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.max_new_tokens = {longest} exceeds the model's "
            f"max_position_embeddings ({shape.max_positions}); lower one of them"
        )
    files = {"train": check_sources(config.data, min_rows=config.train.prompts_per_step, images=images)}
    if not demo:
        from yatt_ray.prompt_budget import check_prompt_budget

        for warning in demo_sizes(config):
            log.warning("%s", warning)
        log.info("%s", check_prompt_budget(config.data, files["train"], config.model.path))
    if config.reward.mode != "genrm" or config.reward.genrm.on_parse_error == "rule":  # the rule is used
        _, truth, source = first_row(config.data, files["train"])
        fn = resolve_reward_fn(config.reward.function)
        check_reward_fn(fn, config.reward.function, truth, source, config.reward.on_error)
    if config.data.eval_files:
        files["eval"] = check_sources(config.data, key="data.eval_files", images=images)
    return files


# what suits the demo's tiny model learning addition, and no real model: key -> (the test, the demo's value)
DEMO_SIZES = {
    "data.max_prompt_tokens": (lambda v: v <= 64, 16),
    "rollout.max_new_tokens": (lambda v: v <= 16, 6),
    "train.lr": (lambda v: v >= 1e-4, 5e-4),
}


def demo_sizes(config: Config) -> list[str]:
    """A line for each of `DEMO_SIZES` that your model and data run with at the demo's scale."""
    out = []
    for key, (demo_like, value) in DEMO_SIZES.items():
        section, name = key.split(".")
        have = getattr(getattr(config, section), name)
        if demo_like(have):
            out.append(
                f"{key}={have:g} is sized for the demo's tiny model (the demo runs {value:g}), and model.path="
                f"{config.model.path!r} is your own: set it for your task (e.g. data.max_prompt_tokens=512 "
                "rollout.max_new_tokens=1024 train.lr=1e-6; the recipes in docs/recipes.md are sized for 7B "
                "models)"
            )
    return out


def unused_keys(config: Config, images: bool) -> list[str]:
    """One line for each key set to something that does nothing in this run: `rollout.ordered` and
    `rollout.weight_transport` without engine actors, the image keys with a text policy (`images` false)."""
    r, d, out = config.rollout, config.data, []
    if not config.placement.rollout_engines:
        if r.ordered:
            out.append(
                "rollout.ordered=true has no effect: it orders requests on engine actors, and "
                "placement.rollout_engines=0 keeps each controller's engine in its own process; drop it, or set "
                "placement.mode=disaggregated placement.rollout_engines>=1"
            )
        if r.weight_transport != "auto":
            out.append(
                f"rollout.weight_transport={r.weight_transport} has no effect: it carries weights to engine actors, "
                "and with placement.rollout_engines=0 each engine takes them in memory from its trainer; drop it, "
                "or set placement.mode=disaggregated placement.rollout_engines>=1"
            )
    if not images:
        limits = {"min_pixels": d.min_pixels, "max_pixels": d.max_pixels, "max_images": d.max_images}
        for key, value in limits.items():
            if value is not None:
                out.append(
                    f"data.{key}={value} has no effect: model.path={config.model.path!r} is a text model, which "
                    "reads no images; drop it, or point model.path at a vision-language model"
                )
        if d.on_bad_image != "skip":
            out.append(
                f"data.on_bad_image={d.on_bad_image} has no effect: model.path={config.model.path!r} is a text "
                "model, which reads no images; drop it"
            )
    return out


# files a Hugging Face judge directory needs beside config.json: its weights and its tokenizer
JUDGE_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
JUDGE_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_judge(config: Config) -> None:
    """The GenRM judge must be a Hugging Face directory (a config.json that names its `model_type`, weights, a
    tokenizer) whose heads split over its accelerators: checked here, since the replicas that load it fail in
    Ray Serve with a message that names no key."""
    import json

    g = config.reward.genrm
    path = Path(g.path).expanduser() if g.path else None
    if path is None or not (path / "config.json").is_file():
        raise ConfigError(
            f"reward.mode={config.reward.mode!r} needs a judge: reward.genrm.path={g.path!r} is not a Hugging "
            "Face model directory (config.json). Point it at one, or use reward.mode=rule"
        )
    g.path = str(path.resolve())
    where = f"reward.genrm.path={g.path!r}"
    fix = (
        "point reward.genrm.path at a Hugging Face model directory (the judge saved with save_pretrained: "
        "config.json, its weights and its tokenizer), or use reward.mode=rule"
    )
    try:
        hf_config = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise ConfigError(f"{where}: its config.json is not valid JSON ({exc}); {fix}") from exc
    if not isinstance(hf_config, dict):
        kind = type(hf_config).__name__
        raise ConfigError(f"{where}: its config.json holds a {kind}, not a mapping; {fix}")
    if not hf_config.get("model_type"):
        raise ConfigError(
            f"{where}: its config.json has no 'model_type' key (keys: {sorted(hf_config) or 'none'}), so no "
            f"engine can tell which model the judge is; {fix}"
        )
    wanted = {"weights": JUDGE_WEIGHTS, "tokenizer": JUDGE_TOKENIZER}
    missing = [
        f"no {what} (none of {', '.join(patterns)})"
        for what, patterns in wanted.items()
        if not any(next(path.glob(p), None) is not None for p in patterns)
    ]
    if missing:
        raise ConfigError(f"{where} holds {' and '.join(missing)}, which the GenRM replicas load; {fix}")
    heads = hf_config.get("num_attention_heads", 1)
    if heads % g.accelerators_per_replica:
        raise ConfigError(
            f"reward.genrm.accelerators_per_replica={g.accelerators_per_replica} does not divide the judge's "
            f"{heads} attention heads; pick a divisor of {heads}"
        )


def _kernels(config: Config, cpus_per_worker: int) -> str:
    """The CPU kernels the workers will run and the matmul peak their MFU is measured against, measured here once
    per machine and shape (`train.kernel_timing`, `cpu_peak`): on a one-machine cluster the workers find
    the results in the cache; on others each machine measures its own."""
    from yatt_ray.train.kernel_timing import cpu_peak, kernels_for
    from yatt_ray.train.trainer_base import DTYPES

    choice = kernels_for(config.model.path, cpus_per_worker, config.train.dtype)
    if choice is None:
        return "kernels: CUDA"
    peak, _ = cpu_peak(choice.threads, DTYPES[config.train.dtype])  # the workers' MFU denominator, cached
    return f"{choice.describe()}; matmul peak {peak / 1e9:.0f} GFLOP/s"


def _model_sizes(config: Config):
    """Parameter counts and the policy's shape, for the placement plan's memory check."""
    from yatt_ray.placement import ModelSizes, param_count

    critic = param_count(config.critic.path or config.model.path) if config.critic.enable else 0
    judge = 0
    if config.reward.mode != "rule":
        try:
            judge = param_count(config.reward.genrm.path)
        except ConfigError:  # a judge of another architecture: the check counts the policy side only
            judge = 0
    from yatt_ray.model_shape import LlamaShape

    shape = LlamaShape.from_hf_dir(config.model.path)
    return ModelSizes(param_count(config.model.path), critic=critic, judge=judge, shape=shape)


# the GPU nodes of a cluster -> the probe's answer: the GiB of one of their GPUs, 0 without CUDA behind them
_GPU_MEMORY_GB: dict[tuple, float] = {}


def _gpu_memory_gb(plan, timeout_s: float) -> float:
    """GiB of memory of one of the cluster's GPUs: 0 without GPUs, or where the GPUs the plan claims have no
    CUDA behind them (a cluster may declare logical GPUs: the plan follows them, the workers compute on their
    CPUs). Asked once
    per set of GPU nodes in this process (the probe starts a worker process: 2 s a run on a 2-core machine)."""
    if not plan.uses_gpus:
        return 0.0
    import ray

    nodes = tuple(sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")))
    if nodes not in _GPU_MEMORY_GB:
        _GPU_MEMORY_GB[nodes] = _probe_gpus(plan, timeout_s)
    return _GPU_MEMORY_GB[nodes]


def _check_device_memory(config: Config, plan, sizes, read_gb: float) -> str:
    """The memory check on real GPUs (`placement.check_memory`), against placement.gpu_memory_gb or else
    `read_gb`, what the probe read from a device; returns the plan's memory line."""
    from yatt_ray.placement import check_memory

    have, where = config.placement.gpu_memory_gb, "placement.gpu_memory_gb"
    if have is None:
        have, where = read_gb, "read from a GPU"
    est = check_memory(plan, config, sizes, have)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in est.items())
    return f"  memory per GPU (GiB, estimated): {parts} of {have:.1f} ({where})"


def _probe_gpus(plan, timeout_s: float) -> float:
    import ray

    @ray.remote(num_gpus=plan.gpus_per_worker, num_cpus=0)
    def probe() -> float:
        import torch

        if not torch.cuda.is_available():
            return 0.0
        return torch.cuda.get_device_properties(0).total_memory / 2**30

    gib = float(ray.get(probe.remote(), timeout=timeout_s))
    if not gib:
        log.warning(
            "the cluster's GPUs have no CUDA behind them: placement follows them, compute runs on CPUs"
        )
    return gib


def _resolve_engine(config: Config, plan, on_gpu: bool) -> str:
    """Decide "auto" once, on the driver, so every controller and engine actor builds the same kind of engine
    (none measures again); returns the line the plan prints.

    On GPUs vLLM when installed; on CPU workers, where both engines can serve the model, the faster of the two
    timed at the run's rollout shape on this machine (`rollout.engine_choice`, cached per machine, model and
    shape), with the engine's threads: a controller's (the kernels' choice beside its trainer) or an engine
    actor's CPUs. With tensor parallelism the Hugging Face engine: only the controller rank hosts the engine,
    and vLLM creates its process groups collectively over every rank of the trainer's world. An explicit
    kind is only checked (installed, and the CPU engine can run the model).
    """
    from yatt_ray.rollout import auto_engine, resolve_engine_kind
    from yatt_ray.rollout.engine_choice import RolloutShape

    if config.rollout.engine != "auto":
        resolve_engine_kind(config.rollout.engine, config.model.path, on_gpu=on_gpu)
        return f"{config.rollout.engine} (rollout.engine={config.rollout.engine})"
    if config.train.tp_size > 1:
        config.rollout.engine = "hf"
        log.warning("rollout.engine=auto -> hf: the colocated vLLM engine needs train.tp_size=1")
        return "hf (auto: the colocated vLLM engine needs train.tp_size=1)"
    shape = None
    if not on_gpu:
        from yatt_ray.roles import engine_kwargs
        from yatt_ray.train.kernel_timing import kernels_for

        if plan.engines is not None:
            threads = plan.engines.cpus  # an engine actor's torch threads (`rollout.pool.EngineActor`)
        else:  # beside the trainer: the worker's threads as the kernels set them (measured, cached for them)
            kernels = kernels_for(config.model.path, plan.cpus_per_worker, config.train.dtype)
            threads = kernels.threads if kernels is not None else plan.cpus_per_worker
        shape = RolloutShape.of_run(config, plan, threads)
    kwargs = engine_kwargs(config, config.train.seed) if shape is not None else None
    choice = auto_engine(config.model.path, on_gpu, shape, kwargs)
    config.rollout.engine = choice.kind  # type: ignore[assignment]
    return choice.describe()


JUDGE_TEMPLATE_TOKENS = 48  # the judge template's own tokens, beside the prompt, response and answer it holds


def _resolve_judge_engine(config: Config, plan, on_gpu: bool) -> str:
    """`reward.genrm.engine=auto` decided once on the driver, as `_resolve_engine` decides the rollout's: on CPUs
    the faster engine timed at a judge call's shape, cached per machine, judge and shape; vLLM on GPUs and
    wherever the judge is split over accelerators (tensor parallelism is vLLM's). Returns the plan's line.

    A judge call: B verdicts of `max_new_tokens` greedy tokens after judge prompts of about the policy's prompt +
    response + `JUDGE_TEMPLATE_TOKENS` (at most `max_prompt_tokens`), on a replica's CPUs in an actor, where
    B = min(batch_size, a step's samples / replicas) in full placement (judged after the rollout) and
    min(batch_size, rollout.n) otherwise (samples streamed to the judges as each prompt's finish)."""
    from yatt_ray.reward.judge_replica import judge_engine_kwargs
    from yatt_ray.rollout import ENGINE_DTYPES, auto_engine, resolve_engine_kind
    from yatt_ray.rollout.engine_choice import RolloutShape

    g = config.reward.genrm
    if g.engine != "auto":
        resolve_engine_kind(g.engine, g.path, on_gpu=on_gpu)
        return f"{g.engine} (reward.genrm.engine={g.engine})"
    if g.accelerators_per_replica > 1:
        g.engine = "vllm"
        return "vllm (auto: a judge split over accelerators needs vLLM's tensor parallelism)"
    if plan.mode == "full":  # judged after the rollout: a step's samples spread over the replicas
        step = math.ceil(config.train.prompts_per_step * config.rollout.over_sample) * config.rollout.n
        batch = math.ceil(step / max(1, plan.genrm.replicas))
    else:  # streamed to the judges as generated: about one prompt's samples a batch
        batch = config.rollout.n
    answer = config.data.max_prompt_tokens + config.rollout.max_new_tokens + JUDGE_TEMPLATE_TOKENS
    shape = None
    if not on_gpu:
        shape = RolloutShape(
            prompts=max(1, min(g.batch_size, batch)),
            prompt_tokens=max(1, min(g.max_prompt_tokens, answer)),
            n=1,
            max_new_tokens=g.max_new_tokens,
            threads=int(plan.genrm.bundles()[0]["CPU"]),
            dtype=ENGINE_DTYPES[g.dtype],
            beside_trainer=False,  # a Serve replica: an actor of its own
        )
    kwargs = judge_engine_kwargs(g) if shape is not None else None  # the replica's engine, timed as built
    choice = auto_engine(g.path, on_gpu, shape, kwargs)
    g.engine = choice.kind  # type: ignore[assignment]
    return choice.describe()


def _check_checkpoints(config: Config, output_dir: Path) -> str:
    """Where checkpoints go, checked before any cluster work: the store takes a write and the checkpoint to
    resume from verifies (`checkpoint.driver.check_checkpoints`). Nothing with `checkpoint.enable=false`."""
    from yatt_ray.checkpoint.driver import check_checkpoints, resolve_checkpoint_dir
    from yatt_ray.data.sources import check_position

    if not config.checkpoint.enable:
        return "checkpoints: off (checkpoint.enable=false): no saves, no resume"
    resolve_checkpoint_dir(config, output_dir)
    return check_checkpoints(
        config,
        timeout_s=min(60.0, config.cluster.timeout_s),
        check_position=lambda position, where: check_position(position, config.data, where),
    )


def _run(
    config: Config, plan, files: dict[str, list[str]], real_gpus: bool, output_dir: Path, startup
) -> Result:
    """Start the run's actor, run, and end the actor whatever happened: a handle kept alive by a caller (an
    exception's traceback held in a notebook, pytest's record of a failure) would otherwise keep its process."""
    import ray

    from yatt_ray.run_control import start_run_actor

    control = start_run_actor()  # one actor holds both: the metrics hub and the run control
    try:
        return _follow(config, plan, files, real_gpus, output_dir, startup, control)
    finally:
        ray.kill(control, no_restart=True)


def _follow(
    config: Config, plan, files: dict[str, list[str]], real_gpus: bool, output_dir: Path, startup, control
) -> Result:
    """Start the services and the TorchTrainer, follow the run from the driver, and collect its Result."""
    import ray

    from yatt_ray.progress import DriverProgress
    from yatt_ray.run_control import StopOnSignal, StopRequested, abort_training

    if plan.genrm is not None:  # Ray Serve's import (~0.5 s of CPU while the workers start) only with a judge
        from yatt_ray.reward.service import deploy_genrm, shutdown_genrm

    hub = control
    engines = _start_engines(config, plan)
    actors = {"hub": hub, "control": control, "engines": engines}
    trainer = _trainer(config, plan, files, real_gpus, output_dir, actors)
    progress = DriverProgress(hub, config, output_dir, startup)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=_fit_into, args=(trainer, outcome), daemon=True)
    genrm_first = plan.genrm is not None and not (plan.mode != "disaggregated" and plan.uses_gpus)
    signals = StopOnSignal(control, config.checkpoint.on_sigterm)
    try:
        if genrm_first:  # disaggregated (or no GPUs): the judges are up before the first rollout
            deploy_genrm(config, plan, hub)
        startup.mark("trainer_launched")
        print(
            f"starting {plan.num_workers} training worker(s), their models, rollout engines and prompt streams "
            "(the closing report says how long the start took)",
            flush=True,
        )
        thread.start()
        if plan.genrm is not None and not genrm_first:
            _deploy_beside_trainers(config, plan, hub)
        while thread.is_alive():
            progress.poll()
            signals.poll()
            time.sleep(0.5)
        progress.poll()
    except KeyboardInterrupt:  # a second Ctrl-C: stop the workers too, then let it through
        abort_training()
        raise
    finally:
        signals.close()
        if plan.genrm is not None:
            shutdown_genrm()
        if engines is not None:
            from yatt_ray.rollout.pool import stop_engine_pool

            stop_engine_pool(engines)
        redone = progress.curve.redone
        if redone:
            log.warning("%d steps were redone after a restart; the metrics keep their last version", redone)
        progress.close()  # metrics so far are flushed and plotted even when the run fails
    fatal = ray.get(control.fatal.remote(), timeout=config.cluster.timeout_s)
    stopped = signals.reason
    if isinstance(fatal, StopRequested):  # the stop met the workers waiting for prompt rows: a stop, no error
        log.warning("%s", fatal)
        stopped = stopped or ray.get(control.stop_requested.remote(), timeout=config.cluster.timeout_s)
        outcome.pop("error", None)  # the attempt it ended failed on purpose (max_failures=0: the trainer too)
        fatal = None
    if fatal is not None:  # a deterministic error in a worker: raised once, with its type, never retried
        raise type(fatal)(f"{fatal} (raised in a training worker)")
    if "error" in outcome:
        raise _worker_error(outcome["error"]) from outcome["error"]
    checkpoint = outcome["result"].checkpoint if "result" in outcome else None
    final = None
    if (
        checkpoint is not None
    ):  # the final policy (and critic) in the run folder, where the next command looks
        url = report_url(checkpoint.path, config.checkpoint.dir)
        final = fetch_tree(f"{url}/policy_hf", Path(output_dir) / FINAL_HF, config.checkpoint.storage_options)
        if config.critic.enable:
            fetch_tree(f"{url}/critic", Path(output_dir) / "final_critic", config.checkpoint.storage_options)
    return Result(
        history=progress.history,
        checkpoint_path=final,
        output_dir=str(output_dir),
        checkpoint_dir=config.checkpoint.dir,
        steps_redone=redone,
        rollout_engine=config.rollout.engine,
        stopped=stopped,
        config=config,
    )


TRAIN_POLL_S = 0.5
# the final policy in the run folder: a Hugging Face directory (sharded past 5 GB); a critic beside it in
# final_critic (a LlamaForTokenClassification directory)
FINAL_HF = "final_hf"


def _start_engines(config: Config, plan):
    """Disaggregated rollout engines (`placement.rollout_engines`): the actors and their router, started before
    the trainers (None: each controller starts its engine in its own process)."""
    if plan.engines is None:
        return None
    from yatt_ray.roles import engine_kwargs
    from yatt_ray.rollout.pool import start_engine_pool

    print(f"starting {plan.engines.count} rollout engine actor(s)", flush=True)
    return start_engine_pool(
        config.rollout.engine,  # resolved to "vllm" or "hf"
        config.model.path,
        plan.engines.count,
        plan.engines.resources(),
        engine_kwargs(config, config.train.seed),
        config.rollout.weight_transport,
        config.rollout.ordered,
        config.rollout.weight_timeout_s,
        config.rollout.join_requests,
    )


def _trainer(
    config: Config, plan, files: dict[str, list[str]], real_gpus: bool, output_dir: Path, actors: dict
):
    """The TorchTrainer: one worker per plan slot, the training dataset (split by the workers), the eval file
    list and the run's actors (`hub` for metrics, `control` for stop requests) in the train-loop config."""
    import ray.data
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from yatt_ray.controller import train_loop_per_worker
    from yatt_ray.data import build_dataset
    from yatt_ray.model_dir import is_vision_model
    from yatt_ray.rendezvous import WorldConfig

    ray.data.DataContext.get_current().enable_progress_bars = False  # the driver shows one bar: the steps
    # Ray Train's controller looks at its workers every 2 s by default, so each run's end and each failed
    # worker waited up to 2 s to be seen; 0.5 s costs it a few cheap calls more. Ray Train passes the value
    # on to the controller; a value the user set stays.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(TRAIN_POLL_S))
    pixels = None
    if is_vision_model(config.model.path):  # images are decoded and processed in Ray Data tasks
        from yatt_ray.data.images import pixels_processor

        pixels = pixels_processor(config.model.path, config.data.min_pixels, config.data.max_pixels)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config.to_dict(),
            "train_dataset": build_dataset(config.data, files["train"], pixels),  # split in data/feed.py
            # the eval files (checked above): each controller reads its share itself (data/eval_rows.py)
            "eval_files": files.get("eval"),
            **actors,
        },
        # gloo for the controller's small CPU collectives (metrics, token counts), nccl for GPU tensors; the
        # rendezvous store on 127.0.0.1 when the cluster is there (rendezvous.py; a TorchConfig by duck typing,
        # whose module imports no torch in Ray Train's controller)
        torch_config=WorldConfig(backend="cpu:gloo,cuda:nccl" if real_gpus else "gloo"),  # type: ignore[arg-type]
        scaling_config=ScalingConfig(
            num_workers=plan.num_workers,
            use_gpu=plan.uses_gpus,
            resources_per_worker=plan.trainer_resources(),
            placement_strategy=config.cluster.placement_strategy,  # PACK or SPREAD over the nodes
        ),
        run_config=_run_config(config, output_dir),
    )


def _run_config(config: Config, output_dir: Path):
    """Ray Train's RunConfig: a run name of its own, storage every node reaches, retries, log level, and the
    workers' environment."""
    from ray.train import FailureConfig, LoggingConfig, RunConfig

    from yatt_ray.console import job_env_vars, train_log_level
    from yatt_ray.host_memory import cpu_env

    storage_path, storage_filesystem = train_storage(
        config.checkpoint.dir, config.checkpoint.storage_options, output_dir
    )
    # Ray Train v2's RunConfig at run time (ray.train picks it); mypy sees the v1 class without the last two
    return RunConfig(  # type: ignore[call-arg]
        # a name of its own per run: in a run folder used again (output.name) Ray Train would otherwise load
        # the earlier run's snapshot of reported checkpoints
        name=f"train-{time.strftime('%Y%m%d-%H%M%S')}",
        storage_path=storage_path,  # where every node reaches it (shared_storage.train_storage)
        storage_filesystem=storage_filesystem,
        failure_config=FailureConfig(max_failures=config.checkpoint.max_failures),
        logging_config=LoggingConfig(log_level=train_log_level(config.output.verbose)),
        # the quiet-console variables also where the job's runtime env could not carry them (ray.init
        # called before fit()), and the driver's cloud credentials and endpoints (AWS_*, HF_*)
        worker_runtime_env={"env_vars": {**cloud_env(), **job_env_vars(config.output.verbose), **cpu_env()}},
    )


def _deploy_beside_trainers(config: Config, plan, hub) -> None:
    """Full coexistence on GPUs: once the trainers hold their GPUs, each GenRM replica takes the share left
    beside one of them (GPUs nobody uses are fenced meanwhile)."""
    import ray

    from yatt_ray.reward.service import deploy_genrm, fence_free_gpus, wait_for_trainers

    wait_for_trainers(plan, config.cluster.timeout_s)
    fence = fence_free_gpus(plan)
    try:
        deploy_genrm(config, plan, hub)
    finally:
        if fence is not None:
            ray.util.remove_placement_group(fence)


def _fit_into(trainer, outcome: dict) -> None:
    try:
        outcome["result"] = trainer.fit()
    except Exception as exc:  # reported on the driver's thread
        outcome["error"] = exc


def _worker_error(exc: BaseException) -> YattError:
    """The library's own error raised in a worker (bad data, bad config) keeps its type on the driver.

    Ray Train wraps a worker's exception: `WorkerGroupError.worker_failures` maps ranks to it, inside a
    `UserExceptionWithTraceback` (`_base_exc`) or a `RayTaskError` (`cause`); causes chain as usual."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, YattError):
            return type(e)(f"{e} (raised in a training worker)")
        failures = getattr(e, "worker_failures", None)
        inner = [*(failures.values() if isinstance(failures, dict) else [])]
        inner += [getattr(e, "_base_exc", None), getattr(e, "cause", None), e.__cause__, e.__context__]
        todo += [x for x in inner if isinstance(x, BaseException)]
    return WorkerError(f"training failed in a worker: {exc}")


def _check_local_placement(config: Config) -> None:
    """Where this call will start a local cluster (no `cluster.address`, no RAY_ADDRESS, Ray not connected), the
    cluster's size is known before it starts: the CPUs `cluster.connect` will declare and the GPUs Ray will
    detect. The placement plan is checked against them here, so a plan that cannot fit (e.g.
    placement.rollout_engines=64 on two cores) is refused before Ray starts and before the run folder exists;
    `fit` checks it again on the cluster itself. Nothing is checked when the GPUs cannot be counted."""
    import ray

    from yatt_ray.cluster import _logical_cpus_needed, local_cores, resolve_cpus_per_worker
    from yatt_ray.placement import plan_placement

    if ray.is_initialized() or config.cluster.address or os.environ.get("RAY_ADDRESS"):
        return
    gpus = _local_gpus()
    if gpus is None:
        return
    trial = copy.deepcopy(config)  # as connect() resolves it, leaving the run's config to connect()
    resolve_cpus_per_worker(trial, local=True)
    cores = local_cores()
    cpus = max(cores, min(_logical_cpus_needed(trial), 4 * cores))  # what connect() declares
    plan_placement(trial, {"CPU": float(cpus), "GPU": float(gpus)})


def _local_gpus() -> int | None:
    """The GPUs a local Ray cluster started by this process will have (Ray's own count: the node's GPUs, at
    most those CUDA_VISIBLE_DEVICES shows), or None where Ray cannot say."""
    try:
        from ray._private import accelerators

        manager = accelerators.get_accelerator_manager_for_resource("GPU")
        if manager is None:
            return 0
        count = int(manager.get_current_node_num_accelerators())
        visible = manager.get_current_process_visible_accelerator_ids()
        return min(count, len(visible)) if visible is not None else count
    except Exception:  # noqa: BLE001  (another Ray: the check on the cluster itself still runs)
        return None


def _remove_if_empty(path: Path) -> None:
    """Remove the run folder `path` when it holds no file (only folders made on the way, if any)."""
    import shutil

    if path.is_dir() and not any(p.is_file() or p.is_symlink() for p in path.rglob("*")):
        shutil.rmtree(path, ignore_errors=True)


def _output_dir(config: Config) -> tuple[Path, str | None]:
    """The run's folder under `output.dir`: a fresh timestamped one per run (runs never mix their metrics or
    checkpoints), or `<output.dir>/<output.name>`, found again by the next run of that name. There the earlier
    run's metrics.jsonl is kept as metrics-<stamp>.jsonl (the new file holds the whole curve again: a run
    resumed from a checkpoint starts with the checkpoint's history). Returns (the local folder, None).

    With output.dir an fsspec URL the run folder is `<output.dir>/<output.name or stamp>` there: the driver
    writes a local mirror of it (`run_mirror`), uploaded when the run ends, and the checkpoints (by default in
    `<run folder>/checkpoints`) go to the URL directly. Returns (the mirror, the run folder's URL)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if "://" in config.output.dir:
        remote = f"{config.output.dir.rstrip('/')}/{config.output.name or stamp}"
        local = run_mirror(remote)
        local.mkdir(parents=True, exist_ok=True)
        (local / "metrics.jsonl").unlink(missing_ok=True)  # the run folder's own copy is kept aside instead
        keep_earlier_metrics(remote, stamp, config.checkpoint.storage_options)
        if not config.checkpoint.dir:
            config.checkpoint.dir = f"{remote}/checkpoints"
        return local, remote
    root = Path(config.output.dir).expanduser().resolve()
    if config.output.name:
        path = root / config.output.name
        path.mkdir(parents=True, exist_ok=True)
        earlier = path / "metrics.jsonl"
        if earlier.exists():
            earlier.rename(_free_name(path, f"metrics-{stamp}", ".jsonl"))
        return path, None
    path = _free_name(root, stamp, "")
    path.mkdir(parents=True)
    return path, None


def _free_name(folder: Path, stem: str, suffix: str) -> Path:
    """`folder/<stem><suffix>`, or `<stem>-1<suffix>`, `-2`, ... where that exists."""
    path, n = folder / f"{stem}{suffix}", 1
    while path.exists():
        path, n = folder / f"{stem}-{n}{suffix}", n + 1
    return path
