"""A rollout engine on Hugging Face `transformers.generate`: the stand-in where vLLM is absent.

Slower than vLLM (no paged KV cache, no continuous batching: each batch runs until its longest row is done),
but it has no native dependencies, runs on any device torch supports, and is the reference the vLLM engine is
tested against. Semantics follow `yatt_ray.rollout.base`:

- prompts of different lengths are left-padded into one batch (`n` rows per prompt), with an attention mask;
- sampling: temperature 0 = greedy, else logits / temperature, then top-k, then top-p (HF's order);
  the model directory's own generation defaults (repetition penalty, min_p, ...) are ignored so that both
  engines sample the same distribution;
- log-probs: `log_softmax` (float32) of the raw logits HF hands back with `output_logits=True`
  (before temperature and warpers), gathered at the sampled tokens;
- weight sync: every bucket is copied straight into the model's parameters (no fusion, so no holding back);
- sleep / wake: on a GPU the model moves to host memory and back; on the CPU both are no-ops;
- images (a LLaVA model, `LlavaForConditionalGeneration`, or a Qwen2-VL / Qwen2.5-VL model,
  `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration`): `GenerateRequest.images` (Pixels
  or None per prompt); the prompts hold the expanded image tokens (`prompts.PromptEncoder`), and a batch's
  images go to HF `generate` as one `pixel_values` tensor in row order (Qwen VL: and `image_grid_thw` in the
  same order), which is the order the model puts their features into the image-token positions. The image
  token is never sampled. Weight sync takes LLaVA checkpoint names (either layout) and the language model's
  `LlamaForCausalLM` names (`model.layers.0...`, as the Megatron trainer exports them); for Qwen VL the
  checkpoint names (`model.*` the language model under `Qwen2ForCausalLM` names, `lm_head.weight`,
  `visual.*`).
- Qwen VL's multimodal RoPE on a left-padded batch: transformers (5.x) computes each row's M-RoPE positions
  (`get_rope_index`) inside `generate` only when it gets `mm_token_type_ids` ([B, L] int: 1 at image tokens,
  0 at text and padding) beside `attention_mask` (`get_rope_index` drops the left padding by it, so each row's
  positions start at 0 at its first real token) and `image_grid_thw`; without `mm_token_type_ids` it silently
  falls back to 1-D text positions. The engine passes all three. Each generated token then takes the row's
  last position + 1 on all three axes, as `train.qwen_vl.mrope_positions` gives the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import StoppingCriteria

from yatt_ray.batch import Pixels
from yatt_ray.errors import ConfigError, DataError, YattError
from yatt_ray.model_dir import check_image_count, check_image_runs
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
    SamplingSpec,
    derive_seed,
    read_eos_token_ids,
    validate_prompts,
)
from yatt_ray.rollout.decode import sample_groups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine(InProcessEngine):
    """`RolloutEngine` on `transformers` `AutoModelForCausalLM.generate` (`LlavaForConditionalGeneration`
    for a LLaVA directory, `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` for a Qwen
    VL one, which then also take images).

    Args:
        model_dir: a Hugging Face model directory (config, safetensors; the tokenizer is not needed).
        seed: seeds the engine's private random stream (the global torch RNG is never touched).
        device: "cpu", "cuda" or "cuda:N"; None picks "cuda" when available, else "cpu".
        dtype: "float32" | "bfloat16" | "float16".
        max_model_len: longest prompt + completion; default the model's `max_position_embeddings`.
        max_batch_size: most rows (prompt x sample) run at once; None = all rows of a call in one batch.
    """

    def __init__(
        self,
        model_dir: str | Path,
        seed: int = 0,
        device: str | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"HFEngine dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ConfigError(f"HFEngine max_batch_size={max_batch_size} must be >= 1 or None")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = torch.device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"HFEngine device={device!r} but torch sees no CUDA device: use device='cpu'")
        self.model_dir = str(model_dir)
        self.image_token_id: int | None = None  # set for a vision-language model
        self.tokens_per_image: int | None = None  # LLaVA: tokens of one image
        self.merge: int | None = None  # Qwen VL: spatial_merge_size (an image takes t*h*w / merge^2 tokens)
        self._pixel_shape: tuple[int, ...] | None = None  # a pixel row: LLaVA (C, H, W), Qwen VL (C*tp*p*p,)
        self._rename: Callable[[str], str] | None = None  # weight-sync name map (vision-language models)
        model = self._load_model(dtype)
        model.requires_grad_(False)
        model.to(self._device)  # type: ignore[arg-type]  # transformers types `to` oddly
        self._model = model.eval()
        self._read_text_config(model.config.get_text_config(), max_model_len)
        self._max_batch_size = max_batch_size
        cuda_index = None
        if self._device.type == "cuda":
            cuda_index = self._device.index if self._device.index is not None else torch.cuda.current_device()
        self._rng = PrivateRng(seed, cuda_index)
        self._asleep = False
        self._closed = False
        self.last_aborted = 0  # prompts returned as None by the latest generate (finish_after)

    def _load_model(self, dtype: str) -> Any:
        """The model of `model_dir` in `dtype`: LLaVA's or Qwen VL's conditional-generation class for a
        vision-language directory (its image facts set here: the image token, LLaVA's tokens per image or Qwen's
        merge size, a pixel row's shape, the weight-sync name map), else the causal LM."""
        from transformers import AutoModelForCausalLM

        from yatt_ray.model_dir import is_qwen_vl

        config_json = _read_config(self.model_dir)
        if config_json.get("model_type") == "llava":
            from transformers import LlavaForConditionalGeneration

            from yatt_ray.model_dir import image_shape, image_token_id, llava_module_name, tokens_per_image

            model: Any = LlavaForConditionalGeneration.from_pretrained(self.model_dir, dtype=_DTYPES[dtype])
            self.image_token_id = image_token_id(model.config)
            self.tokens_per_image = tokens_per_image(model.config)
            self._pixel_shape = image_shape(model.config)
            self._rename = llava_module_name  # checkpoint / Llama names -> the model's state_dict names
        elif is_qwen_vl(config_json):
            import transformers

            model = getattr(transformers, _qwen_vl_class(config_json)).from_pretrained(
                self.model_dir, dtype=_DTYPES[dtype]
            )
            vision = model.config.vision_config
            self.image_token_id = int(model.config.image_token_id)
            self.merge = int(vision.spatial_merge_size)
            self._pixel_shape = (
                int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2,
            )
            self._rename = qwen_vl_module_name
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=_DTYPES[dtype])
        return model

    def _read_text_config(self, cfg: Any, max_model_len: int | None) -> None:
        """The language model's limits and special tokens (vocabulary, longest sequence, EOS ids, pad id) from
        its text config `cfg`, and a generation config of those alone."""
        from transformers import GenerationConfig

        self.vocab_size: int = cfg.vocab_size
        self.max_model_len: int = int(max_model_len or cfg.max_position_embeddings)
        self.eos_token_ids: tuple[int, ...] = read_eos_token_ids(self.model_dir) or (
            (cfg.eos_token_id,) if isinstance(cfg.eos_token_id, int) else tuple(cfg.eos_token_id or ())
        )
        pad = cfg.pad_token_id
        self._pad_id: int = (
            int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        )
        # Drop the checkpoint's generation defaults: only what SamplingSpec says may shape sampling. No EOS here
        # either: `generate` fills an unset eos_token_id from it, and each call names its stop ids itself.
        self._model.generation_config = GenerationConfig(
            bos_token_id=cfg.bos_token_id, pad_token_id=self._pad_id
        )

    takes_image_features = False  # it takes pixels (`request.images`) and runs the vision tower itself

    @property
    def in_flight_updates(self) -> bool:
        """Whether `generate` takes new weights between decode steps (`updates`): text models."""
        return self.image_token_id is None

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        request: GenerateRequest,
        on_finished: OnFinished | None = None,
        updates: InFlightWeights | None = None,
        version: Any = None,
    ) -> list[list[Completion] | None]:
        """Batches of up to `max_batch_size` rows; `on_finished` gets each prompt whose samples are done.

        With `request.finish_after=k`, a batch's `generate` ends as soon as k prompts are complete (counting
        those of earlier batches) and so are those of `wait_for` it holds, later batches are skipped once no
        `wait_for` prompt is left in them, and prompts with an unfinished row are None.

        `request.images` (vision-language models only): one entry per prompt, that prompt's `Pixels` (the
        image processor's output, images in the order of their image-token runs in the prompt; I_k = 0 images
        for a prompt without any) or None for a text-only prompt. Every sample of the prompt sees its images.
        - LLaVA: values [I_k, C, H, W], grid None; the prompt holds exactly I_k * `tokens_per_image` image
          tokens (`image_token_id`), already expanded.
        - Qwen2-VL / 2.5-VL: values [sum_k t*h*w, C*tp*p*p] (every image's patch rows in turn), grid [I_k, 3]
          (`image_grid_thw`: t, h, w in patches); image k is one run of exactly t*h*w / `merge`^2 image
          tokens (`<|image_pad|>`, between `<|vision_start|>` and `<|vision_end|>`).
        A prompt whose image tokens disagree with its images raises DataError naming the prompt.

        `updates` / `version` (text models only, `in_flight_updates`): new weights taken in flight, between
        decode steps, each completion's tokens labelled with the weights that sampled them
        (`decode.sample_groups`); ignored for vision-language models, whose weights change between calls.
        """
        self._check_usable("generate")
        validate_prompts(request.prompts, request.spec, self.max_model_len, self.vocab_size)
        per_prompt = self._check_images(request.prompts, request.images)
        if self._asleep:
            raise YattError("HFEngine.generate called while asleep: call wake() first")
        self.last_aborted = 0
        if self.image_token_id is None:  # text models: each prompt prefilled once, finished rows dropped
            groups = self._sample_text(request, on_finished, updates, version)
        else:
            groups = self._sample_images(request, per_prompt, on_finished)
        self.last_aborted = groups.count(None)
        return groups

    def _sample_images(
        self, request: GenerateRequest, per_prompt: Images, on_finished: OnFinished | None
    ) -> list[list[Completion] | None]:
        """`generate` for a vision-language model through HF `generate`, in batches of up to
        `max_batch_size` rows (prompt x sample) with their prompts' images, batch k seeded with
        `derive_seed(seed, k)`; with `finish_after`, each batch stops early once enough prompts are complete
        (`_GroupsDone`) and later batches are skipped."""
        prompts, spec = request.prompts, request.spec
        finish_after, wait_for = request.finish_after, request.wait_for
        n = spec.n
        rows = [prompt for prompt in prompts for _ in range(n)]
        row_images = [pixels for pixels in per_prompt for _ in range(n)]
        size = self._max_batch_size or max(len(rows), 1)
        stops = spec.stops(self.eos_token_ids)
        done: list[Completion] = []  # rows so far, in order
        groups: list[list[Completion] | None] = [None] * len(prompts)
        complete = 0
        for chunk_index, start in enumerate(range(0, len(rows), size)):
            waiting = any(groups[i] is None for i in wait_for)
            if finish_after is not None and complete >= finish_after and not waiting:
                break
            seed = None if spec.seed is None else derive_seed(spec.seed, chunk_index)
            stopper = None
            if finish_after is not None:  # completed per batch with its prompt width
                stopper = partial(_GroupsDone, start, len(rows), n, finish_after, stops, wait_for)
            batch = slice(start, start + size)
            done.extend(self._generate_batch(rows[batch], spec, seed, stopper, row_images[batch]))
            for i in range(start // n, len(done) // n):  # prompts whose rows are all in by now
                group = done[i * n : (i + 1) * n]
                if groups[i] is None and (finish_after is None or all(_finished(c, spec) for c in group)):
                    groups[i] = group
                    complete += 1
                    if on_finished is not None:
                        on_finished(i, group)
        return groups

    def _sample_text(
        self, request: GenerateRequest, on_finished: OnFinished | None, updates: InFlightWeights | None,
        version: Any,
    ) -> list[list[Completion] | None]:  # fmt: skip
        """`generate` for a text model through `decode.sample_groups`, in chunks of whole prompts (up to
        `max_batch_size` rows, at least one prompt), chunk k seeded with `derive_seed(seed, k)`."""
        prompts, spec, wait_for = request.prompts, request.spec, request.wait_for
        groups: list[list[Completion] | None] = [None] * len(prompts)
        per_chunk = max(1, (self._max_batch_size or len(prompts) * spec.n) // spec.n)

        def enough() -> bool:
            if request.finish_after is None:
                return False
            complete = len(groups) - groups.count(None)
            return complete >= request.finish_after and all(groups[i] is not None for i in wait_for)

        for chunk_index, start in enumerate(range(0, len(prompts), per_chunk)):
            if enough():
                break

            def on_group(i: int, group: list[Completion], start: int = start) -> None:
                groups[start + i] = group
                if on_finished is not None:
                    on_finished(start + i, group)

            seed = None if spec.seed is None else derive_seed(spec.seed, chunk_index)

            with self._rng.active(seed):
                _, version = sample_groups(
                    self._model, prompts[start : start + per_chunk], spec, spec.stops(self.eos_token_ids),
                    self._pad_id, on_group, enough, updates, version,
                )  # fmt: skip
        return groups

    def _generate_batch(
        self,
        rows: list[list[int]],
        spec: SamplingSpec,
        seed: int | None,
        stopper: Callable[[int], StoppingCriteria] | None = None,
        row_images: Images | None = None,
    ) -> list[Completion]:
        """One `model.generate` over `rows`. `stopper(prompt_width)`, when given, makes a stopping criterion
        that may end it early, leaving some rows unfinished (cut short: neither a stop token nor
        `max_new_tokens` tokens). `row_images[i]`: row i's `Pixels` or None; the batch's images go to the
        model concatenated in row order (pixel_values [sum P_i, *S]; Qwen VL: image_grid_thw [sum I_i, 3] too,
        with `mm_token_type_ids` [rows, width] for its M-RoPE positions), as its image tokens come row by
        row."""
        from transformers import StoppingCriteriaList

        if not rows:
            return []
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
        stops = spec.stops(self.eos_token_ids)
        extra = self._image_inputs(input_ids, attention_mask, row_images)
        with self._rng.active(seed), torch.no_grad():
            out = self._model.generate(
                input_ids=input_ids.to(self._device),
                attention_mask=attention_mask.to(self._device),
                generation_config=self._generation_config(spec, stops),
                stopping_criteria=None if stopper is None else StoppingCriteriaList([stopper(width)]),
                **extra,
            )
        tokens = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, vocab], raw (pre-processor)
        logprobs = (
            torch.log_softmax(logits, dim=-1).gather(-1, tokens.to(logits.device)[..., None])[..., 0].cpu()
        )
        stop_set = set(stops)
        completions = []
        for i in range(len(rows)):
            ids = tokens[i].tolist()
            end = next((j for j, t in enumerate(ids) if t in stop_set), None)
            reason: FinishReason = "length" if end is None else "stop"
            length = len(ids) if end is None else end + 1
            completions.append(Completion(ids[:length], logprobs[i, :length].tolist(), reason))
        return completions

    def _generation_config(self, spec: SamplingSpec, stops: tuple[int, ...]) -> Any:
        """HF's `GenerationConfig` for `spec`: sampling (or greedy), the stop ids, raw logits returned; the
        image token suppressed (never sampled)."""
        from transformers import GenerationConfig

        sampling = {}
        if not spec.greedy:
            sampling = {
                "temperature": float(spec.temperature),
                "top_p": float(spec.top_p),
                "top_k": 0 if spec.top_k == -1 else spec.top_k,
            }
        return GenerationConfig(
            max_new_tokens=spec.max_new_tokens,
            min_new_tokens=0,
            do_sample=not spec.greedy,
            num_beams=1,
            eos_token_id=list(stops) or None,
            pad_token_id=self._pad_id,
            output_logits=True,
            return_dict_in_generate=True,
            # a LLaVA model never samples its image token: the trainer puts image features at those places
            suppress_tokens=None if self.image_token_id is None else [self.image_token_id],
            **sampling,
        )

    def _image_inputs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_images: Images | None
    ) -> dict[str, torch.Tensor]:
        """The image inputs of a batch (`_generate_batch`): its rows' pixels concatenated in row order, and for
        Qwen VL the image-token map and the images' grids (see the module docstring); {} for a text batch."""
        pixels = [p for p in (row_images or ()) if p is not None and p.count]
        extra: dict[str, torch.Tensor] = {}
        if pixels:
            values = torch.cat([p.values for p in pixels])
            extra["pixel_values"] = values.to(self._device, self._model.dtype)
        if self.merge is not None and self.image_token_id is not None:  # Qwen VL: see the module docstring
            image_tokens = input_ids.eq(self.image_token_id) & attention_mask.bool()
            extra["mm_token_type_ids"] = image_tokens.int().to(self._device)
            if pixels:
                grids = [p.grid for p in pixels if p.grid is not None]
                extra["image_grid_thw"] = torch.cat(grids).long().to(self._device)
        return extra

    def _check_images(self, prompts: list[list[int]], images: Images | None) -> Images:
        """A request's `images` (one entry per prompt, or None) checked against the prompts (see
        `generate`) -> one entry per prompt (None = none)."""
        if images is None:
            images = [None] * len(prompts)
        given = [i for i, p in enumerate(images) if p is not None]
        if self.image_token_id is None or self._pixel_shape is None:
            if given:
                arch = type(self._model).__name__
                raise ConfigError(
                    f"HFEngine: prompt(s) {given[:5]} come with images, but the model in {self.model_dir!r} is "
                    f"a text-only {arch}: use a LLaVA (LlavaForConditionalGeneration) or Qwen2-VL / "
                    "Qwen2.5-VL model directory, or drop the images"
                )
            return list(images)
        for i, (prompt, pixels) in enumerate(zip(prompts, images)):
            if pixels is not None:
                self._check_pixels(i, pixels, self._pixel_shape)
            try:
                if self.merge is not None:
                    check_image_runs(prompt, pixels, self.image_token_id, self.merge)
                else:
                    count = 0 if pixels is None else pixels.count
                    check_image_count(prompt, count, self.image_token_id, self.tokens_per_image or 0)
            except DataError as e:
                raise DataError(f"prompt {i}: {e}") from None
        return list(images)

    def _check_pixels(self, i: int, pixels: object, pixel_shape: tuple[int, ...]) -> None:
        """ConfigError unless `pixels` (images[i]) is a `Pixels` of this model's kind, its rows of
        `pixel_shape`; DataError when a Qwen VL grid does not make as many patches as there are rows."""
        qwen = self.merge is not None
        shape = f"[patches, {pixel_shape[0]}]" if qwen else "[I, {}, {}, {}]".format(*pixel_shape)
        if not isinstance(pixels, Pixels):
            raise ConfigError(
                f"images[{i}] is a {type(pixels).__name__}; each entry must be a yatt_ray.batch.Pixels (values "
                f"{shape}{' and grid [I, 3]' if qwen else ''}, the image processor's output) or None: wrap "
                "bare pixel_values as "
                + ("Pixels(values, grid=image_grid_thw)" if qwen else "Pixels(values)")
            )
        values, grid = pixels.values, pixels.grid
        if not isinstance(values, torch.Tensor) or tuple(values.shape[1:]) != pixel_shape:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ConfigError(
                f"images[{i}] has shape {got}; the model takes pixel_values {shape}: the output of the model "
                f"directory's image processor (a prompt without images: None or 0 rows, as "
                "prompts.PromptEncoder gives it)"
            )
        if not qwen:
            if grid is not None:
                raise ConfigError(
                    f"images[{i}] has an image grid {tuple(grid.shape)}, but the model in {self.model_dir!r} is a "
                    "LLaVA model (one pixel row per image, no grid): pass Pixels(values) from its processor"
                )
            return
        if grid is None or grid.dim() != 2 or grid.shape[1] != 3 or grid.dtype.is_floating_point:
            desc = "None" if grid is None else f"{tuple(grid.shape)} {grid.dtype}"
            raise ConfigError(
                f"images[{i}] has grid {desc}; a Qwen VL model needs image_grid_thw [I, 3] (integer t, h, w "
                "patches per image, from its image processor; [0, 3] for a prompt without images)"
            )
        patches = int(grid.long().prod(-1).sum())
        if len(values) != patches:
            raise DataError(
                f"images[{i}] has {len(values)} pixel rows but its image_grid_thw {grid.tolist()} makes "
                f"{patches} patches: pass pixel_values and image_grid_thw from the same processor call"
            )

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a bucket into the model's parameters (names as in `model.state_dict()`; for a LLaVA model
        also as in its checkpoint and, for the language model, as in `LlamaForCausalLM`: see
        `model_dir.llava_module_name`; for a Qwen VL model also as in its checkpoint: see
        `qwen_vl_module_name`)."""
        self._check_usable("load_weights")
        targets = self._model.state_dict(keep_vars=True)
        rename = self._rename
        unknown = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None and rename is not None:
                    target = targets.get(rename(name))
                if target is None:
                    unknown.append(name)
                    continue
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ConfigError(
                        f"HFEngine.load_weights: {name} has shape {tuple(tensor.shape)}, the model expects "
                        f"{tuple(target.shape)}: the trainer's export and the engine's model do not match"
                    )
                target.copy_(tensor)
        if unknown:
            raise ConfigError(
                f"HFEngine.load_weights: {len(unknown)} name(s) are not parameters of the model, e.g. "
                f"{unknown[:3]}; expected Hugging Face names such as {next(iter(targets))!r}"
            )

    def finish_weight_sync(self) -> None:
        """Nothing to do: every bucket is applied as it arrives."""
        self._check_usable("finish_weight_sync")

    # ------------------------------------------------------------------ memory
    def sleep(self) -> int:
        """On a GPU, move the model to host memory and empty the CUDA cache; on the CPU, nothing. Returns the
        bytes of weights moved off the device."""
        self._check_usable("sleep")
        freed = 0
        if self._device.type == "cuda" and not self._asleep:
            freed = sum(p.numel() * p.element_size() for p in self._model.parameters())
            self._model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True
        return freed

    def wake(self) -> None:
        self._check_usable("wake")
        if self._device.type == "cuda" and self._asleep:
            self._model.to(self._device)
        self._asleep = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._model
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        """The sampling stream's position (checkpoints save it; see `RolloutEngine.rng_state`)."""
        return self._rng.state_dict()

    def set_rng_state(self, state: dict[str, torch.Tensor | None]) -> None:
        self._rng.load_state_dict(state)

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise YattError(f"HFEngine.{what} called after close(): make a new engine")

    def __repr__(self) -> str:
        return f"HFEngine({self.model_dir!r}, device={self._device}, max_model_len={self.max_model_len})"


