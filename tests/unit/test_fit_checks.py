"""The driver's checks before Ray starts, without a cluster: a GenRM folder that is no model is refused naming
the key, a plan that cannot fit a local cluster is refused before Ray starts and before the run folder
exists, a run refused later leaves no empty folder, and keys that do nothing in the run get one warning each.
"""

from __future__ import annotations

import json
import logging
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import yatt_ray
import yatt_ray.fit  # noqa: F401  (the module: the package's `fit` attribute is the function)
from yatt_ray.config import Config, load_config
from yatt_ray.errors import ConfigError, PlacementError

fit_module = sys.modules["yatt_ray.fit"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """(a tiny model directory, a parquet file of 8 prompts)."""
    from yatt_ray.models.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("inputs")
    model = build_tiny_model(tmp / "model")
    data = tmp / "train.parquet"
    rows = [{"id": i, "prompt": "1+2=", "ground_truth": "3"} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    return str(model), str(data)


@pytest.fixture
def no_ray(monkeypatch):
    """Ray not connected, and any start of it fails the test."""
    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(fit_module, "connect", refuse)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def run_config(tmp_path, inputs, *over: str):
    model, data = inputs
    base = [f"model.path={model}", f"data.train_files=[{data}]", "data.eval_files=[]", "train.prompts_per_step=4",
            "rollout.n=2", f"output.dir={tmp_path / 'runs'}", "output.progress=false"]  # fmt: skip
    return load_config(None, [*base, *over])


# ---- the GenRM folder -----------------------------------------------------------------------------------------
def judge_config(tmp_path, path) -> Config:
    return load_config(None, ["reward.mode=genrm", f"reward.genrm.path={path}"])


def test_a_judge_whose_config_json_is_empty_is_refused_naming_the_missing_key(tmp_path, inputs, no_ray):
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"reward.genrm.path=.*config.json has no 'model_type' key \(keys: none\)"
    ):
        fit_module._check_judge(judge_config(tmp_path, judge))
    # through fit(): before Ray starts (no_ray) and before a run folder exists
    with pytest.raises(ConfigError, match="no 'model_type' key.*point reward.genrm.path at a Hugging Face"):
        yatt_ray.fit(run_config(tmp_path, inputs, "reward.mode=genrm", f"reward.genrm.path={judge}"))
    assert not (tmp_path / "runs").exists()


def test_a_judge_without_weights_or_tokenizer_is_refused_and_a_model_directory_passes(tmp_path, inputs):
    judge = tmp_path / "judge"
    judge.mkdir()
    (judge / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"holds no weights \(none of \*.safetensors.*and no tokenizer"):
        fit_module._check_judge(judge_config(tmp_path, judge))
    (judge / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="config.json holds a list, not a mapping"):
        fit_module._check_judge(judge_config(tmp_path, judge))
    (judge / "config.json").write_text("{model_type: llama")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        fit_module._check_judge(judge_config(tmp_path, judge))
    config = judge_config(tmp_path, inputs[0])
    fit_module._check_judge(config)  # the tiny model: config.json, model.safetensors, tokenizer.json
    assert config.reward.genrm.path == inputs[0]


# ---- placement before Ray starts -------------------------------------------------------------------------------
def test_a_plan_that_cannot_fit_the_local_cluster_is_refused_before_ray_and_before_a_run_folder(
    tmp_path, inputs, no_ray
):
    over = ("placement.mode=disaggregated", "placement.rollout_engines=64")
    with pytest.raises(PlacementError, match=r"needs \d+ CPUs .* engines 64 x 1 .* cluster has \d+"):
        yatt_ray.fit(run_config(tmp_path, inputs, *over))
    assert not (tmp_path / "runs").exists()


def test_the_early_plan_sees_the_cpus_the_local_cluster_declares(tmp_path, inputs, monkeypatch):
    """`_check_local_placement` plans with exactly the CPUs `cluster.connect` then passes to ray.init."""
    import os

    import ray

    from yatt_ray import cluster, placement
    from yatt_ray.host_memory import CPU_ENV

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for key in CPU_ENV:  # connect() sets them in this process: restored after the test
        monkeypatch.setenv(key, os.environ.get(key, "1"))
    planned, declared = [], []
    monkeypatch.setattr(
        placement, "plan_placement", lambda config, resources, sizes=None: planned.append(resources)
    )
    monkeypatch.setattr(ray, "init", lambda **kwargs: declared.append(kwargs["num_cpus"]))
    for over in [(), ("train.dp_size=2",), ("placement.mode=disaggregated", "placement.rollout_engines=3")]:
        config = run_config(tmp_path, inputs, "train.prompts_per_step=4", *over)
        fit_module._check_local_placement(config)
        assert config.cluster.cpus_per_worker is None  # the run's own config is left to connect()
        cluster.connect(config)
        assert planned[-1]["CPU"] == declared[-1], over
    assert planned[-1]["CPU"] > planned[0]["CPU"]  # the engine actors' CPUs counted


def test_a_run_refused_on_a_running_cluster_leaves_no_empty_run_folder(tmp_path, inputs, monkeypatch):
    import ray

    def refuse(config):
        raise PlacementError("the plan needs more than the cluster has")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a cluster to join: its size is not known early
    monkeypatch.setattr(fit_module, "connect", refuse)
    with pytest.raises(PlacementError, match="needs more"):
        yatt_ray.fit(run_config(tmp_path, inputs))
    runs = tmp_path / "runs"
    assert runs.is_dir() and list(runs.iterdir()) == []  # the run folder (with its checkpoints/) removed
    kept = runs / "kept"
    (kept / "sub").mkdir(parents=True)
    (kept / "sub" / "metrics.jsonl").write_text("{}")
    fit_module._remove_if_empty(kept)
    assert (kept / "sub" / "metrics.jsonl").is_file()


# ---- keys that do nothing --------------------------------------------------------------------------------------
def test_keys_without_effect_get_one_warning_each(tmp_path, inputs, no_ray, caplog):
    over = ("rollout.ordered=true", "rollout.weight_transport=broadcast", "data.max_pixels=50176",
            "data.min_pixels=3136", "placement.mode=disaggregated", "placement.rollout_engines=64")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="yatt_ray.fit"), pytest.raises(AssertionError, match="Ray"):
        yatt_ray.fit(run_config(tmp_path, inputs, *over[:4]))  # warned at the input check, before Ray
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "yatt_ray.fit" and "has no effect" in r.getMessage()
    ]
    assert [line.split(" has no effect")[0] for line in lines] == [
        "rollout.ordered=true", "rollout.weight_transport=broadcast", "data.min_pixels=3136", "data.max_pixels=50176"
    ]  # fmt: skip
    assert all("\n" not in line for line in lines)
    assert "placement.rollout_engines" in lines[0] and "text model" in lines[2]
    # with engine actors, and with a vision policy, the same keys act: no warning
    config = run_config(tmp_path, inputs, *over)
    assert fit_module.unused_keys(config, images=True) == []
    assert fit_module.unused_keys(run_config(tmp_path, inputs), images=False) == []
