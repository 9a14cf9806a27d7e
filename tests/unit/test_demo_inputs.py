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
