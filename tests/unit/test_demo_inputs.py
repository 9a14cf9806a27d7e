"""How the demo fills the inputs a config leaves empty (with a pre-filled cache: nothing is built)."""

from __future__ import annotations

import pytest

from yatt_ray import load_config
from yatt_ray.tasks.demo import demo_cache_dir, prepare_demo


@pytest.fixture
def cached_demo(tmp_path, monkeypatch):
    """A demo cache that already holds the model and the data files, so prepare_demo only fills paths."""
    monkeypatch.setenv("YATT_RAY_CACHE", str(tmp_path))
    folder = demo_cache_dir(load_config(None).demo)
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    for name in ("train.parquet", "eval.parquet"):
        (folder / name).write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, ["eval.parquet"]),  # not given: the demo's eval set
        ([], []),  # explicitly none: no evaluation
        (["/data/mine.parquet"], ["/data/mine.parquet"]),
    ],
)
def test_demo_eval_files(cached_demo, given, expected):
    config = load_config(None)
    config.data.eval_files = given
    prepare_demo(config)
    assert config.data.train_files == [str(cached_demo / "train.parquet")]
    assert config.data.eval_files == [str(cached_demo / e) if e == "eval.parquet" else e for e in expected]


def test_explicit_empty_eval_files_through_an_override(cached_demo):
    config = prepare_demo(load_config(None, ["data.eval_files=[]"]))
    assert config.data.eval_files == [] and config.model.path == str(cached_demo / "model")


def test_the_vision_demo_builds_either_family(tmp_path, monkeypatch):
    """demo.vision_model picks the tiny model; each has its own cache entry, and a short warm-up through the run's own prompt and image path gives a model that transformers loads."""
    import json

    monkeypatch.setenv("YATT_RAY_CACHE", str(tmp_path))
    llava = load_config("examples/configs/grpo_vision.yaml", ["demo.sft_steps=2"])
    qwen = load_config(
        "examples/configs/grpo_vision.yaml", ["demo.sft_steps=2", "demo.vision_model=qwen2_5_vl"]
    )
    assert demo_cache_dir(llava.demo) != demo_cache_dir(qwen.demo)
    prepare_demo(qwen)
    config = json.loads((demo_cache_dir(qwen.demo) / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and qwen.model.path.endswith("model")
    from transformers import Qwen2_5_VLForConditionalGeneration

    Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen.model.path)
