"""The embedded default run: build the tiny model, warm it up briefly, and write the demo task.

`demo.task` picks the task: `arithmetic` (two-number addition, `yatt_ray.tasks.arithmetic`; the default),
`longtail` (copy a string of heavy-tailed length, `yatt_ray.tasks.longtail`: responses from 2 to 120 tokens,
for long-tail control and data-parallel balancing), or `vision` (add the two digits drawn in an image,
`yatt_ray.tasks.visual`, with the tiny LLaVA of `yatt_ray.models.tiny_vlm`; `yatt_ray.tasks.vision_demo`). The warm-up is a short supervised pass on the same task
so that RL starts from a policy that is sometimes right (GRPO needs groups with differing rewards) but far
from solved; on `longtail` it teaches the model to copy, so its sampled response lengths follow the strings'
heavy tail. Everything lands in a cache folder keyed by the demo settings (task included), so repeated runs
and tests reuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import asdict
from pathlib import Path

import torch

from yatt_ray.config import Config, DemoConfig
from yatt_ray.errors import ConfigError
from yatt_ray.models.tiny import TinyModelSpec, build_tiny_model, sft_tensors
from yatt_ray.tasks import arithmetic, longtail, visual
from yatt_ray.tasks.arithmetic import write_parquet
from yatt_ray.tasks.vision_demo import build_warm_vlm

log = logging.getLogger(__name__)

SFT_BATCH = 64  # rows per warm-up step
# longtail: a prompt is up to 122 tokens and its answer 121 with EOS; room for max_prompt_tokens 128 plus
# max_new_tokens up to 192 (fit() checks their sum against the model's max_position_embeddings)
LONGTAIL_MAX_POSITIONS = 320


def demo_cache_dir(demo: DemoConfig) -> Path:
    root = Path(os.environ.get("YATT_RAY_CACHE", Path.home() / ".cache" / "yatt_ray"))
    recipe = {
        "format": 2,
        **asdict(demo),
        **({"longtail_format": 2} if demo.task == "longtail" else {}),
    }  # bump "format" when the model or task code changes
    if demo.vision_model == "llava":  # the default: the keys cached before the choice existed stay valid
        recipe.pop("vision_model")
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"demo-{key}"


def prepare_demo(config: Config) -> Config:
    """Fill `model.path` and `data.train_files` with the demo's model and data where they are empty.

    The demo's eval set fills `data.eval_files` only when that is not given (None); an explicit [] keeps the
    run without evaluation, and given files are used as they are.
    """
    folder = demo_cache_dir(config.demo)
    if config.demo.task != "arithmetic" and config.reward.mode != "rule" and config.reward.genrm.path == "":
        raise ConfigError(
            f"reward.mode={config.reward.mode} with demo.task={config.demo.task}: the demo's judge is taught addition "
            "only; set reward.genrm.path to a judge of your own or reward.mode=rule"
        )
    model_dir, train_file, eval_file = folder / "model", folder / "train.parquet", folder / "eval.parquet"
    if config.model.path == "" and not (model_dir / "config.json").exists():
        log.info("building the demo model in %s (%d warm-up steps)", model_dir, config.demo.sft_steps)
        if config.demo.task == "vision":
            build_warm_vlm(model_dir, config.demo)
        else:
            _build_warm_model(model_dir, config.demo)
    write = visual.write_rows if config.demo.task == "vision" else write_parquet  # images: a struct column
    if not config.data.train_files and not train_file.exists():
        rows = demo_problems(config.demo, config.demo.train_prompts, seed=config.train.seed + 100)
        write(rows, train_file)
    demo_eval = not config.data.train_files and config.data.eval_files is None
    if demo_eval and not eval_file.exists():
        rows = demo_problems(config.demo, config.demo.eval_prompts, seed=7, id_offset=10**8)
        write(rows, eval_file)
    if config.reward.mode != "rule" and config.reward.genrm.path == "":
        prepare_demo_judge(config, folder / "judge")
    if config.model.path == "":
        config.model.path = str(model_dir)
    if demo_eval:
        config.data.eval_files = [str(eval_file)]
    if not config.data.train_files:
        config.data.train_files = [str(train_file)]
    return config


def demo_problems(demo: DemoConfig, count: int, seed: int, id_offset: int = 0) -> list[dict]:
    """`count` rows of the demo's task (`demo.task`), drawn with `seed`."""
    if demo.task == "longtail":
        return longtail.make_problems(count, seed=seed, id_offset=id_offset)
    if demo.task == "vision":
        return visual.make_problems(count, seed=seed, id_offset=id_offset)
    return arithmetic.make_problems(count, seed=seed, max_operand=demo.max_operand, id_offset=id_offset)


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
    """Random tiny Llama -> `demo.sft_steps` AdamW steps of next-token loss on answers -> saved HF dir.

    arithmetic: constant lr 3e-3 over fresh problems in order. longtail: the same lr with a 20-step warm-up
    and a linear decay (to 5%), gradients clipped at 1, and the problems bucketed by length (each step's 64
    rows have similar lengths, the steps in random order): the task's heavy tail would otherwise pad most
    batches to its longest string. 1,000 steps take about a minute on 2 CPU cores (examples/configs/
    grpo_longtail.yaml); the copying mechanism forms after 700-900 of them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    is_longtail = demo.task == "longtail"
    build_tiny_model(
        tmp, TinyModelSpec(max_positions=LONGTAIL_MAX_POSITIONS) if is_longtail else TinyModelSpec()
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    rows = demo_problems(demo, demo.sft_steps * SFT_BATCH, seed=1, id_offset=10**9)
    if is_longtail:
        rng = random.Random(2)
        rows = [{**r, "ground_truth": longtail.warmup_answer(r["ground_truth"], rng)} for r in rows]
        rows.sort(key=lambda r: len(r["ground_truth"]))
    batches = [rows[i : i + SFT_BATCH] for i in range(0, len(rows), SFT_BATCH)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = None
    if is_longtail:
        random.Random(0).shuffle(batches)
        steps = max(demo.sft_steps, 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1.0 - s / steps)
        )
    torch.manual_seed(0)
    model.train()
    for batch in batches:
        input_ids, labels = _sft_batch(tokenizer, batch)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        if schedule is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if schedule is not None:
            schedule.step()
    model.save_pretrained(tmp)
    tmp.rename(model_dir)  # atomic: a half-built model is never reused


def _sft_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """SFT tensors for prompt + answer + EOS (see `sft_tensors`)."""
    return sft_tensors(tokenizer, [(r["prompt"], r["ground_truth"]) for r in rows])
