"""A vision-language policy's inputs, checked on the driver before any cluster work: the image column against
the model kind (both ways), the rollout engine kind, the critic, and the prompt encoding (image tokens expanded,
clipping that would cut an image refused, a row without images given no image of the model's shape)."""

from __future__ import annotations

import numpy as np
import pytest

import yatt_ray
from yatt_ray.config import DataConfig
from yatt_ray.data import check_sources
from yatt_ray.data.images import PIXELS
from yatt_ray.errors import ConfigError, DataError
from yatt_ray.model_dir import ImageLayout
from yatt_ray.models.tiny import build_tiny_model
from yatt_ray.models.tiny_vlm import IMAGE_TOKEN_ID, build_tiny_vlm, build_vlm_tokenizer
from yatt_ray.prompts import PromptEncoder
from yatt_ray.rollout import resolve_engine_kind
from yatt_ray.tasks import visual


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    rows = visual.make_problems(4, seed=0)
    images = visual.write_rows(rows, tmp / "images.parquet")
    text = visual.write_rows(
        [{k: v for k, v in r.items() if k != "images"} for r in rows], tmp / "text.parquet"
    )
    return images, text


def test_the_image_column_must_match_the_model(files):
    images, text = files
    assert check_sources(DataConfig(train_files=[images]), images=True) == [images]
    with pytest.raises(DataError, match="no image column 'images'.*vision-language"):
        check_sources(DataConfig(train_files=[text]), images=True)
    with pytest.raises(DataError, match="text-only model.*data.image_key=''"):
        check_sources(DataConfig(train_files=[images]), images=False)
    assert check_sources(DataConfig(train_files=[images], image_key=""), images=False) == [images]


def test_engine_kind_for_a_vision_model(vlm):
    assert resolve_engine_kind("auto", vlm, on_gpu=False) == "hf"
    assert resolve_engine_kind("auto", vlm, on_gpu=True) == "hf"
    with pytest.raises(ConfigError, match="torchvision"):
        resolve_engine_kind("vllm", vlm, on_gpu=False)
    with pytest.raises(ConfigError, match="not wired into the vLLM engine"):
        resolve_engine_kind("vllm", vlm, on_gpu=True)


def test_a_critic_with_a_vision_model_is_refused_before_cluster_work(vlm, files, tmp_path):
    config = yatt_ray.load_config(
        "examples/configs/grpo_vision.yaml",
        [f"model.path={vlm}", f"data.train_files=[{files[0]}]", "data.eval_files=[]", "algo.name=ppo",
         "critic.enable=true", f"output.dir={tmp_path}", "train.prompts_per_step=2"],
    )  # fmt: skip
    with pytest.raises(ConfigError, match="critic reads text only"):
        yatt_ray.fit(config)


def test_prompt_encoder_expands_images_and_refuses_to_cut_one(vlm):
    layout = ImageLayout.from_model_dir(vlm)
    assert layout == ImageLayout(IMAGE_TOKEN_ID, (3, 32, 32), tokens_per_image=16)
    tokenizer = build_vlm_tokenizer()
    row = {"id": 7, "prompt": "<image>Sum:", PIXELS: np.zeros((1, 3, 32, 32), dtype=np.float32)}
    encoded = PromptEncoder(tokenizer, 32, layout).encode(row)
    assert encoded.ids.count(IMAGE_TOKEN_ID) == 16 and len(encoded.ids) == 1 + 16 + 4
    assert (
        encoded.pixels is not None and encoded.pixels.values.shape == (1, 3, 32, 32) and not encoded.clipped
    )
    assert encoded.ids == PromptEncoder(tokenizer, 32, layout).encode({**row, "prompt": [
        {"role": "user", "content": "<image>Sum:"}]}).ids  # fmt: skip  # a chat list (no template: its text)
    with pytest.raises(DataError, match="prompt id 7.*raise data.max_prompt_tokens to at least 21"):
        PromptEncoder(tokenizer, 12, layout).encode(row)
    with pytest.raises(DataError):  # two placeholders, one image
        PromptEncoder(tokenizer, 64, layout).encode({**row, "prompt": "<image><image>Sum:"})


def test_a_row_without_images_gets_no_image_of_the_models_shape(vlm):
    """The data task gives a good row without images pixels [0, 3, 0, 0] (it cannot know the model's size);
    the encoder makes them [0, 3, 32, 32], so the engine, `PromptImages` and the exchange read I = 0."""
    layout = ImageLayout.from_model_dir(vlm)
    row = {"id": 8, "prompt": "3+4 Sum:", PIXELS: np.zeros((0, 3, 0, 0), dtype=np.float32)}
    encoded = PromptEncoder(build_vlm_tokenizer(), 32, layout).encode(row)
    assert encoded.pixels is not None and encoded.pixels.values.shape == (0, 3, 32, 32)
    assert IMAGE_TOKEN_ID not in encoded.ids and len(encoded.ids) == 1 + len("3+4 Sum:")


def test_a_text_model_has_no_image_layout(tmp_path):
    assert ImageLayout.from_model_dir(build_tiny_model(tmp_path / "llama")) is None
