"""Asynchronous rollout on the long-tail task: engines on one CPU, the trainer on the other, eta = 0, 1, 2, 4,
against the colocated synchronous run on both CPUs.

    python release/bench_async.py                       # 12 steps a run, medians over steps 3..12
    python release/bench_async.py --steps 16 --etas 0,1,2 --out runs/bench_async

Runs, one after the other on one local cluster, each with the same seed and data (examples/configs/
grpo_longtail.yaml, the demo's long-tail copy task, 16 prompts x 8 samples a step, train.dp_size=1,
rollout.over_sample=1.0, the Hugging Face engine):
  colocated      placement.mode=full: the engine inside the training worker, 2 CPUs for the worker,
                 phases in series (the synchronous reference);
  eta=K          placement.mode=disaggregated, placement.rollout_engines=1 (1 CPU), the trainer on the other
                 CPU, rollout.max_staleness=K: the engine generates K steps ahead while the trainer trains.
Figures, medians over the measured steps:
  - completion tokens/s (response_tokens_per_s: generated tokens over the step's wall time);
  - the trainer's wait for samples (time/rollout: how long the step waited for its batch) and its share of the
    step (the trainer's idle fraction);
  - bound = (rollout + rest) / max(rollout, rest) from the eta=0 run's phases (rest = step - rollout): what
    overlapping the two phases perfectly would give over eta=0;
  - ratio_etaK = tokens/s(eta=K) / tokens/s(eta=0), vs_colocated_eta2 = tokens/s(eta=2) / tokens/s(colocated);
  - versions a sample: the mean number of weight versions a sample's tokens came from (> 1 where a push
    arrived while it was generating and it continued under the new weights);
  - reward after the same number of trained samples: reward_mean over the last 4 steps of each run;
    reward_gap_eta2 = |reward(eta=2) - reward(colocated)|.
Last line:
    async: bound=<b> ratio_eta1=<x> ratio_eta2=<y> ratio_eta4=<z> vs_colocated_eta2=<w> reward_gap_eta2=<g>
Targets (issue 26): eta=2 reaches >= 0.85 of the bound and >= 1.3x eta=0; vs colocated >= 0.9 expected on two
cores; reward within 0.05 of the colocated run. Run it on an idle machine (`uptime`).

    python release/bench_async.py --pool                # the engine pool: requests alone vs joined

`--pool` (issue 52) runs the engine pool as a multi-controller run uses it instead: train.dp_size=2 (two
controllers), two engine actors of 1 CPU each, rollout.max_staleness=2 (each controller has up to three
steps' requests out), once with rollout.join_requests=false (each engine serves one request at a time, in
arrival order: the engine actor before issue 52) and once with the default (the requests queued on an engine
run as one engine call). Last line:
    async_pool: tok_per_s_alone=<a> tok_per_s_joined=<b> ratio=<b/a> step_s_alone=<s> step_s_joined=<t>
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yatt_ray

REPO = Path(__file__).resolve().parents[1]


def run(name: str, args: argparse.Namespace, *overrides: str) -> yatt_ray.Result:
    config = yatt_ray.load_config(
        REPO / "examples/configs/grpo_longtail.yaml",
        [f"train.steps={args.steps}", "train.dp_size=1", "train.prompts_per_step=16", "train.balance=off",
         "rollout.over_sample=1.0", "rollout.engine=hf", "data.eval_files=[]", f"train.seed={args.seed}",
         f"output.dir={args.out / name}", "output.progress=false", "checkpoint.enable=false", *args.overrides,
         *overrides],
    )  # fmt: skip
    return yatt_ray.fit(config)


def measured(result: yatt_ray.Result, first: int) -> list[dict]:
    return [r for r in result.history if "time/step" in r and r["step"] >= first]


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--first", type=int, default=3, help="first measured step")
    p.add_argument("--etas", default="0,1,2,4")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_async")
    p.add_argument("--pool", action="store_true", help="the engine pool: requests alone vs joined")
    p.add_argument("overrides", nargs="*", help="config keys for every run (key=value), e.g. rollout.n=4")
    args = p.parse_args(argv)
    if args.pool:
        return pool(args)
    etas = [int(e) for e in args.etas.split(",")]
    runs = {"colocated": run("colocated", args, "placement.mode=full", "cluster.cpus_per_worker=2")}
    for eta in etas:
        runs[f"eta={eta}"] = run(
            f"eta{eta}", args, "placement.mode=disaggregated", "placement.rollout_engines=1",
            "placement.cpus_per_engine=1", "cluster.cpus_per_worker=1", f"rollout.max_staleness={eta}",
        )  # fmt: skip
    rows = {name: measured(r, args.first) for name, r in runs.items()}
    tps = {name: median(rs, "response_tokens_per_s") for name, rs in rows.items()}
    reward = {name: statistics.fmean(r["reward_mean"] for r in rs[-4:]) for name, rs in rows.items()}
    print(
        "\n| run | completion tok/s | step s | trainer waits for samples s (share) | staleness max | versions "
        "a sample | reward |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rs in rows.items():
        wait, step = median(rs, "time/rollout"), median(rs, "time/step")
        stale = max((r.get("async/staleness_max", 0.0) for r in rs), default=0.0)
        versions = statistics.fmean(r.get("async/versions_per_sample_mean", 1.0) for r in rs)
        print(
            f"| {name} | {tps[name]:.1f} | {step:.2f} | {wait:.2f} ({wait / step:.2f}) | {stale:.0f} | "
            f"{versions:.2f} | {reward[name]:.3f} |"
        )
    base = rows["eta=0"]
    rollout, rest = median(base, "time/rollout"), median(base, "time/step") - median(base, "time/rollout")
    bound = (rollout + rest) / max(rollout, rest)
    ratio = {eta: tps[f"eta={eta}"] / tps["eta=0"] for eta in etas}
    print(
        f"async: bound={bound:.2f} "
        + " ".join(f"ratio_eta{eta}={ratio[eta]:.2f}" for eta in etas if eta)
        + f" vs_colocated_eta2={tps.get('eta=2', float('nan')) / tps['colocated']:.2f} "
        f"reward_gap_eta2={abs(reward.get('eta=2', float('nan')) - reward['colocated']):.3f}"
    )


def pool(args: argparse.Namespace) -> None:
    """Two controllers, two engine actors, two steps ahead: each request alone vs the queued ones joined."""
    common = ("train.dp_size=2", "placement.mode=disaggregated", "placement.rollout_engines=2",
              "placement.cpus_per_engine=1", "cluster.cpus_per_worker=1", "rollout.max_staleness=2")  # fmt: skip
    runs = {
        "alone": run("pool_alone", args, *common, "rollout.join_requests=false"),
        "joined": run("pool_joined", args, *common, "rollout.join_requests=true"),
    }
    rows = {name: measured(r, args.first) for name, r in runs.items()}
    tps = {name: median(rs, "response_tokens_per_s") for name, rs in rows.items()}
    step = {name: median(rs, "time/step") for name, rs in rows.items()}
    print(
        "\n| engine requests | completion tok/s | step s | trainer waits for samples s | queue max s | reward |"
    )
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        queue = max(r.get("rollout/engine_queue_s_max", 0.0) for r in rs)
        reward = statistics.fmean(r["reward_mean"] for r in rs[-4:])
        print(f"| {name} | {tps[name]:.1f} | {step[name]:.2f} | {median(rs, 'time/rollout'):.2f} | {queue:.2f} | "
              f"{reward:.3f} |")  # fmt: skip
    print(
        f"async_pool: tok_per_s_alone={tps['alone']:.1f} tok_per_s_joined={tps['joined']:.1f} "
        f"ratio={tps['joined'] / tps['alone']:.2f} step_s_alone={step['alone']:.2f} step_s_joined={step['joined']:.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
