"""The rollout-engine interface: what a controller asks of any generation engine.

Every engine (vLLM, Hugging Face `generate`) takes one `GenerateRequest` (prompts as token ids, a
`SamplingSpec`, images, long-tail abort: a plain picklable value) and returns, per prompt, `n` completions
with the log-probability of each generated token. The log-probabilities are *raw*: the log-softmax of the
model's logits at temperature 1, before temperature, top-p, top-k or any other logits processor, for the token
that was actually sampled. That is exactly what the trainer computes for "old" log-probs from the same
weights, so the two are comparable (rollout/trainer mismatch checks, importance ratios); a sampling
temperature other than 1 changes which tokens are drawn, never what `Completion.logprobs` means.

Weight sync contract (the same for every engine): `load_weights` is called one or more times with successive
buckets, each an iterable of `(hf_name, tensor)` pairs holding any subset of the model's parameters (names as in
the Hugging Face checkpoint, e.g. `model.layers.0.self_attn.q_proj.weight`). A bucket may split a fused
parameter group (q/k/v, gate/up) anywhere; the engine may hold such a group back until its last member arrives.
Then `finish_weight_sync()` ends the sync: afterwards the engine generates exactly as a model holding the new
weights. `generate`, `sleep` and `close` call `finish_weight_sync()` themselves when a sync is still open, so
calling it is optional, but calling it at the end of the push reports an incomplete push where it happened.
Engines copy what they keep, so the caller may reuse its bucket buffers as soon as `load_weights` returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from yatt_ray.batch import Pixels
from yatt_ray.errors import ConfigError, YattError

FinishReason = Literal["stop", "length"]
ENGINE_DTYPES = {
    "fp32": "float32",
    "bf16": "bfloat16",
}  # train.dtype / reward.genrm.dtype -> an engine's dtype
# per prompt: its images' `Pixels` (LLaVA: values [I, C, H, W]; Qwen VL: values [patches, 1176] and grid [I, 3]),
# or None for a text-only prompt
Images = list[Pixels | None]


@dataclass(frozen=True)
class SamplingSpec:
    """How to sample: `n` completions of at most `max_new_tokens` tokens per prompt.

    - `temperature`: 0 means greedy (argmax; `top_p` / `top_k` / `seed` are then irrelevant); > 0 divides the
      logits before sampling.
    - `top_p` in (0, 1] (1 = off); `top_k` = -1 (off) or >= 1.
    - `seed`: None draws from the engine's own random stream (seeded once by the engine's `seed`; it never
      touches the process-global torch RNG). An int makes the call reproducible on the same engine and
      weights; different prompts and different samples of one prompt still get different randomness.
      Engines of different kinds do not draw the same samples for the same seed.
    - `stop_token_ids`: extra ids that end a completion, besides the model's EOS id(s) (from the model
      directory's `generation_config.json` or `config.json`). The stop token is kept as the last token of
      the completion, with its log-prob.
    - `ignore_eos`: fixed-length generation (throughput runs): neither EOS nor `stop_token_ids` end a
      completion; every one has `max_new_tokens` tokens (fewer only at the engine's maximum model length) and
      finish_reason "length". An EOS can then be sampled mid-completion and the tokens after it are kept.
    """

    n: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n={self.n!r} must be an int >= 1 (completions per prompt)")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            problems.append(f"max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if not _is_real(self.temperature) or self.temperature < 0:
            problems.append(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or (self.top_k < 1 and self.top_k != -1)
        ):
            problems.append(f"top_k={self.top_k!r} must be -1 (off) or an int >= 1")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0
        ):
            problems.append(f"seed={self.seed!r} must be None or an int >= 0")
        stops = self.stop_token_ids
        if not isinstance(stops, tuple) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops
        ):
            problems.append(f"stop_token_ids={stops!r} must be a tuple of token ids (ints >= 0)")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos={self.ignore_eos!r} must be a bool")
        if problems:
            raise ConfigError("invalid SamplingSpec: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stops(self, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that end a completion: the model's EOS ids and `stop_token_ids`, in order without
        repeats; none with `ignore_eos`."""
        return () if self.ignore_eos else tuple(dict.fromkeys((*eos_token_ids, *self.stop_token_ids)))


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Completion:
    """One generated continuation of a prompt.

    - `token_ids`: the generated tokens only (no prompt), ending with the stop token when
      `finish_reason == "stop"`.
    - `logprobs[i]`: raw log-probability of `token_ids[i]`: `log_softmax(logits)[token_ids[i]]` of the model
      at temperature 1, without top-p / top-k / penalties, given the prompt and `token_ids[:i]`. Same
      length as `token_ids`.
    - `finish_reason`: "stop" (EOS or a `stop_token_ids` entry was generated) or "length"
      (`max_new_tokens`, or the engine's maximum model length, was reached).
    - `versions[i]`: the label of the weights that sampled `token_ids[i]`, where the engine tracks it (engine
      actors: their weight version, which can change within a completion when new weights arrive in flight);
      None where one set of weights produced the whole call.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason = field(default="length")
    versions: list[Any] | None = None


OnFinished = Callable[[int, list[Completion]], None]  # (prompt index, its completions)


class InFlightWeights(Protocol):
    """New weights an engine may take while a request runs (engine actors hand one to `generate`)."""

    def ready(self) -> bool:
        """Whether new weights are waiting."""
        ...

    def take(self) -> Any:
        """Load the waiting weights into the engine now (no forward runs); return their version label."""
        ...


@dataclass(frozen=True)
class GenerateRequest:
    """What to generate: per prompt (token ids, BOS included) `spec.n` completions.

    - `prompts`: token ids with BOS already included; none may be empty, and
      `len(prompt) + spec.max_new_tokens` must fit the engine's maximum model length (the engine checks this,
      and the vocabulary).
    - `images` (vision-language models): one entry per prompt, its images' `batch.Pixels` (the model's image
      processor's output: LLaVA pixel_values [I, 3, H, W]; Qwen2-VL / 2.5-VL pixel_values [patches, C*tp*p*p]
      with image_grid_thw [I, 3]; I = 0 for a prompt without images) or None; each image's tokens are already
      expanded in the prompt. Every sample of a prompt sees its images.
    - `finish_after=k` (long-tail control; 1 <= k <= len(prompts)): as soon as at least k prompts have all
      their `spec.n` samples finished ("stop" or "length"), the engine aborts every unfinished request and
      returns. Finished prompts keep their completions (more than k when several finish in the same engine
      step: all are kept, the caller chooses); each aborted prompt's entry is `None`, and the engine's
      `last_aborted` counts them. The engine holds no leftover requests afterwards: the next call starts
      clean. With None (the default) every prompt runs to the end.
    - `wait_for` (prompt indices, with `finish_after` only): prompts the engine never aborts; it stops once k
      are finished *and* these are.

    Construction checks what needs no engine facts (`ConfigError` naming the value); the engine checks the
    rest (model length, vocabulary, image tokens).
    """

    prompts: list[list[int]]
    spec: SamplingSpec
    images: Images | None = None
    finish_after: int | None = None
    wait_for: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.spec, SamplingSpec):
            raise ConfigError(f"spec must be a SamplingSpec, got {type(self.spec).__name__}")
        if not isinstance(self.prompts, list | tuple):
            raise ConfigError(f"prompts must be a list of token-id lists, got {type(self.prompts).__name__}")
        self._check_images()
        self._check_finish_after()

    def _check_images(self) -> None:
        images = self.images
        if images is not None and (not isinstance(images, list | tuple) or len(images) != len(self.prompts)):
            got = len(images) if isinstance(images, list | tuple) else type(images).__name__
            raise ConfigError(
                f"images must be a list with one entry (Pixels or None) per prompt: {len(self.prompts)} "
                f"prompts, images {got}"
            )

    def _check_finish_after(self) -> None:
        finish_after, num_prompts, wait_for = self.finish_after, len(self.prompts), self.wait_for
        if wait_for and (
            finish_after is None or not all(isinstance(i, int) and 0 <= i < num_prompts for i in wait_for)
        ):
            raise ConfigError(
                f"wait_for={sorted(wait_for)!r} must hold prompt indices in [0, {num_prompts}) and come with "
                "finish_after (prompts the engine does not abort)"
            )
        if finish_after is not None and (
            isinstance(finish_after, bool)
            or not isinstance(finish_after, int)
            or not 1 <= finish_after <= num_prompts
        ):
            raise ConfigError(
                f"finish_after={finish_after!r} must be None or an int in [1, {num_prompts}] (the number of "
                "prompts): how many prompts must finish before the rest are aborted"
            )


def complete(results: list[list[Completion] | None]) -> list[list[Completion]]:
    """`generate`'s results when nothing may have been aborted (no `finish_after`): every prompt's group."""
    missing = [i for i, group in enumerate(results) if group is None]
    if missing:
        raise YattError(
            f"prompts {missing[:5]} were aborted (None): complete() is for the results of a request without "
            "finish_after; read a finish_after request's results as they are, None for each aborted prompt"
        )
    return [group for group in results if group is not None]


@dataclass
class Generation:
    """A request left running on engines outside the controller's process (`RolloutEngine.submit`): its
    sub-requests (`pending`: {Ray ref: (engine, its prompt indices)}), and per prompt its results and the
    weight version that produced them (`RolloutEngine.age` tells how old)."""

    request: GenerateRequest
    costs: list[int]
    results: list[list[Completion] | None]
    versions: list[Any]
    pending: dict[Any, tuple[int, list[int]]] = field(default_factory=dict)
    avoid: set[int] = field(default_factory=set)  # stale engines this controller cannot refresh


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout collector drives: an engine in the controller's process (`HFEngine`, `VLLMEngine`) or
    the engine actors of a disaggregated placement (`rollout.pool.EnginePool`). See the module docstring for
    the contracts. Its shape:

        generate(request, on_finished=None) -> [per prompt: n Completions, or None if aborted]
        load_weights(bucket); finish_weight_sync()       weight sync, bucket by bucket
        sleep() -> bytes released; wake(); close()
        rng_state() -> dict; set_rng_state(dict)          the sampling stream, for checkpoints
        takes_image_features: bool                        images as the policy's features (vLLM), not pixels
        take_stats() -> {metric: value}                   counters since the last call ({} in process)
        asynchronous: bool                                requests may be left running (engine actors):
            submit(request) -> Generation                 send, return at once
            wait(generation, on_finished=None) -> [as generate]
            age(version) -> int                           pushes since the weights of a `Completion.versions` /
                                                          `Generation.versions` label

    An engine in the controller's process generates inside the caller's call: it is not `asynchronous`, and
    its `submit`, `wait` and `age` raise (`InProcessEngine`). Asynchronous rollout (`rollout.max_staleness` >
    0) needs an asynchronous engine.
    """

    last_aborted: int  # prompts aborted (returned as None) by the latest `generate` call

    @property
    def asynchronous(self) -> bool:
        """Whether `submit` / `wait` / `age` work: requests run outside the caller's call (engine actors)."""
        ...

    @property
    def takes_image_features(self) -> bool:
        """Whether `request.images` must carry the policy's image features (`Pixels.features`), not pixels."""
        ...

    def generate(
        self, request: GenerateRequest, on_finished: OnFinished | None = None
    ) -> list[list[Completion] | None]:
        """Outer list: one entry per prompt, in order (None only for a prompt aborted under
        `request.finish_after`; `complete()` types the results of a request without it); inner list:
        `spec.n` completions. `last_aborted` counts the Nones (0 without `finish_after`).

        `on_finished(prompt_index, completions)`, when given, is called as soon as a prompt's samples are
        all done (in completion order, which may differ from prompt order), for finished prompts only:
        partial coexistence sends them to the GenRM while the rest still generate. It is a local callback,
        not part of the request. The returned list is the same either way.

        Raises `ConfigError` for a request this engine cannot serve (a prompt over its maximum model length,
        token ids outside its vocabulary, images for a model that takes none) and `DataError` for a prompt
        whose image tokens disagree with its images.
        """
        ...

    def submit(self, request: GenerateRequest) -> Generation:
        """Send `request` and return at once (`asynchronous` engines only); `wait` gathers it."""
        ...

    def wait(
        self, generation: Generation, on_finished: OnFinished | None = None
    ) -> list[list[Completion] | None]:
        """The results of a submitted request, as `generate` returns them; each prompt's weight version lands
        in `generation.versions`."""
        ...

    def age(self, version: Any) -> int:
        """Weight pushes between the weights labelled `version` and the ones the caller holds (its staleness)."""
        ...

    def take_stats(self) -> dict[str, float]:
        """The engine's counters since the previous call (metric name -> value), then reset."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take one bucket of new weights (Hugging Face names); see the module docstring."""
        ...

    def finish_weight_sync(self) -> None:
        """End a weight sync; raises if a fused parameter group was pushed only in part."""
        ...

    def sleep(self) -> int:
        """Release what memory the engine can until `wake()` (weights are kept); returns the bytes released."""
        ...

    def wake(self) -> None:
        """Undo `sleep()`; generation afterwards is identical to generation before it."""
        ...

    def close(self) -> None:
        """Free the engine; idempotent. The object is unusable afterwards."""
        ...

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        """The position of the engine's own sampling stream (`PrivateRng.state_dict`), for checkpoints."""
        ...

    def set_rng_state(self, state: dict[str, torch.Tensor | None]) -> None:
        """Continue the sampling stream from a `rng_state()` (a resumed run samples as the uninterrupted one)."""
        ...


