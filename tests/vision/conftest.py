"""Fixtures for the vision-language tests: tiny LLaVA directories, their HF models, and test images."""

from __future__ import annotations

import pytest
import torch

from yatt_ray.models.tiny_vlm import TinyVLMSpec, build_tiny_vlm


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """The default tiny LLaVA (seed 0): 32x32 images, 16 tokens per image, feature layer -1, "default"."""
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))


@pytest.fixture(scope="session")
def vlm_dir_seed7(tmp_path_factory):
    """The same architecture with other random weights (seed 7): the 'new' weights of a weight sync."""
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_seed7"), TinyVLMSpec(seed=7))


@pytest.fixture(scope="session")
def hf_vlm(vlm_dir):
    """The transformers reference model of `vlm_dir`, fp32, eval, no grads."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    return model.requires_grad_(False)


@pytest.fixture(scope="session")
def pixels():
    """`pixels(count, seed)`: deterministic test images (see `make_pixels`); test modules do not import
    conftest."""
    return make_pixels


def make_pixels(count: int, seed: int, size: int = 32) -> torch.Tensor:
    """`count` deterministic images as normalised pixel_values [count, 3, size, size] (roughly unit scale,
    as CLIP's normalisation leaves real images), from a smooth pattern plus noise so images differ a lot."""
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(-1.5, 1.5, size)
    pattern = base[None, None, :, None] * torch.randn(count, 3, 1, 1, generator=g)
    return pattern + 0.8 * torch.randn(count, 3, size, size, generator=g)
