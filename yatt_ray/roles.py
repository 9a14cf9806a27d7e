"""What a group's loop drives, built once per worker: the trainers, and on controller ranks the rollout
engine, the scorer and the tokenizer.

`build_roles` makes the real ones (Megatron trainers, a vLLM or Hugging Face engine, the reward scorer) from
the worker's config; `GroupController` only receives them, so tests can inject fakes and run a step in one
process (tests/unit/test_controller.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from yatt_ray.config import Config
from yatt_ray.metrics.hub import HubLink

if TYPE_CHECKING:
    from yatt_ray.data.eval_rows import EvalRows
    from yatt_ray.rollout.base import RolloutEngine


@dataclass(frozen=True)
class Layout:
    """This worker's place: data-parallel group and rank within the tensor-parallel group."""

    rank: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int

    @property
    def is_controller(self) -> bool:
        return self.tp_rank == 0


def current_layout() -> Layout:
    """The layout of this process in Megatron's parallel state (initialised by the policy's construction)."""
    from megatron.core import parallel_state

    return Layout(
        rank=dist.get_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
    )


@dataclass
class Roles:
    """A worker's roles. `engine`, `scorer`, `tokenizer` and `reward_fn` exist on controller ranks only; the
    engine is attached after the prompt streams open (`GroupController.attach_engine`)."""

    policy: Any  # MegatronPolicy: log_probs, train_step, iter_hf_buckets, offload / onload, save_hf
    critic: Any | None  # MegatronCritic (PPO) or None
    hub: HubLink  # metrics rows and timeline spans to the driver
    engine: RolloutEngine | None = None
    scorer: Any | None = None  # RewardScorer
    tokenizer: Any | None = None  # the policy's Hugging Face tokenizer
    reward_fn: Callable | None = None  # the rule function (evaluation scores with it)
    eval_shard: EvalRows | None = None  # this group's share of the eval prompts (data/eval_rows.py), or None


def build_roles(
    config: Config, loop_config: dict, hub: HubLink, mark: Callable[[str], None] = lambda stage: None
) -> tuple[Layout, Roles]:
    """The real roles of this worker (collective: the policy's construction creates Megatron's TP / DP groups
    on Ray Train's process group). `mark(stage)` records start-up stages (`yatt_ray.metrics.startup`)."""
    from yatt_ray.console import quiet_worker

    quiet_worker(config.output.verbose)  # before Megatron and vLLM are imported
    from yatt_ray.train import MegatronCritic, MegatronPolicy, apply_cpu_shims
    from yatt_ray.train.kernel_timing import kernels_for
    from yatt_ray.train.kernels import apply_kernels
    from yatt_ray.train.megatron_import import import_megatron

    threads = max(1, config.cluster.cpus_per_worker or 1)  # resolved by the driver; the vLLM engine keeps it
    torch.set_num_threads(threads)
    apply_kernels(kernels_for(config.model.path, threads, config.train.dtype))  # cached by the driver's plan
    _register_perf_model(config, torch.get_num_threads())
    import_megatron()  # torch.compile deferred while it loads: 1.6 s less of imports per worker
    apply_cpu_shims()
    mark("peak_measured")
    t = config.train
    common: dict[str, Any] = {
        "tp_size": t.tp_size,
        "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip,
        "seed": t.seed,
        "dtype": t.dtype,
        "distributed_optimizer": t.distributed_optimizer,
        "recompute_activations": t.recompute_activations,
    }
    policy = MegatronPolicy(
        config.model.path,
        lr=t.lr,
        with_reference=config.algo.kl_coef > 0,
        train_vision=config.model.train_vision,
        **common,
    )
    critic = None
    if config.critic.enable:  # from critic.path, or the policy's trunk with a fresh scalar head
        critic = MegatronCritic(config.critic.path or config.model.path, lr=config.critic.lr, **common)
    mark("policy_built")
    layout = current_layout()
    roles = Roles(policy, critic, hub)
    if layout.is_controller:  # the engine comes later: `start_engine`
        _add_controller_roles(roles, config, layout, loop_config.get("eval_files"))
    return layout, roles


