"""The full-coexistence placement plan and its resource checks (no cluster: resources are given)."""

import pytest

from yatt_ray import PlacementError, load_config
from yatt_ray.placement import plan_placement


def cfg(*over):
    return load_config(None, list(over))


def test_cpu_plan_counts_workers_and_data_cpu():
    plan = plan_placement(cfg("train.dp_size=2", "train.tp_size=2", "train.prompts_per_step=4"), {"CPU": 5.0})
    assert (plan.num_workers, plan.gpus_per_worker, plan.mode) == (4, 0, "full")
    assert "dp 2 x tp 2" in plan.describe()


def test_gpus_are_used_when_the_cluster_has_them():
    plan = plan_placement(cfg("train.dp_size=4", "train.prompts_per_step=8"), {"CPU": 64.0, "GPU": 8.0})
    assert plan.gpus_per_worker == 1


def test_too_many_workers_for_the_cpus():
    with pytest.raises(PlacementError, match=r"needs 9 CPUs .* cluster has 8\. Lower train.dp_size"):
        plan_placement(cfg("train.dp_size=8", "train.prompts_per_step=8"), {"CPU": 8.0})


def test_too_many_workers_for_the_gpus():
    config = cfg("train.dp_size=4", "train.tp_size=4", "train.prompts_per_step=8", "cluster.use_gpu=true")
    with pytest.raises(PlacementError, match="needs 16 GPUs .* has 8"):
        plan_placement(config, {"CPU": 128.0, "GPU": 8.0})