class InProcessEngine:
    """The asynchronous half of `RolloutEngine` for an engine in the caller's process, which has none:
    `generate` runs the request inside the call. Base class of `HFEngine` and `VLLMEngine`."""

    asynchronous = False

    def submit(self, request: GenerateRequest) -> Generation:
        raise self._not_asynchronous("submit")

    def wait(
        self, generation: Generation, on_finished: OnFinished | None = None
    ) -> list[list[Completion] | None]:
        raise self._not_asynchronous("wait")

    def age(self, version: Any) -> int:
        raise self._not_asynchronous("age")

    def take_stats(self) -> dict[str, float]:
        return {}

    def _not_asynchronous(self, method: str) -> YattError:
        return YattError(
            f"{type(self).__name__}.{method}: an engine in the controller's process generates inside `generate` "
            "and leaves nothing running; asynchronous rollout (rollout.max_staleness > 0) needs engine actors "
            "(placement.mode=disaggregated, placement.rollout_engines >= 1)"
        )


def validate_prompts(
    prompts: list[list[int]], spec: SamplingSpec, max_model_len: int, vocab_size: int
) -> None:
    """Shared prompt checks against the engine's limits, raising `ConfigError` with the offending index and
    values (a `GenerateRequest` has checked the types)."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ConfigError(f"prompt {i} is empty: prompts must hold at least the BOS token id")
        total = len(prompt) + spec.max_new_tokens
        if total > max_model_len:
            raise ConfigError(
                f"prompt {i} has {len(prompt)} tokens + max_new_tokens={spec.max_new_tokens} = {total}, over "
                f"the engine's max_model_len={max_model_len}: shorten the prompt or lower max_new_tokens"
            )
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(f"prompt {i} holds token ids outside [0, {vocab_size}): {bad[:5]}")
    bad_stops = [t for t in spec.stop_token_ids if t >= vocab_size]
    if bad_stops:
        raise ConfigError(f"stop_token_ids {bad_stops} are outside the vocabulary [0, {vocab_size})")


def read_eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """EOS id(s) of a Hugging Face model directory: `generation_config.json` first, then `config.json`."""
    import json
    from pathlib import Path

    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            continue
        return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
    return ()


class PrivateRng:
    """A random stream of the engine's own, so generation neither reads nor moves the global torch RNG.

    Sampling code (vLLM's sampler, `transformers.generate`) draws from the process-global generators, which a
    colocated trainer uses too (dropout, data order). `active()` swaps this stream's state in for the call and
    the caller's state back afterwards: unseeded calls continue this stream (and so differ from call to
    call); a call with a seed runs on a fresh stream from that seed and leaves this stream where it was.
    Covers the CPU generator and, when `cuda_device` is given, that CUDA device's generator.
    """

    def __init__(self, seed: int, cuda_device: int | None = None) -> None:
        self._cuda_device = cuda_device
        if cuda_device is not None:
            torch.cuda.init()  # default_generators is empty until CUDA is initialised
        self._cpu_state, self._cuda_state = self._fresh(seed)

    def _fresh(self, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if self._cuda_device is not None:
            gen = torch.cuda.default_generators[self._cuda_device]
            saved = gen.get_state()
            gen.manual_seed(seed)
            cuda = gen.get_state()
            gen.set_state(saved)
        return cpu, cuda

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """The stream's position: {"cpu": ByteTensor, "cuda": ByteTensor or None} (copies; checkpoints hold it)."""
        cuda = None if self._cuda_state is None else self._cuda_state.clone()
        return {"cpu": self._cpu_state.clone(), "cuda": cuda}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        """Continue from a `state_dict` (its CUDA state only where both streams have one)."""
        cpu, cuda = state["cpu"], state.get("cuda")
        assert cpu is not None, "a PrivateRng state always holds the CPU generator's"
        self._cpu_state = cpu.clone()
        if cuda is not None and self._cuda_state is not None:
            self._cuda_state = cuda.clone()

    @contextmanager
    def active(self, seed: int | None = None) -> Iterator[None]:
        saved_cpu = torch.get_rng_state()
        gen = None if self._cuda_device is None else torch.cuda.default_generators[self._cuda_device]
        saved_cuda = None if gen is None else gen.get_state()
        cpu, cuda = (self._cpu_state, self._cuda_state) if seed is None else self._fresh(seed)
        torch.set_rng_state(cpu)
        if gen is not None and cuda is not None:
            gen.set_state(cuda)
        try:
            yield
        finally:
            if seed is None:
                self._cpu_state = torch.get_rng_state()
                self._cuda_state = None if gen is None else gen.get_state()
            torch.set_rng_state(saved_cpu)
            if gen is not None and saved_cuda is not None:
                gen.set_state(saved_cuda)


def derive_seed(seed: int, *indices: int) -> int:
    """A well-mixed 31-bit seed from `seed` and indices (prompt, sample, chunk), so streams do not overlap."""
    x = seed & 0xFFFFFFFFFFFFFFFF
    for i in (*indices, len(indices)):
        x = (x ^ ((i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFF
