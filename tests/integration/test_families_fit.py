"""Qwen2- and Qwen3-shaped policies train through fit() with the vLLM engine from a verl-format parquet file
read as it is (chat-message prompts through the tokenizer's chat template, the answer under
`reward_model.ground_truth`, the id under `extra_info.index`, the `math` reward by data source).

The trainer's recomputed log-probs agreeing with the engine's every step shows that the family's conversion
(QKV bias, per-head QK norm) holds in both directions, weight sync included. The Qwen2 run is in bf16 with the
optimizer sharded over its 2 data-parallel ranks (trainer and engine in bf16: they agree to bf16's precision)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.runs import run
from yatt_ray.models.families import build_family_model
from yatt_ray.tasks import arithmetic

pytestmark = pytest.mark.cluster
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}|{% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
)


def verl_parquet(path: Path, count: int) -> str:
    """`count` addition problems in verl's GSM8K layout."""
    rows = arithmetic.make_problems(count, seed=5, max_operand=9)
    table = pa.Table.from_pylist([
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
         "extra_info": {"index": i, "split": "train"}}
        for i, r in enumerate(rows)
    ])  # fmt: skip
    pq.write_table(table, path)
    return str(path)


PRECISION = {"qwen2": ["train.dtype=bf16", "train.distributed_optimizer=true"], "qwen3": []}
MISMATCH = {"qwen2": 0.05, "qwen3": 1e-3}  # mean |trainer - engine| log-prob per token


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_family_trains_from_a_verl_file_with_vllm(family, ray_cluster, tmp_path):
    from transformers import AutoTokenizer

    model = build_family_model(family, tmp_path / family)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)
    data = verl_parquet(tmp_path / "train.parquet", 32)
    result = run(
        "grpo", tmp_path / "run", f"model.path={model}", f"data.train_files=[{data}]", "data.eval_files=[]",
        "data.answer_key=reward_model.ground_truth", "data.id_key=extra_info.index", "reward.function=math",
        "data.system_prompt=Add", "rollout.engine=vllm", "train.steps=3", "train.prompts_per_step=8",
        "rollout.n=4", "train.dp_size=2", "checkpoint.enable=false", *PRECISION[family],
    )  # fmt: skip
    steps = [r for r in result.history if "reward_mean" in r]
    assert [int(r["step"]) for r in steps] == [1, 2, 3]
    assert all(r["samples"] == 32 for r in steps)
    diffs = [r["rollout_logp_diff"] for r in steps]
    assert all(d < MISMATCH[family] for d in diffs), diffs
    print(f"{family} {PRECISION[family]}: rollout_logp_diff per step {diffs}")
    assert all(r["response_length"] > 0 for r in steps)