def _read_config(model_dir: str) -> dict:
    """`model_dir/config.json` parsed, or {} without one (`from_pretrained` then names what is missing)."""
    import json

    config = Path(model_dir) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _qwen_vl_class(config: dict) -> str:
    """The transformers class name of a Qwen VL config.json (by model_type, else by architectures)."""
    from yatt_ray.model_dir import QWEN_VL_TYPES as MODEL_TYPES

    name = MODEL_TYPES.get(config.get("model_type", ""))
    return name or next(a for a in config.get("architectures") or [] if a in MODEL_TYPES.values())


def qwen_vl_module_name(name: str) -> str:
    """The `Qwen2VLForConditionalGeneration` / `Qwen2_5_VLForConditionalGeneration` `state_dict()` name
    (transformers 5) of a weight named as in the checkpoint on disk: `model.*` (the language model under
    `Qwen2ForCausalLM` names) -> `model.language_model.*`, `visual.*` -> `model.visual.*`, `lm_head.*` and
    names already in the in-memory layout unchanged (`train.qwen_vl` documents both layouts)."""
    if name.startswith(("model.language_model.", "model.visual.", "lm_head.")):
        return name
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


def _finished(completion: Completion, spec: SamplingSpec) -> bool:
    """Whether a row ran to its end: a stop token, or all `max_new_tokens` (prompts are validated to fit)."""
    return completion.finish_reason == "stop" or len(completion.token_ids) == spec.max_new_tokens


