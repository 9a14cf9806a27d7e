"""train.dtype and train.distributed_optimizer side by side: engine/trainer mismatch, step time, optimizer bytes.

    python release/bench_precision.py                 # 8 steps a run, the demo task, train.dp_size=2
    python release/bench_precision.py --steps 12 --out runs/bench_precision

The same `yatt_ray.fit` run of examples/configs/grpo.yaml (the demo's tiny Llama, GRPO, the vLLM engine
when installed, train.dp_size=2, no eval) in four modes, one after another on one local Ray cluster
(`yatt_ray.cluster.connect`; cluster start-up is in no run):
  - fp32            train.dtype=fp32 (engine fp32), the optimizer replicated on both ranks;
  - fp32_sharded    the same with train.distributed_optimizer=true (ZeRO-1);
  - bf16            train.dtype=bf16 (engine bf16; fp32 gradients and fp32 main weights);
  - bf16_sharded    bf16 with the optimizer sharded.
One unmeasured warm-up run comes first (imports, worker pools). Each run saves one checkpoint, at its last
step, and the bytes of each rank's optimizer file (`policy_optimizer.pt`: main weights for bf16, Adam moments)
are read from the checkpoint directory: what ZeRO-1 leaves on a rank, measured, beside the placement plan's
estimate of the optimizer state on a rank (`placement.trainer_bytes_per_param` less weights and gradients, times
the model's parameters; data-parallel rank 1 of a replicated optimizer writes none, its state being rank 0's).
Per mode: rollout_logp_diff (mean |trainer - engine| log-prob per response token; the median over steps),
the median `time/step` and `time/train` over steps 2..--steps, the optimizer bytes on data-parallel rank 0
and rank 1. Ends with the line
    precision: logp_diff_fp32=<a> logp_diff_bf16=<b> train_s_ratio_bf16=<c> optimizer_shard_ratio=<d>
where train_s_ratio_bf16 = bf16's train phase / fp32's and optimizer_shard_ratio = rank 0's optimizer bytes
sharded / replicated (fp32; ideal 1/dp = 0.5).
About 3 minutes on 2 CPU cores. Run it on an idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import yatt_ray
from yatt_ray.config import Config
from yatt_ray.placement import param_count, trainer_bytes_per_param, weight_bytes

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "fp32": ["train.dtype=fp32"],
    "fp32_sharded": ["train.dtype=fp32", "train.distributed_optimizer=true"],
    "bf16": ["train.dtype=bf16"],
    "bf16_sharded": ["train.dtype=bf16", "train.distributed_optimizer=true"],
}


def run(out: Path, name: str, steps: int, overrides: list[str]) -> dict:
    ckpt = out / name / "ckpt"
    config = yatt_ray.load_config(
        REPO / "examples/configs/grpo.yaml",
        [f"output.dir={out / name}", "output.progress=false", "output.tensorboard=false", "output.plot=false",
         f"train.steps={steps}", "train.dp_size=2", "data.eval_files=[]", f"checkpoint.dir={ckpt}",
         f"checkpoint.every_steps={steps}", *overrides],
    )  # fmt: skip
    rows = [r for r in yatt_ray.fit(config).history if "time/step" in r][1:]
    optimizer = {
        rank: sum(f.stat().st_size for f in (ckpt / "ranks" / f"rank_{rank:05d}").rglob("policy_optimizer*"))
        for rank in (0, 1)
    }
    return {
        "logp_diff": statistics.median(r["rollout_logp_diff"] for r in rows),
        "step_s": statistics.median(r["time/step"] for r in rows),
        "train_s": statistics.median(r["time/train"] for r in rows),
        "optimizer": optimizer,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_precision_"))
    print(f"load average at start: {os.getloadavg()}")
    from yatt_ray.cluster import connect

    connect(yatt_ray.load_config(REPO / "examples/configs/grpo.yaml", []))
    from yatt_ray.tasks.demo import prepare_demo

    params = param_count(prepare_demo(Config()).model.path)
    run(out, "warmup", 2, [])
    results = {name: run(out, name, args.steps, o) for name, o in MODES.items()}
    print(f"\n{params} parameters, train.dp_size=2")
    print(f"{'mode':14} {'logp_diff':>10} {'step_s':>7} {'train_s':>8} {'opt_rank0_kb':>12} {'opt_rank1_kb':>12}"
          f" {'estimate_kb':>11}")  # fmt: skip
    for name, r in results.items():
        dtype, sharded = name.split("_")[0], name.endswith("sharded")
        optimizer_bytes = trainer_bytes_per_param(dtype, sharded, 2) - weight_bytes(dtype) - 4  # less grads
        print(
            f"{name:14} {r['logp_diff']:10.2e} {r['step_s']:7.3f} {r['train_s']:8.3f} "
            f"{r['optimizer'][0] / 1024:12.1f} {r['optimizer'][1] / 1024:12.1f} "
            f"{optimizer_bytes * params / 1024:11.1f}"
        )
    print(f"load average at end: {os.getloadavg()}")
    ratio = results["bf16"]["train_s"] / results["fp32"]["train_s"]
    shard = results["fp32_sharded"]["optimizer"][0] / results["fp32"]["optimizer"][0]
    print(
        f"precision: logp_diff_fp32={results['fp32']['logp_diff']:.2e} "
        f"logp_diff_bf16={results['bf16']['logp_diff']:.2e} train_s_ratio_bf16={ratio:.2f} "
        f"optimizer_shard_ratio={shard:.2f}"
    )


if __name__ == "__main__":
    main()
