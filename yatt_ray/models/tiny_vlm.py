"""Build a tiny LLaVA-architecture vision-language model, saved as a normal Hugging Face directory.

The multimodal counterpart of `yatt_ray.models.tiny`: the text part is exactly the tiny Llama of that module
(same `TinyModelSpec`, same character tokenizer plus one `<image>` special token), the vision part a tiny CLIP
vision tower and LLaVA's two-layer MLP projector. The directory holds what a real LLaVA checkpoint holds:

    config.json, generation_config.json, model.safetensors   LlavaForConditionalGeneration
    tokenizer.json, tokenizer_config.json                    AutoTokenizer (the `<image>` token included)
    preprocessor_config.json                                 CLIPImageProcessor (resize, crop, normalise)
    processor_config.json                                    LlavaProcessor (expands `<image>` in text)

Image tokens. The tokenizer maps the placeholder `<image>` to `IMAGE_TOKEN_ID` (99: the first id after the 99
character-tokenizer ids; the model's vocabulary of 128 already has room, so only the tokenizer grows, from 99
to 100 tokens). Each image becomes `tokens_per_image(spec)` = (image_size / patch_size)^2 positions
(16 with the defaults: a 32x32 image in 8x8 patches): the prompt must hold that many consecutive
`IMAGE_TOKEN_ID`s per image (`yatt_ray.model_dir.expand_image_tokens`, or `LlavaProcessor`, does it).

Feature choices (written into config.json, read back by the trainer's `VisionEncoder` and by transformers):
- `vision_feature_select_strategy="default"`: drop CLIP's CLS token and keep the patch tokens. LLaVA-1.5 does
  the same; the CLS token is the summary trained for CLIP's contrastive head, the patch tokens keep the
  spatial layout, and the count stays a clean (image/patch)^2. "full" (CLS kept, one token more) is supported
  by the trainer side as well.
- `vision_feature_layer=-1`: the last encoder layer's output. LLaVA-1.5 takes the penultimate one (-2), but in
  a 2-layer tower that would leave a whole layer unused (parameters that never get a gradient); the trainer
  side supports any layer (and lists of layers), and the tests check -2 as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from yatt_ray.models.tiny import CHARACTERS, SPECIAL_TOKENS, TinyModelSpec, build_tokenizer, decoder_config

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = len(SPECIAL_TOKENS) + len(CHARACTERS)  # 99: the first id after the character tokenizer's
FEATURE_SELECT_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class TinyVLMSpec:
    """Sizes of the tiny LLaVA: `text` is the tiny Llama (`TinyModelSpec`, here with 256 positions so that a
    prompt holds a few images), the rest the CLIP vision tower and the projector (2 layers of
    vision_hidden_size -> text hidden -> text hidden, with `projector_act` between them)."""

    text: TinyModelSpec = field(default_factory=lambda: TinyModelSpec(max_positions=256))
    image_size: int = 32
    patch_size: int = 8
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_layers: int = 2
    vision_heads: int = 2  # head size 32
    vision_feature_layer: int | tuple[int, ...] = -1  # a tuple: those layers, concatenated channel-wise
    vision_feature_select_strategy: Literal["default", "full"] = "default"
    projector_act: str = "gelu"
    seed: int = 0


def tokens_per_image(spec: TinyVLMSpec | None = None) -> int:
    """Positions one image takes in the prompt: (image_size / patch_size)^2 patches, +1 with "full" (CLS)."""
    spec = spec or TinyVLMSpec()
    patches = (spec.image_size // spec.patch_size) ** 2
    return patches + (1 if spec.vision_feature_select_strategy == "full" else 0)


def build_vlm_tokenizer():
    """The tiny character tokenizer (`models.tiny.build_tokenizer`) with `<image>` added as special token 99."""
    from tokenizers import AddedToken

    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    got = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if got != IMAGE_TOKEN_ID:  # only if the base tokenizer changed size
        raise RuntimeError(f"{IMAGE_TOKEN} got id {got}, expected IMAGE_TOKEN_ID={IMAGE_TOKEN_ID}")
    return tokenizer


def build_image_processor(spec: TinyVLMSpec | None = None):
    """A `CLIPImageProcessor` (its PIL backend: no torchvision needed) for `spec.image_size` square images:
    resize the shortest edge, centre-crop, rescale to [0, 1], normalise with CLIP's mean / std."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    spec = spec or TinyVLMSpec()
    side = spec.image_size
    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _as_list(layers: int | tuple[int, ...]) -> list[int]:
    return [layers] if isinstance(layers, int) else list(layers)


def _check_spec(spec: TinyVLMSpec) -> None:
    problems = []
    needed = IMAGE_TOKEN_ID + 1
    if spec.text.vocab_size < needed:
        problems.append(
            f"text.vocab_size={spec.text.vocab_size} is below the {needed} tokens of the tokenizer"
        )
    if spec.image_size % spec.patch_size:
        problems.append(f"image_size={spec.image_size} is not a multiple of patch_size={spec.patch_size}")
    if spec.vision_feature_select_strategy not in FEATURE_SELECT_STRATEGIES:
        problems.append(
            f"vision_feature_select_strategy={spec.vision_feature_select_strategy!r} is not one of "
            f"{FEATURE_SELECT_STRATEGIES}"
        )
    layers = spec.vision_feature_layer
    if any(not -(spec.vision_layers + 1) <= k <= spec.vision_layers for k in _as_list(layers)):
        problems.append(
            f"vision_feature_layer={layers} is outside the tower's hidden states "
            f"[-{spec.vision_layers + 1}, {spec.vision_layers}]"
        )
    if problems:
        raise ValueError("invalid TinyVLMSpec: " + "; ".join(problems))


def llava_config(spec: TinyVLMSpec | None = None):
    """The `LlavaConfig` of the tiny VLM (fp32, untied unless `spec.text` ties them)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    spec = spec or TinyVLMSpec()
    _check_spec(spec)
    t = spec.text
    text = LlamaConfig(**decoder_config(t, extra_tokens=1), attention_bias=False, mlp_bias=False)
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=spec.image_size,
        patch_size=spec.patch_size,
        projection_dim=spec.vision_hidden_size,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=tokens_per_image(spec),
        projector_hidden_act=spec.projector_act,
        vision_feature_layer=(
            spec.vision_feature_layer
            if isinstance(spec.vision_feature_layer, int)
            else list(spec.vision_feature_layer)
        ),
        vision_feature_select_strategy=spec.vision_feature_select_strategy,
        multimodal_projector_bias=True,
        tie_word_embeddings=t.tie_word_embeddings,
        dtype="float32",
    )


def build_tiny_vlm(out_dir: str | Path, spec: TinyVLMSpec | None = None) -> Path:
    """Write a randomly initialised (seeded by `spec.seed`) tiny `LlavaForConditionalGeneration`, its
    tokenizer, image processor and processor to `out_dir`; return the path. The same spec writes the same
    weights."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    spec = spec or TinyVLMSpec()
    config = llava_config(spec)
    torch.manual_seed(spec.seed)
    model = LlavaForConditionalGeneration(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer, image_processor = build_vlm_tokenizer(), build_image_processor(spec)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)  # preprocessor_config.json
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=spec.patch_size,
        vision_feature_select_strategy=spec.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's CLS token, dropped again by the "default" strategy
        image_token=IMAGE_TOKEN,
    )
    processor.save_pretrained(out)
    return out
