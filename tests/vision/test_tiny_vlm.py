"""The tiny LLaVA directory loads with plain transformers classes, is deterministic, and its image token and
tokens-per-image agree with transformers' own LlavaProcessor."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from yatt_ray.model_dir import expand_image_tokens
from yatt_ray.models.tiny import CHARACTERS, SPECIAL_TOKENS
from yatt_ray.models.tiny_vlm import (
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    TinyVLMSpec,
    build_tiny_vlm,
    tokens_per_image,
)
from yatt_ray.train.model import read_hf_state_dict


def test_directory_loads_with_transformers(vlm_dir, hf_vlm):
    from transformers import AutoProcessor, AutoTokenizer, CLIPImageProcessor

    cfg = json.loads((vlm_dir / "config.json").read_text())
    assert cfg["model_type"] == "llava" and cfg["architectures"] == ["LlavaForConditionalGeneration"]
    assert cfg["image_token_index"] == IMAGE_TOKEN_ID == len(SPECIAL_TOKENS) + len(CHARACTERS) == 99
    assert cfg["image_seq_length"] == tokens_per_image() == 16
    assert (cfg["vision_feature_layer"], cfg["vision_feature_select_strategy"]) == (-1, "default")
    assert type(hf_vlm).__name__ == "LlavaForConditionalGeneration"
    assert hf_vlm.config.text_config.vocab_size == 128
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    assert len(tok) == len(SPECIAL_TOKENS) + len(CHARACTERS) + 1
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    assert tok(f"a{IMAGE_TOKEN}b")["input_ids"] == [1, a, IMAGE_TOKEN_ID, b]
    image = Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype("uint8"))
    pixels = CLIPImageProcessor.from_pretrained(vlm_dir)(images=[image], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 32, 32)
    assert isinstance(
        AutoProcessor.from_pretrained(vlm_dir).image_processor,
        type(CLIPImageProcessor.from_pretrained(vlm_dir)),
    )


def test_expand_image_tokens_matches_llava_processor(vlm_dir):
    """The library's expansion == transformers' LlavaProcessor on the same text with two images."""
    from transformers import AutoProcessor, AutoTokenizer

    processor = AutoProcessor.from_pretrained(vlm_dir)
    tok = AutoTokenizer.from_pretrained(vlm_dir)
    text = f"Q: {IMAGE_TOKEN} and {IMAGE_TOKEN}? A:"
    images = [Image.new("RGB", (32, 32), (200, 10, 10)), Image.new("RGB", (36, 32), (0, 90, 250))]
    got = processor(text=[text], images=images, return_tensors="pt")
    ours = expand_image_tokens(tok(text)["input_ids"], IMAGE_TOKEN_ID, tokens_per_image(), num_images=2)
    assert got["input_ids"][0].tolist() == ours
    assert ours.count(IMAGE_TOKEN_ID) == 32
    assert got["pixel_values"].shape == (2, 3, 32, 32)


def test_forward_backward_is_fast_and_uses_the_image(hf_vlm, pixels):
    import time

    ids = torch.tensor([[1, 20] + [IMAGE_TOKEN_ID] * 16 + [30, 31]])
    model = hf_vlm
    model.requires_grad_(True)
    try:
        start = time.perf_counter()
        out = model(input_ids=ids, pixel_values=pixels(1, 0))
        out.logits.sum().backward()
        elapsed = time.perf_counter() - start
        assert model.model.multi_modal_projector.linear_1.weight.grad.abs().sum() > 0
    finally:
        model.zero_grad(set_to_none=True)
        model.requires_grad_(False)
    assert elapsed < 2.0, f"forward+backward took {elapsed:.3f}s"
    with torch.no_grad():
        other = model(input_ids=ids, pixel_values=pixels(1, 1)).logits
    assert (other - out.logits.detach()).abs().max() > 1e-3  # the image reaches the logits


def test_build_is_deterministic(tmp_path, vlm_dir):
    again = read_hf_state_dict(build_tiny_vlm(tmp_path / "again"))
    first = read_hf_state_dict(vlm_dir)
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)
    other = read_hf_state_dict(build_tiny_vlm(tmp_path / "seed1", TinyVLMSpec(seed=1)))
    assert not torch.equal(
        other["multi_modal_projector.linear_1.weight"], first["multi_modal_projector.linear_1.weight"]
    )


def test_spec_is_checked(tmp_path):
    from yatt_ray.models.tiny import TinyModelSpec

    with pytest.raises(ValueError, match="vocab_size=96"):
        build_tiny_vlm(tmp_path, TinyVLMSpec(text=TinyModelSpec(vocab_size=96)))
    with pytest.raises(ValueError, match="patch_size=7"):
        build_tiny_vlm(tmp_path, TinyVLMSpec(patch_size=7))
    with pytest.raises(ValueError, match="vision_feature_layer=-4"):
        build_tiny_vlm(tmp_path, TinyVLMSpec(vision_feature_layer=-4))
    assert tokens_per_image(TinyVLMSpec(vision_feature_select_strategy="full", image_size=48)) == 37