def _register_perf_model(config: Config, threads: int) -> None:
    """The model FLOPs and accelerator peak this worker's step metrics report MFU against (`perf/*`,
    `yatt_ray.metrics.flops`); on the CPU the peak is measured here once (~0.3 s of fp32 matmuls). The trainer
    runs in `train.dtype`."""
    from yatt_ray.metrics.flops import register_perf_model
    from yatt_ray.model_shape import LlamaShape
    from yatt_ray.train.kernel_timing import worker_perf_model

    shape = LlamaShape.from_hf_dir(config.model.path)
    from yatt_ray.train.trainer_base import DTYPES

    dtype = DTYPES[config.train.dtype]
    register_perf_model(worker_perf_model(shape, threads, config.cluster.peak_flops, dtype))


def _add_controller_roles(roles: Roles, config: Config, layout: Layout, eval_files: list[str] | None) -> None:
    from transformers import AutoTokenizer

    from yatt_ray.reward import resolve_reward_fn
    from yatt_ray.reward.scorer import RewardScorer

    roles.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    roles.reward_fn = resolve_reward_fn(config.reward.function)
    roles.scorer = RewardScorer(config.reward, connect_timeout_s=config.cluster.timeout_s)
    roles.eval_shard = eval_rows(config, layout, eval_files) if eval_files else None


def eval_rows(config: Config, layout: Layout, eval_files: list[str]) -> EvalRows:
    """This group's share of the eval files (`EvalRows`), read in the controller's process; a vision policy's
    images are decoded and processed there too, batch by batch, with the model's image processor."""
    from yatt_ray.data.eval_rows import EvalRows
    from yatt_ray.data.images import pixels_processor
    from yatt_ray.model_dir import is_vision_model

    pixels = None
    if is_vision_model(config.model.path):
        pixels = pixels_processor(config.model.path, config.data.min_pixels, config.data.max_pixels)
    return EvalRows(config.data, eval_files, layout.dp_rank, layout.dp_size, pixels)


def engine_kwargs(config: Config, seed: int) -> dict[str, Any]:
    """What every rollout engine of this run is built with (in-process or an engine actor)."""
    from yatt_ray.rollout import ENGINE_DTYPES

    return {
        "seed": seed,
        "dtype": ENGINE_DTYPES[config.train.dtype],  # the engine generates in the trainer's dtype
        "kv_cache_gb": config.rollout.kv_cache_gb,
        "gpu_memory_utilization": config.rollout.gpu_memory_utilization,  # vLLM on GPUs (kv_cache_gb null)
        "max_model_len": config.data.max_prompt_tokens + config.rollout.max_new_tokens,
    }


def start_engine(
    config: Config, layout: Layout, policy: Any = None, pool: Any = None, attempt: int = 1
) -> RolloutEngine:
    """The controller's rollout engine (a `RolloutEngine`), in the trainer's dtype. Started after the prompt
    streams opened, so Ray Data's first read runs while the engine loads (`yatt_ray.metrics.startup`).

    With engine actors (`pool`: the driver's `EngineHandles`), an `EnginePool` over them: data-parallel group
    0's controller pushes the weights, and with tp_size 1 any controller can push them to a restarted engine
    itself (`policy`'s buckets); `attempt` (the training function's start in this run) versions its pushes."""
    from yatt_ray.rollout import make_engine

    seed = config.train.seed + layout.dp_rank
    if pool is None:
        kind = config.rollout.engine  # resolved to "vllm" or "hf" by the driver
        return make_engine(kind, config.model.path, **engine_kwargs(config, seed))
    from yatt_ray.rollout.pool import EnginePool

    bucket_bytes = int(config.rollout.weight_sync_bucket_mb * 2**20)
    weights = None
    if config.train.tp_size == 1 and policy is not None:
        weights = lambda: policy.iter_hf_buckets(bucket_bytes)  # noqa: E731
    return EnginePool(
        pool, pusher=layout.dp_rank == 0, weights=weights, seed=seed, attempt=attempt, rank=layout.dp_rank
    )