class _GroupsDone(StoppingCriteria):
    """Ends a batch's `generate` once `k` prompts, and every prompt of `wait_for`, have all `n` rows finished.

    The batch holds rows `[start, start + batch)` of the call's `total` rows (prompt-major, `n` per prompt),
    left-padded to `width` prompt tokens: rows before it ran in earlier, complete batches (so they count as
    finished), rows after it have not started. A row of the batch is finished once it generated a stop token;
    reaching `max_new_tokens` ends the whole batch anyway. Tensor ops only, so no device sync per step.
    """

    def __init__(
        self,
        start: int,
        total: int,
        n: int,
        k: int,
        stops: tuple[int, ...],
        wait_for: frozenset[int],
        width: int,
    ) -> None:
        self.start, self.total, self.n, self.k, self.width = start, total, n, k, width
        self.stops = torch.tensor(stops, dtype=torch.long)
        self.wait_for = torch.tensor(sorted(wait_for), dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        batch = input_ids.shape[0]
        stopped = torch.isin(input_ids[:, self.width :], self.stops.to(input_ids.device)).any(dim=1)
        rows = torch.zeros(self.total, dtype=torch.bool, device=input_ids.device)
        rows[: self.start] = True
        rows[self.start : self.start + batch] = stopped
        done = rows.view(-1, self.n).all(dim=1)
        enough = (done.sum() >= self.k) & done[self.wait_for.to(done.device)].all()
        return enough.expand(batch)  # type: ignore[return-value]


if TYPE_CHECKING:
    _SHAPE: type[RolloutEngine] = HFEngine  # mypy checks that the engine has the protocol's shape
