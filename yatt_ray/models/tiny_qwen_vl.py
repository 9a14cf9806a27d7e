"""Build a tiny Qwen2-VL or Qwen2.5-VL model, saved as a normal Hugging Face directory.

The Qwen counterpart of `tiny_vlm` (LLaVA): the language model is a tiny Qwen2 decoder (q/k/v biases) with
multimodal RoPE, the vision part transformers' Qwen vision transformer and its patch merger. The directory
holds what a hub checkpoint (Qwen/Qwen2.5-VL-3B-Instruct and its relatives) holds:

    config.json, generation_config.json, model.safetensors   Qwen2VLForConditionalGeneration /
                                                             Qwen2_5_VLForConditionalGeneration
    tokenizer.json, tokenizer_config.json                    the character tokenizer + Qwen's vision tokens
    preprocessor_config.json                                 Qwen2VLImageProcessor (min/max pixels, 14 px
                                                             patches, 2x2 merge, 2 temporal patches)

Image tokens. An image of H x W pixels (after the processor's resize to multiples of 28 within min/max pixels)
is (H/14) x (W/14) patches of 3 x 2 x 14 x 14 = 1176 values (`pixel_values` rows) and (H/28) x (W/28) tokens
after the 2x2 merge: `<|vision_start|>` then that many `<|image_pad|>` then `<|vision_end|>` in the prompt.
With the defaults (56..112 px a side) an image is 4 to 16 tokens. The ids follow the 99 character ids:
`<|vision_start|>` 99, `<|vision_end|>` 100, `<|image_pad|>` 101, `<|video_pad|>` 102, inside the 128-id
vocabulary. Norm weights and biases are drawn at random (std 0.1-0.2 around transformers' init) so a
conversion that drops one changes the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from yatt_ray.models.families import randomize_norms_and_biases
from yatt_ray.models.tiny import CHARACTERS, SPECIAL_TOKENS, TinyModelSpec, build_tokenizer, decoder_config

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN_VL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
FIRST_ID = len(SPECIAL_TOKENS) + len(CHARACTERS)  # 99
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = range(FIRST_ID, FIRST_ID + 4)
PATCH, MERGE, TEMPORAL = 14, 2, 2
Variant = Literal["qwen2_vl", "qwen2_5_vl"]
VARIANTS: tuple[Variant, ...] = ("qwen2_vl", "qwen2_5_vl")


@dataclass(frozen=True)
class TinyQwenVLSpec:
    """Sizes of the tiny Qwen VL: `text` the decoder (hidden 128, 4 heads of 32: M-RoPE sections
    `mrope_section` of the 16 frequency pairs for time, height, width), the rest the vision transformer."""

    variant: Variant = "qwen2_5_vl"
    text: TinyModelSpec = field(default_factory=lambda: TinyModelSpec(max_positions=256))
    mrope_section: tuple[int, int, int] = (4, 6, 6)
    vision_hidden_size: int = 64
    vision_intermediate_size: int = 128
    vision_layers: int = 2
    vision_heads: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    tie_word_embeddings: bool = True
    seed: int = 0


def build_qwen_vl_tokenizer():
    """The character tokenizer with Qwen's vision tokens added as special tokens 99-102."""
    from tokenizers import AddedToken

    tokenizer = build_tokenizer()
    tokens = [AddedToken(t, special=True, normalized=False) for t in QWEN_VL_TOKENS]
    tokenizer.add_tokens(tokens, special_tokens=True)
    got = tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    if got != list(range(FIRST_ID, FIRST_ID + 4)):
        raise RuntimeError(f"Qwen vision tokens got ids {got}, expected {FIRST_ID}..{FIRST_ID + 3}")
    return tokenizer


def qwen_vl_config(spec: TinyQwenVLSpec | None = None):
    """The transformers config (`Qwen2VLConfig` or `Qwen2_5_VLConfig`, float32) of the tiny model."""
    import transformers

    spec = spec or TinyQwenVLSpec()
    text = decoder_config(spec.text, extra_tokens=len(QWEN_VL_TOKENS))
    head_dim = spec.text.hidden_size // spec.text.num_heads
    if 2 * sum(spec.mrope_section) != head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(spec.mrope_section)}
    text.update(tie_word_embeddings=spec.tie_word_embeddings, initializer_range=0.1)
    ids: dict[str, Any] = dict(
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    common: dict[str, Any] = dict(
        spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, patch_size=PATCH, depth=spec.vision_layers
    )
    if spec.variant == "qwen2_vl":
        vision = dict(
            common,
            embed_dim=spec.vision_hidden_size,
            hidden_size=spec.text.hidden_size,
            mlp_ratio=spec.vision_intermediate_size // spec.vision_hidden_size,
            num_heads=spec.vision_heads,
        )
        config_class: Any = transformers.Qwen2VLConfig
    elif spec.variant == "qwen2_5_vl":
        vision = dict(
            common,
            hidden_size=spec.vision_hidden_size,
            intermediate_size=spec.vision_intermediate_size,
            out_hidden_size=spec.text.hidden_size,
            num_heads=spec.vision_heads,
            window_size=4 * PATCH * MERGE,  # 112 px: a 4 x 4 window of merged tokens
            fullatt_block_indexes=[spec.vision_layers - 1],
        )
        config_class = transformers.Qwen2_5_VLConfig
    else:
        raise ValueError(f"variant={spec.variant!r}; choose one of {list(VARIANTS)}")
    return config_class(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=spec.tie_word_embeddings,
        dtype="float32",
        **ids,
    )


def build_image_processor(spec: TinyQwenVLSpec | None = None):
    """Qwen's image processor (the PIL backend without torchvision) at the spec's pixel limits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    spec = spec or TinyQwenVLSpec()
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
    )


def build_tiny_qwen_vl(out_dir: str | Path, spec: TinyQwenVLSpec | None = None) -> Path:
    """Write a randomly initialised tiny Qwen VL (see the module docstring) to `out_dir`; return the path.
    The same spec gives the same weights."""
    import transformers

    spec = spec or TinyQwenVLSpec()
    config = qwen_vl_config(spec)
    model_class = {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    }[spec.variant]
    torch.manual_seed(spec.seed)
    model = model_class(config)
    randomize_norms_and_biases(model, spec.seed + 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_qwen_vl_tokenizer().save_pretrained(out)
    build_image_processor(spec).save_pretrained(out)
    return out
