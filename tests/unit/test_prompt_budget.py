"""The prompt budget checked before the cluster starts (`yatt_ray.prompt_budget`): lengths as the rollout
encodes them, a vision prompt over the budget refused, text prompts over it named."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
from transformers import AutoTokenizer

from yatt_ray.config import DataConfig
from yatt_ray.errors import DataError
from yatt_ray.fit import demo_sizes
from yatt_ray.models.tiny import build_tiny_model
from yatt_ray.models.tiny_qwen_vl import build_tiny_qwen_vl
from yatt_ray.prompt_budget import check_prompt_budget, prompt_lengths
from yatt_ray.tasks import visual


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def text_file(tmp_path, questions: list[str]) -> str:
    path = str(tmp_path / "train.parquet")
    rows = [{"id": i, "prompt": q, "ground_truth": "1"} for i, q in enumerate(questions)]
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_text_lengths_are_the_tokenizers_and_long_prompts_are_named(text_model, tmp_path, caplog):
    questions = ["1+1=", "12+34=", "x" * 40 + "=", "7+8="]
    path = text_file(tmp_path, questions)
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    lengths = prompt_lengths(DataConfig(train_files=[path]), [path], text_model)
    assert [n for _, n, _ in lengths] == [len(tokenizer(q)["input_ids"]) for q in questions]
    longest = max(n for _, n, _ in lengths)
    with caplog.at_level(logging.WARNING):
        line = check_prompt_budget(
            DataConfig(train_files=[path], max_prompt_tokens=longest), [path], text_model
        )
    assert f"{longest} tokens of {longest}" in line and not caplog.records  # all fit: nothing to say
    data = DataConfig(train_files=[path], max_prompt_tokens=10)
    with caplog.at_level(logging.WARNING):
        check_prompt_budget(data, [path], text_model)
    (record,) = caplog.records
    text = record.getMessage()
    assert "1 of the first 4 training prompts" in text and "row 2" in text, text
    assert f"data.max_prompt_tokens to {longest}" in text, text


def test_a_vision_prompt_over_the_budget_is_refused_before_the_run(tmp_path):
    model = str(build_tiny_qwen_vl(tmp_path / "qwen_vl"))
    path = visual.write_rows(visual.make_problems(6, seed=0, image_size=56), tmp_path / "train.parquet")
    data = DataConfig(train_files=[path], image_key="images", max_prompt_tokens=10**4)
    lengths = prompt_lengths(data, [path], model)
    assert len(lengths) == 6 and all(first is not None for _, _, first in lengths)
    need = max(n for _, n, _ in lengths)
    assert need > 4  # the image's tokens are counted (a 56 x 56 image: 4 merged patches)
    assert "prompt budget" in check_prompt_budget(
        DataConfig(train_files=[path], image_key="images", max_prompt_tokens=need), [path], model
    )
    small = DataConfig(train_files=[path], image_key="images", max_prompt_tokens=3)  # cuts into the image
    with pytest.raises(DataError, match=rf"would cut an image.*at least {need}"):
        check_prompt_budget(small, [path], model)


def test_your_own_model_at_the_demo_sizes_is_warned_about():
    from yatt_ray.config import Config

    config = Config()
    config.model.path = "/models/Qwen2.5-7B"
    names = [line.split("=")[0] for line in demo_sizes(config)]
    assert names == ["data.max_prompt_tokens", "rollout.max_new_tokens", "train.lr"]
    config.data.max_prompt_tokens, config.rollout.max_new_tokens, config.train.lr = 512, 1024, 1e-6
    assert demo_sizes(config) == []
