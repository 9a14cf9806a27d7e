"""Every sized recipe fits its cluster file's node: the placement plan and the per-GPU memory estimate
(`placement.check_memory`) of each `examples/configs/*.yaml` that names a `# cluster:` file, computed with the
checkpoints' real dimensions (their config.json, written here; no weights) against that file's GPU node type."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

import yatt_ray
from yatt_ray.fit import _model_sizes
from yatt_ray.placement import check_memory, plan_placement

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (REPO / "examples/configs").glob("*.yaml") if "# cluster:" in p.read_text())
# GiB of one GPU as CUDA reports it (torch.cuda.get_device_properties(0).total_memory / 2**30)
GPU_GIB = {"p5.48xlarge": 79.2, "p4de.24xlarge": 79.2}  # H100 SXM 80 GB; A100 SXM 80 GB

_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}  # fmt: skip


def _qwen(hidden, ffn, layers, heads, kv, vocab, tied, positions, theta, **more) -> dict:
    return {**_QWEN2, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
            "tie_word_embeddings": tied, "max_position_embeddings": positions, "rope_theta": theta, **more}  # fmt: skip


# the published config.json of each checkpoint the recipes name (the dimensions that size memory)
CHECKPOINTS = {
    "Qwen2.5-7B-Instruct": _qwen(3584, 18944, 28, 28, 4, 152064, False, 32768, 1e6),
    "Qwen2.5-Math-7B": _qwen(3584, 18944, 28, 28, 4, 152064, False, 4096, 1e4),
    "Qwen2.5-3B-Instruct": _qwen(2048, 11008, 36, 16, 2, 151936, True, 32768, 1e6),
    "Qwen2.5-Math-1.5B": _qwen(1536, 8960, 28, 12, 2, 151936, True, 4096, 1e4),
    "Qwen2.5-VL-7B-Instruct": {
        **_qwen(3584, 18944, 28, 28, 4, 152064, False, 128000, 1e6),
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
    },
}  # fmt: skip


def node_type(cluster_file: Path) -> tuple[str, dict[str, float]]:
    """The GPU worker type of a cluster file: its instance type and Ray resources."""
    nodes = yaml.safe_load(cluster_file.read_text())["available_node_types"]
    gpu = [n for n in nodes.values() if n.get("resources", {}).get("GPU")]
    assert len(gpu) == 1, f"{cluster_file}: one GPU node type expected"
    return gpu[0]["node_config"]["InstanceType"], gpu[0]["resources"]


def recipe(path: Path, tmp_path: Path, *overrides: str) -> tuple[yatt_ray.Config, Path]:
    """The recipe's config with each checkpoint it names replaced by a directory holding its config.json."""
    config = yatt_ray.load_config(path, list(overrides))
    for section, key in ((config.model, "path"), (config.reward.genrm, "path")):
        name = Path(getattr(section, key)).name
        if name:
            assert name in CHECKPOINTS, f"{path.name}: add {name}'s config.json to CHECKPOINTS"
            folder = tmp_path / name
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text(json.dumps(CHECKPOINTS[name]))
            setattr(section, key, str(folder))
    cluster = re.search(r"^# cluster: (\S+)", path.read_text(), re.M)
    assert cluster, path
    return config, REPO / cluster.group(1)


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
    fit beside its trainer state, nor its 16k-token micro-batch with recomputation."""
    from yatt_ray.errors import PlacementError

    path = REPO / "examples/configs/grpo_qwen7b_gsm8k.yaml"
    for change in ("train.recompute_activations=false", "train.max_tokens_per_micro_batch=16384"):
        config, cluster_file = recipe(path, tmp_path, change)
        instance, resources = node_type(cluster_file)
        plan = plan_placement(config, resources)
        with pytest.raises(PlacementError, match=r"largest phase \(trainer\).*recompute_activations"):
            check_memory(plan, config, _model_sizes(config), GPU_GIB[instance])
