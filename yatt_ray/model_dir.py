"""Facts about a Hugging Face model directory, read from its config.json: what the driver, the data path, the
rollout engines and the trainer all need to know, in one place (`rollout/` and `train/` both import it).

- `read_config(path)`: config.json as a dict (cached per file and modification time);
- `is_vision_model(path)`: a vision-language model (a `vision_config` beside the language model's);
- `is_qwen_vl(cfg)`, `qwen_vl_config(config)`: Qwen2-VL / Qwen2.5-VL and transformers' config for it;
- `llava_config(config)`, `image_token_id`, `image_shape`, `tokens_per_image`: LLaVA's;
- `ImageLayout.from_model_dir(path)`: how a vision-language policy reads an image (its image token, the shape
  of a pixel row, the tokens an image takes), the same for the prompt encoder, the engines and the trainer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yatt_ray.errors import ConfigError, DataError

if TYPE_CHECKING:
    import torch

    from yatt_ray.batch import Pixels

IMAGE_PLACEHOLDER = "<image>"  # the data's placeholder (yatt_ray.data.images); LLaVA's image token's text


def read_config(path: str | Path) -> dict:
    """`<path>/config.json` as a dict (a fresh copy each call); ConfigError naming the path when it has none."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"{str(path)!r} has no config.json: point it at a Hugging Face model directory")
    return json.loads(_read(str(file), file.stat().st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _read(file: str, mtime_ns: int) -> str:
    return Path(file).read_text()


def is_vision_model(path: str | Path) -> bool:
    """True when `<path>/config.json` is a vision-language model (LLaVA, Qwen2-VL, Qwen2.5-VL: a
    `vision_config` beside the language model's); the policy then reads images. False without config.json."""
    return (Path(path) / "config.json").is_file() and "vision_config" in read_config(path)


# ---------------------------------------------------------------------------------------------- Qwen VL
QWEN_VL_TYPES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def is_qwen_vl(cfg: dict) -> bool:
    """Whether a parsed config.json is a Qwen2-VL / Qwen2.5-VL model."""
    arch = cfg.get("architectures") or []
    return cfg.get("model_type") in QWEN_VL_TYPES or any(a in QWEN_VL_TYPES.values() for a in arch)


def qwen_vl_config(config: Any):
    """A transformers `Qwen2VLConfig` / `Qwen2_5_VLConfig` from a config dict, a config, or a model directory."""
    import transformers

    if isinstance(config, (str, Path)):
        config = read_config(config)
    if not isinstance(config, dict):
        return config
    kind = config.get("model_type")
    if kind not in QWEN_VL_TYPES:
        raise ConfigError(f"model_type={kind!r} is not one of the Qwen VL types {list(QWEN_VL_TYPES)}")
    cls = transformers.Qwen2VLConfig if kind == "qwen2_vl" else transformers.Qwen2_5_VLConfig
    return cls(**{k: v for k, v in config.items() if k != "model_type"})


def text_config_dict(cfg: dict) -> tuple[dict, tuple[int, int, int]]:
    """A Qwen VL config.json dict -> (its language model as a plain `qwen2` config dict, mrope_section).

    Reads both layouts: transformers 5's `text_config`, and the older flat one (text keys at the top level,
    `rope_scaling: {"type": "mrope", "mrope_section": [...]}`) that hub checkpoints were saved with."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if section is None or len(section) != 3:
        raise ConfigError(
            f"a {cfg.get('model_type')} config without a 3-part rope mrope_section ({rope}); the checkpoint's "
            "config.json should carry text_config.rope_parameters.mrope_section (e.g. [16, 24, 24])"
        )
    theta = float(rope.get("rope_theta") or text.get("rope_theta") or 1000000.0)
    text.pop("rope_scaling", None)
    text.update(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
    )
    return text, (int(section[0]), int(section[1]), int(section[2]))


# ---------------------------------------------------------------------------------------------- LLaVA
def llava_config(config: Any):
    """A transformers `LlavaConfig` from a parsed config.json dict, a `LlavaConfig`, or a model directory."""
    from transformers import LlavaConfig

    if isinstance(config, LlavaConfig):
        return config
    if isinstance(config, str | Path):
        path = Path(config) / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{str(config)!r} has no config.json: point it at a LLaVA Hugging Face directory"
            )
        config = json.loads(path.read_text())
    if not isinstance(config, dict) or config.get("model_type") != "llava":
        got = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise ConfigError(
            f"model_type={got!r} is not 'llava': the vision trainer supports LlavaForConditionalGeneration "
            "checkpoints (CLIP-style vision tower + MLP projector + Llama)"
        )
    return LlavaConfig.from_dict(config)


def image_token_id(config: Any) -> int:
    """The id of the image token (`image_token_index` in config.json)."""
    return int(llava_config(config).image_token_id)


def image_shape(config: Any) -> tuple[int, int, int]:
    """(channels, height, width) of the pixel_values the vision tower takes (square images)."""
    vision = llava_config(config).vision_config
    return int(vision.num_channels), int(vision.image_size), int(vision.image_size)


def tokens_per_image(config: Any) -> int:
    """Positions one image takes: (image_size / patch_size)^2 patch tokens, +1 (CLS) with strategy "full"."""
    cfg = llava_config(config)
    vision = cfg.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return patches + (1 if cfg.vision_feature_select_strategy == "full" else 0)


def llava_module_name(name: str) -> str:
    """The `LlavaForConditionalGeneration.state_dict()` name (transformers 5) of a weight named as in a
    checkpoint (either layout, hub `vision_tower.vision_model.*` included) or as in `LlamaForCausalLM`
    (`model.layers.0...` -> `model.language_model.layers.0...`): what an engine needs for a weight sync."""
    renames = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.vision_model.", "model.vision_tower."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    )
    if name.startswith(("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")):
        return name
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    if name.startswith("model."):  # a Llama name: the language model's body
        return "model.language_model." + name[len("model.") :]
    return name  # lm_head.* and anything else: unchanged


# ---------------------------------------------------------------------------------------------- images
@dataclass(frozen=True)
class ImageLayout:
    """How a vision-language policy reads an image: the id of its image token, the shape S of one row of its
    pixel values, and how many tokens an image takes.

    LLaVA: `tokens_per_image` fixed, S = (C, H, W) (one row per image), `<image>` is one token of its
    tokenizer. Qwen2-VL / 2.5-VL (`merge` > 1): an image of grid (t, h, w) takes t*h*w / merge^2 tokens,
    S = (C * temporal_patch * patch^2,) (one row per patch), and `<image>` becomes
    `<|vision_start|><|image_pad|><|vision_end|>` (`placeholder`) before tokenizing, as Qwen's chat
    processor and verl do, the pad then expanded to the image's tokens."""

    token_id: int
    pixel_shape: tuple[int, ...]
    tokens_per_image: int = 0  # LLaVA
    merge: int = 1  # Qwen VL's spatial_merge_size
    placeholder: str = IMAGE_PLACEHOLDER  # the text an image stands as when tokenized

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ImageLayout | None:
        """From `<path>/config.json`: None for a text model (or no config.json: the driver checked the model)."""
        if not is_vision_model(path):
            return None
        cfg = read_config(path)
        if is_qwen_vl(cfg):
            config = qwen_vl_config(cfg)
            vision = config.vision_config
            row = int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
            tokenizer_tokens = "<|vision_start|><|image_pad|><|vision_end|>"
            return cls(int(config.image_token_id), (row,), merge=int(vision.spatial_merge_size),
                       placeholder=tokenizer_tokens)  # fmt: skip
        config = llava_config(path)
        return cls(image_token_id(config), image_shape(config), tokens_per_image(config))

    def image_tokens(self, pixels: Pixels) -> list[int]:
        """Tokens of each of `pixels`' images."""
        if pixels.grid is None:
            return [self.tokens_per_image] * pixels.count
        return (pixels.grid.prod(-1) // self.merge**2).tolist()


# ---------------------------------------------------------------------------------------------- image tokens
def image_token_runs(ids: Sequence[int] | torch.Tensor, image_token_id: int) -> list[int]:
    """The lengths of the runs of `image_token_id` in `ids`, in order (an image's tokens are consecutive: a
    LLaVA image one run of `tokens_per_image`, or several images back to back one longer run; a Qwen VL image
    one run of its own between `<|vision_start|>` and `<|vision_end|>`)."""
    seq = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    runs: list[int] = []
    for i, t in enumerate(seq):
        if t == image_token_id:
            if i > 0 and seq[i - 1] == image_token_id:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


def expand_image_tokens(
    ids: list[int], image_token_id: int, tokens_per_image: int | list[int], num_images: int | None = None
) -> list[int]:
    """Each `image_token_id` in `ids` (one placeholder per image) becomes `tokens_per_image` copies, as
    transformers' `LlavaProcessor` expands `<image>` (a list: image k's own count, as Qwen VL's processor
    expands `<|image_pad|>` by its grid); other ids are kept in order.

    len(result) = len(ids) + (tokens_per_image - 1) * ids.count(image_token_id). With `num_images`, first
    checks that the placeholders number exactly `num_images` (DataError otherwise), which also catches ids
    that were expanded already.
    """
    if isinstance(tokens_per_image, list):
        counts = tokens_per_image
        num_images = len(counts)
    else:
        counts = [tokens_per_image] * ids.count(image_token_id)
    if any(c < 1 for c in counts):
        raise ConfigError(f"tokens_per_image={tokens_per_image} must be >= 1")
    if num_images is not None:
        check_image_count(ids, num_images, image_token_id, tokens_per_image=1)
    out: list[int] = []
    image = iter(counts)
    for t in ids:
        out.extend([t] * next(image) if t == image_token_id else (t,))
    return out


def check_image_count(
    ids: Sequence[int] | torch.Tensor, num_images: int, image_token_id: int, tokens_per_image: int
) -> None:
    """Raise DataError unless `ids` hold exactly `num_images * tokens_per_image` image tokens, in runs whose
    lengths are multiples of `tokens_per_image` (an image's tokens are consecutive).

    `tokens_per_image=1` checks placeholders before `expand_image_tokens`; the model's value checks the
    expanded ids that the engine and the trainer see.
    """
    runs = image_token_runs(ids, image_token_id)
    found = sum(runs)
    what = "placeholders" if tokens_per_image == 1 else f"image tokens ({tokens_per_image} per image)"
    if found != num_images * tokens_per_image:
        raise DataError(
            f"the prompt holds {found} {what} (id {image_token_id}) but {num_images} image(s) came with it, "
            f"which need {num_images * tokens_per_image}: put one `<image>` per image in the prompt text, and "
            "expand the ids once (expand_image_tokens) before generation and training"
        )
    bad = [r for r in runs if r % tokens_per_image]
    if bad:
        raise DataError(
            f"image-token runs of lengths {bad} are not multiples of tokens_per_image={tokens_per_image}: an "
            "image's tokens were cut (a prompt clipped inside an image?); clip prompts outside image tokens"
        )


def check_image_runs(prompt: list[int], pixels: Pixels | None, image_token_id: int, merge: int) -> None:
    """DataError unless the runs of `image_token_id` in `prompt` are, in order, one per image of
    `pixels.grid` [I, 3], of t*h*w / merge^2 tokens each (h and w multiples of `merge`)."""
    runs = image_token_runs(prompt, image_token_id)
    grids = [] if pixels is None or pixels.grid is None else pixels.grid.long().tolist()
    odd = [g for g in grids if g[1] % merge or g[2] % merge]
    if odd:
        raise DataError(
            f"image grid(s) {odd} (t, h, w patches) are not multiples of the merge size {merge} in h and w: "
            "pass image_grid_thw from the model's own image processor"
        )
    need = [t * h * w // merge**2 for t, h, w in grids]
    if runs != need:
        raise DataError(
            f"the prompt holds image-token runs (id {image_token_id}) of {runs} tokens ({sum(runs)} in all), "
            f"but its {len(grids)} image(s) of grid {grids} need runs of {need} (t*h*w / {merge}^2 each, "
            f"{sum(need)} in all): put one image placeholder per image in the prompt, expand each to its "
            "image's tokens (prompts.PromptEncoder does) and pass the pixels and grid of those same images"
        )
