"""Every sized recipe fits its cluster file's node: the placement plan and the per-GPU memory estimate
(`placement.check_memory`) of each `examples/configs/*.yaml` that names a `# cluster:` file, computed with the
checkpoints' real dimensions (their config.json, written here; no weights) against that file's GPU node type."""

from __future__ import annotations

from pathlib import Path

import pytest

from yatt_ray.fit import _model_sizes
from yatt_ray.placement import check_memory, plan_placement
from yatt_ray.testing.recipes import GPU_GIB, node_type, recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (REPO / "examples/configs").glob("*.yaml") if "# cluster:" in p.read_text())


def test_the_sized_recipes_are_there():
    names = {p.stem for p in RECIPES}
    assert {"grpo_qwen7b_gsm8k", "dapo_qwen7b_math", "ppo_qwen3b_gsm8k", "grpo_genrm_7b_judge",
            "grpo_async_qwen7b", "grpo_qwen_vl_geo3k", "grpo_qwen_gsm8k"} <= names  # fmt: skip


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_each_recipe_fits_its_node(path, tmp_path):
    config, cluster_file = recipe(path, tmp_path)
    instance, resources = node_type(cluster_file)
    plan = plan_placement(config, resources)  # a role that does not fit the node's GPUs / CPUs raises
    est = check_memory(plan, config, _model_sizes(config), GPU_GIB[instance])
    assert est["trainer"] > 5, est  # the estimate counts the real model, not a tiny one
    assert plan.accelerators_needed() <= resources["GPU"]


def test_a_7b_recipe_without_recomputation_does_not_fit(tmp_path):
    """The check binds: the 7B GRPO recipe's activations at 8k tokens without recomputation (~38 GiB) do not
    fit beside its trainer state, nor a 32k-token micro-batch with recomputation (16k fits: 73.9 of 79.2 GiB,
    the log-probs holding no logits)."""
    from yatt_ray.errors import PlacementError

    path = REPO / "examples/configs/grpo_qwen7b_gsm8k.yaml"
    for change in ("train.recompute_activations=false", "train.max_tokens_per_micro_batch=32768"):
        config, cluster_file = recipe(path, tmp_path, change)
        instance, resources = node_type(cluster_file)
        plan = plan_placement(config, resources)
        with pytest.raises(PlacementError, match=r"largest phase \(trainer\).*recompute_activations"):
            check_memory(plan, config, _model_sizes(config), GPU_GIB[instance])
