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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yatt_ray.errors import ConfigError

if TYPE_CHECKING:
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
