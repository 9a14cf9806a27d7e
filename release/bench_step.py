"""Step time of the demo config, split by phase, and the share spent on orchestration.

    python release/bench_step.py                       # the demo config, 12 steps, first 2 discarded as warm-up
    python release/bench_step.py train.dp_size=1 train.steps=20

Orchestration overhead = step wall time - (rollout + reward + log-probs + train), i.e. weight sync plus
everything between phases (batching, broadcasts, metric reduction). Target: under 10% of the step.
Figures are medians over the measured steps; each phase is the slowest worker's time, and the overhead is
computed per step on each worker (then the slowest worker's) before the median is taken.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import yatt_ray

COMPUTE = ("rollout", "reward", "logprobs", "train")
WARMUP_STEPS = 2


def main(overrides: list[str]) -> None:
    config = yatt_ray.load_config(
        Path(__file__).parents[1] / "examples" / "configs" / "grpo.yaml",
        ["train.steps=12", "output.dir=runs/bench_step", "output.progress=false", *overrides],
    )
    start = time.perf_counter()
    result = yatt_ray.fit(config)
    total = time.perf_counter() - start
    rows = [r for r in result.history if "time/step" in r][WARMUP_STEPS:]
    if not rows:
        raise SystemExit(f"need more than {WARMUP_STEPS} steps to measure; raise train.steps")
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key.startswith("time/")}
    step = med["time/step"]
    overhead = med["time/orchestration"]  # per step and worker: wall - compute phases; max over workers
    print(
        f"\nbench_step: {len(rows)} measured steps (dp={config.train.dp_size}, tp={config.train.tp_size}, "
        f"{config.train.prompts_per_step} prompts x {config.rollout.n} samples)"
    )
    print(f"  median step time       {step:8.3f} s")
    for phase in (*COMPUTE, "weight_sync", "other"):
        value = med.get(f"time/{phase}", 0.0)
        print(f"  {phase:<22} {value:8.3f} s  {100 * value / step:5.1f}%")
    print(f"  orchestration overhead {overhead:8.3f} s  {100 * overhead / step:5.1f}%  (target < 10%)")
    for key, label in (
        ("response_tokens_per_s", "response tokens/s"),
        ("total_tokens_per_s", "total tokens/s"),
    ):
        print(f"  {label + ' (median)':<22} {statistics.median(r[key] for r in rows):8.1f}")
    for key in ("perf/mfu_rollout", "perf/mfu_train"):
        if key in rows[0]:
            print(
                f"  {key.split('/')[1] + ' (median)':<22} {100 * statistics.median(r[key] for r in rows):8.1f}%"
            )
    print(f"  whole run incl. start  {total:8.1f} s for {config.train.steps} steps")


if __name__ == "__main__":
    main(sys.argv[1:])
