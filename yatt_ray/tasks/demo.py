"""The embedded default run: build the tiny model, warm it up briefly, and write the arithmetic task.

The warm-up is a short supervised pass so that RL starts from a policy that is sometimes right (GRPO
needs groups with differing rewards) but far from solved. Everything lands in a cache folder keyed by
the demo settings, so repeated runs and tests reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from yatt_ray.config import Config, DemoConfig
from yatt_ray.models.tiny import EOS_ID, TinyModelSpec, build_tiny_model
from yatt_ray.tasks.arithmetic import make_problems, write_parquet

log = logging.getLogger(__name__)


def demo_cache_dir(demo: DemoConfig) -> Path:
    root = Path(os.environ.get("YATT_RAY_CACHE", Path.home() / ".cache" / "yatt_ray"))
    recipe = {"format": 2, **asdict(demo)}  # bump "format" when the model or task code changes
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"demo-{key}"


def prepare_demo(config: Config) -> Config:
    """Fill `model.path` and `data.train_files` with the demo's model and data where they are empty.

    The demo's eval set fills `data.eval_files` only when that is not given (None); an explicit [] keeps the
    run without evaluation, and given files are used as they are.
    """
    folder = demo_cache_dir(config.demo)
    model_dir, train_file, eval_file = folder / "model", folder / "train.parquet", folder / "eval.parquet"
    if config.model.path == "" and not (model_dir / "config.json").exists():
        log.info("building the demo model in %s (%d warm-up steps)", model_dir, config.demo.sft_steps)
        _build_warm_model(model_dir, config.demo)
    if not config.data.train_files and not train_file.exists():
        rows = make_problems(
            config.demo.train_prompts, seed=config.train.seed + 100, max_operand=config.demo.max_operand
        )
        write_parquet(rows, train_file)
    demo_eval = not config.data.train_files and config.data.eval_files is None
    if demo_eval and not eval_file.exists():
        rows = make_problems(
            config.demo.eval_prompts, seed=7, max_operand=config.demo.max_operand, id_offset=10**8
        )
        write_parquet(rows, eval_file)
    if config.reward.mode != "rule" and config.reward.genrm.path == "":
        prepare_demo_judge(config, folder / "judge")
    if config.model.path == "":
        config.model.path = str(model_dir)
    if demo_eval:
        config.data.eval_files = [str(eval_file)]
    if not config.data.train_files:
        config.data.train_files = [str(train_file)]
    return config


def prepare_demo_judge(config: Config, judge_dir: Path) -> None:
    """The demo's GenRM: the tiny judge (built once into the cache) with its own short template."""
    from yatt_ray.tasks.judge import DEMO_TEMPLATE, build_demo_judge

    if not (judge_dir / "config.json").exists():
        log.info("building the demo judge in %s (%d steps)", judge_dir, config.demo.judge_sft_steps)
        build_demo_judge(judge_dir, config.demo.judge_sft_steps, config.demo.max_operand)
    config.reward.genrm.path = str(judge_dir)
    if config.reward.genrm.template == "default":
        config.reward.genrm.template = DEMO_TEMPLATE
    config.reward.genrm.max_prompt_tokens = min(config.reward.genrm.max_prompt_tokens, 64)


def _build_warm_model(model_dir: Path, demo: DemoConfig) -> None:
    """Random tiny Llama -> `demo.sft_steps` AdamW steps of next-token loss on answers -> saved HF dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    build_tiny_model(tmp, TinyModelSpec())
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    rows = make_problems(demo.sft_steps * 64, seed=1, max_operand=demo.max_operand, id_offset=10**9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for step in range(demo.sft_steps):
        input_ids, labels = _sft_batch(tokenizer, rows[step * 64 : (step + 1) * 64])
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(tmp)
    tmp.rename(model_dir)  # atomic: a half-built model is never reused


def _sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """SFT tensors for prompt + answer + EOS (see `sft_tensors`)."""
    return sft_tensors(tokenizer, [(r["prompt"], r["ground_truth"]) for r in rows])


def sft_tensors(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] input ids and labels for (prompt, target) text pairs: prompt + target + EOS, with
    labels -100 on the prompt and the padding, so the loss is on the target and its EOS only."""
    prompts = [tokenizer(p)["input_ids"] for p, _ in pairs]
    targets = [tokenizer(t, add_special_tokens=False)["input_ids"] + [EOS_ID] for _, t in pairs]
    width = max(len(p) + len(t) for p, t in zip(prompts, targets))
    input_ids = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full_like(input_ids, -100)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    return input_ids, labels
