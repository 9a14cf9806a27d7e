"""The GenRM demo in each placement, side by side: the same reward curve, and where each accelerator idled.

    python release/bench_placements.py                    # 20 steps a placement, 4 logical GPUs
    python release/bench_placements.py --steps 40 --out runs/bench_placements

One local Ray cluster with 4 logical GPUs (no CUDA behind them: the plan places the roles on them as on a real
cluster and every role computes on the CPU) runs examples/configs/grpo_genrm.yaml (a tiny policy learns
addition from a tiny judge's verdicts; train.dp_size=2) three times with one seed:
  full           every role on both training accelerators in turn (phases in series);
  partial        the seed's: judges beside the engines on the training accelerators (2 replicas), judging as
                 samples finish, released for training;
  disaggregated  the judge on an accelerator of its own, and the rollout engine on one of its own
                 (placement.rollout_engines=1): the trainers only train.
Figures (steps 2.. of each run): the reward curve (reward_mean a step), its mean over the last half of the
steps, the largest gap between a placement's and full's last-half means in units of their standard error
(the per-step spread / sqrt(steps)), median rollout-phase and step times, and the idle fraction of the
accelerators (`idle/mean`: the run's busy spans against its accelerators). Each run's `timeline.png` (a row
per worker and accelerator) shows where each accelerator was idle; the paths are printed. Last line:
    placements: reward_full=<a> reward_partial=<b> reward_disaggregated=<c> max_gap_se=<g>
      rollout_partial_vs_full=<r> idle_full=<x> idle_partial=<y> idle_disaggregated=<z>
On two CPU cores every role competes for the same cores, so the times say little about accelerators
(release/placement_sim.py models those); the curves and the placement of the idle time are what this shows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yatt_ray

REPO = Path(__file__).resolve().parents[1]
MODES = {
    "full": (),
    "partial": ("reward.genrm.replicas=2",),
    "disaggregated": ("placement.rollout_engines=1",),
}


def run(mode: str, args: argparse.Namespace) -> yatt_ray.Result:
    config = yatt_ray.load_config(
        REPO / "examples/configs/grpo_genrm.yaml",
        [f"placement.mode={mode}", f"train.steps={args.steps}", "cluster.use_gpu=true",
         "cluster.cpus_per_worker=1", f"output.dir={args.out / mode}", "output.progress=false",
         "checkpoint.enable=false", f"train.seed={args.seed}", *MODES[mode]],
    )  # fmt: skip
    return yatt_ray.fit(config)


def figures(result: yatt_ray.Result) -> dict[str, float]:
    rows = [r for r in result.history if "reward_mean" in r and r["step"] >= 2]
    rewards = [r["reward_mean"] for r in rows]
    tail = rewards[len(rewards) // 2 :]
    idle = [r["idle/mean"] for r in result.history if "idle/mean" in r and r["step"] >= 2]
    return {
        "reward": statistics.fmean(tail),
        "se": statistics.stdev(tail) / len(tail) ** 0.5 if len(tail) > 1 else float("nan"),
        "rollout_s": statistics.median(r["time/rollout"] for r in rows),
        "step_s": statistics.median(r["time/step"] for r in rows),
        "idle": statistics.median(idle) if idle else float("nan"),
    }


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_placements")
    args = p.parse_args(argv)
    import ray

    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False)
    results = {mode: run(mode, args) for mode in MODES}
    ray.shutdown()
    figs = {mode: figures(r) for mode, r in results.items()}
    print("\n| placement | reward (last half) | rollout s | step s | idle/mean | reward curve | timeline |")
    print("|---|---|---|---|---|---|---|")
    for mode, f in figs.items():
        curve = " ".join(f"{r['reward_mean']:.2f}" for r in results[mode].history if "reward_mean" in r)
        png = Path(results[mode].output_dir) / "timeline.png"
        print(
            f"| {mode} | {f['reward']:.3f} +- {f['se']:.3f} | {f['rollout_s']:.2f} | {f['step_s']:.2f} | "
            f"{f['idle']:.2f} | {curve} | {png} |"
        )
    full = figs["full"]
    gaps = [
        abs(f["reward"] - full["reward"]) / max((f["se"] ** 2 + full["se"] ** 2) ** 0.5, 1e-9)
        for mode, f in figs.items()
        if mode != "full"
    ]
    print(
        f"placements: reward_full={full['reward']:.3f} reward_partial={figs['partial']['reward']:.3f} "
        f"reward_disaggregated={figs['disaggregated']['reward']:.3f} max_gap_se={max(gaps):.2f} "
        f"rollout_partial_vs_full={figs['partial']['rollout_s'] / full['rollout_s']:.2f} "
        f"idle_full={full['idle']:.2f} idle_partial={figs['partial']['idle']:.2f} "
        f"idle_disaggregated={figs['disaggregated']['idle']:.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
