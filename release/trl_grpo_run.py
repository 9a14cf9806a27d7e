"""One TRL GRPOTrainer run for `release/bench_vs_trl.py`: runs inside TRL's own virtual environment.

    <trl-venv>/bin/python release/trl_grpo_run.py SPEC.json OUT.json

SPEC.json (written by bench_vs_trl.py) names the model directory, the parquet of prompts, the settings and the
token ids that yatt_ray's tokenizer gives each prompt. OUT.json gets one row per optimizer step:
`step`, `step_s` (wall time from the previous step's end), `generate_s` (HF generate), `score_s` (generation,
rewards and advantages together), `completion_tokens` (counted from the completion ids, EOS included, as
yatt_ray counts them), `prompt_ids` (the prompts' ids, in order) and TRL's own logged metrics; and the run's
start-up time, peak RSS and versions.

How the settings map onto TRL 1.16.0 (trl/trainer/grpo_config.py, grpo_trainer.py):
- `per_device_train_batch_size` counts completions, not prompts. One optimizer step sees
  `prompts * n` completions as `gradient_accumulation_steps` micro-batches of `micro_batch` completions;
  `steps_per_generation` defaults to the accumulation steps, so one generate call makes all of them
  (`generation_batch_size = prompts * n`) and `num_iterations=1` uses them once: on-policy, one epoch, one
  mini-batch. TRL then skips its old-log-prob pass (gradient_accumulation_steps % steps_per_generation == 0).
- `beta=0`: no reference model is built. `loss_type="dapo"` (the default): token mean over the whole step's
  completions, as yatt_ray's `algo.loss_agg=token-mean`. `epsilon=0.2` both sides, `max_grad_norm=1.0`.
- TRL defaults that would make the runs differ, set explicitly: `bf16=False` (fp32), `gradient_checkpointing=False`,
  `lr_scheduler_type="constant"`, `shuffle_dataset=False` (the parquet is already in a random order and
  yatt_ray reads it in file order too), `top_k=0`, `report_to="none"`, no saving, no evaluation.
- Prompts are plain strings (no chat template): TRL tokenizes them with `processing_class(text=prompts)`, which
  this script checks, prompt by prompt and step by step, against yatt_ray's `tokenizer(prompt)["input_ids"]`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

START = time.time()  # before the heavy imports: start-up includes them


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    threads = int(spec["threads"])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)

    import torch

    torch.set_num_threads(threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer unchanged, with timers around generation and a check of the prompt token ids."""

        def __init__(self, *args, expected_ids: dict[str, list[int]], **kwargs):
            super().__init__(*args, **kwargs)
            self.expected_ids = expected_ids
            self.bench: dict[int, dict] = {}  # optimizer step (1-based) -> what was measured in it

        def _row(self) -> dict:
            return self.bench.setdefault(
                self.state.global_step + 1,
                {
                    "generate_s": 0.0,
                    "score_s": 0.0,
                    "completion_tokens": 0,
                    "completions": 0,
                    "prompt_ids": [],
                },
            )

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            row = self._row()
            row["score_s"] += time.perf_counter() - start
            row["prompt_ids"] += [int(x["id"]) for x in inputs[:: self.num_generations]]
            return out

        def _tokenize_prompts(self, prompts):
            prompt_ids, images, fields = super()._tokenize_prompts(prompts)
            for prompt, ids in zip(prompts, prompt_ids, strict=True):
                want = self.expected_ids.get(prompt)
                if want is not None and list(ids) != want:
                    raise SystemExit(f"TRL tokenized {prompt!r} as {list(ids)}, yatt_ray as {want}")
            self._row()["checked_prompts"] = sum(p in self.expected_ids for p in prompts)
            return prompt_ids, images, fields

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            start = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            row = self._row()
            row["generate_s"] += time.perf_counter() - start
            row["completion_tokens"] += sum(len(c) for c in completion_ids)
            row["completions"] += len(completion_ids)
            return completion_ids, logprobs

    class StepClock(TrainerCallback):
        """Wall time per optimizer step: from the previous step's end (the training start for step 1)."""

        def __init__(self) -> None:
            self.last = None
            self.ends: dict[int, tuple[float, float]] = {}  # step -> (seconds, epoch time at its end)
            self.logs: dict[int, dict] = {}
            self.train_begin = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.train_begin = time.perf_counter(), time.time()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.ends[state.global_step] = (now - self.last, time.time())
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            numbers = {k: v for k, v in (logs or {}).items() if isinstance(v, int | float)}
            self.logs.setdefault(state.global_step, {}).update(numbers)
            if "completions/mean_length" in numbers:
                print(
                    f"trl step {state.global_step}: {self.ends[state.global_step][0]:.2f} s, completion length "
                    f"{numbers['completions/mean_length']:.2f}, reward {numbers.get('reward', 0.0):.3f}",
                    flush=True,
                )

    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    dataset = datasets.Dataset.from_parquet(spec["data_file"])
    n, prompts = int(spec["n"]), int(spec["prompts_per_step"])
    completions = n * prompts
    micro = min(int(spec["micro_batch"]), completions)
    if completions % micro:
        raise SystemExit(f"micro_batch={micro} must divide prompts*n={completions}")

    def exact_match(completions, ground_truth, **kwargs):
        """yatt_ray's exact_match: the decoded response (up to EOS, specials skipped), stripped, equals the truth."""
        return [1.0 if c.strip() == str(t).strip() else 0.0 for c, t in zip(completions, ground_truth)]

    config = trl.GRPOConfig(
        output_dir=spec["work_dir"],
        max_steps=int(spec["steps"]),
        learning_rate=float(spec["lr"]),
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=completions // micro,
        num_generations=n,
        num_iterations=1,
        max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]),
        top_p=float(spec["top_p"]),
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        use_vllm=False,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=int(spec["seed"]),
        data_seed=int(spec["seed"]),
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        log_completions=False,
    )
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        expected_ids=spec["expected_ids"],
    )
    trainer.remove_callback(PrinterCallback)  # the dict of every log line; StepClock prints one short line
    ready = time.time()
    trainer.train()

    rows = []
    for step in sorted(clock.ends):
        step_s, ended = clock.ends[step]
        rows.append({"step": step, "step_s": step_s, "ended": ended, **trainer.bench.get(step, {}),
                     "trl": clock.logs.get(step, {})})  # fmt: skip
    if not rows or not rows[0].get("checked_prompts"):
        raise SystemExit("the prompt token ids of the first batch were not checked against yatt_ray's")
    result = {
        "rows": rows,
        "process_start": START,
        "trainer_ready": ready,
        "train_begin": clock.train_begin,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": torch.get_num_threads(),
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "settings": {
            "per_device_train_batch_size": config.per_device_train_batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "steps_per_generation": config.steps_per_generation,
            "generation_batch_size": config.generation_batch_size,
            "num_iterations": config.num_iterations,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
        },
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
