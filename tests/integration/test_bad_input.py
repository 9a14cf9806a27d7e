"""Bad input fails before any cluster work, with a message that names the value and the fix."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import yatt_ray


def config(tmp_path, *over):
    return yatt_ray.load_config("examples/configs/grpo.yaml", [f"output.dir={tmp_path}/run", *over])


def test_missing_model_directory(tmp_path):
    with pytest.raises(yatt_ray.ConfigError, match="does not exist|not found|no config.json") as info:
        yatt_ray.fit(config(tmp_path, f"model.path={tmp_path}/no_model"))
    assert "no_model" in str(info.value)


def test_parquet_without_prompt_column(tmp_path, demo_cache):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+2=", "ground_truth": "3"}]), bad)
    with pytest.raises(yatt_ray.DataError, match="no column 'prompt'.*data.prompt_key"):
        yatt_ray.fit(config(tmp_path, f"data.train_files=[{bad}]"))


def test_unknown_algorithm_and_kl(tmp_path):
    with pytest.raises(yatt_ray.ConfigError, match="algo.name='ppo2' is unknown"):
        yatt_ray.fit(config(tmp_path, "algo.name=ppo2"))
    with pytest.raises(yatt_ray.ConfigError, match="algo.kl_estimator='k4' is unknown; valid: k1, k2, k3"):
        yatt_ray.fit(config(tmp_path, "algo.kl_estimator=k4"))


def test_more_workers_than_the_cluster_can_place(tmp_path, ray_cluster, demo_cache):
    """The shared cluster declares 8 CPUs: 8 workers plus a data CPU do not fit; nothing is started."""
    import ray

    before = len(ray.util.placement_group_table())
    with pytest.raises(yatt_ray.PlacementError, match=r"needs 9 CPUs .* cluster has 8.*Lower train.dp_size"):
        yatt_ray.fit(config(tmp_path, "train.dp_size=8"))
    assert len(ray.util.placement_group_table()) == before
