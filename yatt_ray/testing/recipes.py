"""The sized recipes against their clusters without the clusters: each checkpoint a recipe names as a folder holding
only its published config.json (the dimensions that size memory), and the recipe planned against its cluster
file's GPU node type (`tests/test_recipes.py`, `release/bench_gpu_ready.py`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

import yatt_ray

REPO = Path(__file__).resolve().parents[2]

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


def plan_recipe(path: Path, tmp_path: Path, *overrides: str) -> dict:
    """The per-GPU memory estimate (GiB by role) of recipe `path` planned on its cluster file's GPU node; raises
    `PlacementError` when a role does not fit the node or its memory."""
    from yatt_ray.fit import _model_sizes
    from yatt_ray.placement import check_memory, plan_placement

    config, cluster_file = recipe(REPO / path, tmp_path, *overrides)
    instance, resources = node_type(cluster_file)
    plan = plan_placement(config, resources)
    return check_memory(plan, config, _model_sizes(config), GPU_GIB[instance])
