"""Long-tail control, data-parallel balancing and dynamic sampling, measured side by side in one process.

    python release/bench_longtail.py                  # 10 steps a run, medians over steps 2-10
    python release/bench_longtail.py --steps 16 --out runs/bench_longtail

Runs, all with train.dp_size=2 and the same seed, one after the other on one local cluster, on the long-tail
task (examples/configs/grpo_longtail.yaml: 32 prompts x 8 samples a step, train.balance=tokens):
  1-3. train.balance=off, tokens, flops with --balance-prompts (8) prompts a step: 4 groups a rank, so the
       heavy tail shows in the ranks' costs; rollout.over_sample=1.0
  4. rollout.over_sample=1.0 (the baseline), 5. 1.25 and 6. 1.5 (rollout.max_aborts=3, the default: a prompt
     aborted 3 times is waited for), 7. 1.5 with rollout.max_aborts=null (never waits)
  8. the demo task (examples/configs/grpo.yaml) with algo.dynamic_sampling=reward

Figures (medians over the measured steps):
  - rollout_cut = 1 - rollout(over_sample=1.5) / rollout(over_sample=1.0), each run training the same number
    of samples a step (checked), both with the default rollout.max_aborts; the table shows 1.25 and 1.5
    without waiting too. Rollout time is the slowest controller's.
  - imbalance_before / imbalance_after: max / mean of the ranks' train cost (real tokens, prompt once) before and
    after the exchange, in run 2 (its `balance/*` metrics).
  - idle_cut = 1 - idle(run 2) / idle(run 1), idle = over the measured steps and both ranks, the train phase's
    seconds outside its busy spans (forward / backward / optimizer): the wait for the slower rank in the
    gradient all-reduce, read from the run's timeline (timeline.json).
  - batch_full = the fraction of the measured steps in which every group filled its share with informative
    groups (no top-up), in run 8.
  - decode step cost: the task's model in one vLLM engine in this process, at 1 and at 128 sequences a step
    (fixed length): what a long-tail step (few sequences) costs against a full one. Over-sampling pays only
    where the tail step costs about as much as a full one (memory-bound decode on an accelerator); where
    decode is compute-bound (here, on CPU cores) it spends more tokens on cheap steps.
Writes gantt_balance_off.png and gantt_balance_tokens.png (one row per rank, the measured steps) under --out,
prints a table, and ends with the line
    longtail: rollout_cut=<x> imbalance_before=<a> imbalance_after=<b> idle_cut=<c> batch_full=<d>
Targets (issue 12): rollout_cut >= 0.25, imbalance_after <= 1.05, idle_cut >= 0.5, batch_full >= 0.95.
Run it on an idle machine (`uptime`): two cores are easily shared by a stray job.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yatt_ray
from yatt_ray.metrics.timeline import Span, busy_union, plot_gantt, read_chrome_trace
from yatt_ray.tasks.demo import demo_cache_dir

REPO = Path(__file__).resolve().parents[1]
DP = 2


@dataclass
class Run:
    name: str
    model_dir: str
    history: list[dict]
    spans: list[Span]
    first_step: int

    def measured(self) -> list[dict]:
        return [r for r in self.history if "time/step" in r and r["step"] >= self.first_step]

    def median(self, key: str) -> float:
        values = [r[key] for r in self.measured() if key in r]
        return statistics.median(values) if values else float("nan")

    def train_idle_s(self) -> float:
        """Seconds of the train phase outside its busy parts, summed over ranks and measured steps."""
        idle = 0.0
        for span in self.spans:
            if span.phase == "train" and span.step >= self.first_step:
                mine = [s for s in self.spans if s.worker == span.worker and s.step == span.step]
                idle += span.duration - busy_union(mine, span.start, span.end)
        return idle


def fit(name: str, config: str, args: argparse.Namespace, *overrides: str) -> Run:
    out = Path(args.out) / name
    cfg = yatt_ray.load_config(
        REPO / "examples" / "configs" / config,
        [f"train.steps={args.steps}", f"train.dp_size={DP}", f"output.dir={out}", "output.progress=false",
         "output.plot=false", "output.tensorboard=false", "checkpoint.enable=false", "data.eval_files=[]",
         f"train.seed={args.seed}", *overrides],
    )  # fmt: skip
    print(f"\n== {name}: {' '.join(overrides)}", flush=True)
    result = yatt_ray.fit(cfg)
    spans = read_chrome_trace(Path(result.output_dir) / "timeline.json")
    model_dir = cfg.model.path or str(
        demo_cache_dir(cfg.demo) / "model"
    )  # "" = the demo's (fit fills a copy)
    return Run(name, model_dir, result.history, spans, first_step=2)


def gantt(run: Run, path: Path) -> None:
    spans = [s for s in run.spans if s.step >= run.first_step]
    plot_gantt(spans, path, title=f"{run.name}: steps {run.first_step}-{max(s.step for s in spans)}")


def decode_step_ms(model_dir: str, batches: tuple[int, ...] = (1, 128), tokens: int = 64) -> dict[int, float]:
    """Milliseconds per decode step at each batch size: `tokens` fixed-length tokens a sequence, the second of
    two identical calls (the first warms the engine)."""
    import time

    from yatt_ray.rollout.base import GenerateRequest, SamplingSpec
    from yatt_ray.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, seed=0)
    spec = SamplingSpec(n=1, max_new_tokens=tokens, ignore_eos=True, seed=1)
    out = {}
    try:
        for batch in batches:
            prompts = [[1, 5 + i % 50, 7, 9, 11, 13, 15, 17] for i in range(batch)]
            engine.generate(GenerateRequest(prompts, spec))
            start = time.perf_counter()
            engine.generate(GenerateRequest(prompts, spec))
            out[batch] = (time.perf_counter() - start) / tokens * 1000
    finally:
        engine.close()
    return out


def table(runs: list[Run]) -> str:
    keys = [("time/step", "step s"), ("time/rollout", "rollout s"), ("time/train", "train s"),
            ("samples", "samples"), ("response_length", "resp len"), ("rollout/aborted_prompts", "aborted"),
            ("balance/imbalance_before", "imb before"), ("balance/imbalance_after", "imb after")]  # fmt: skip
    lines = [
        "| run | " + " | ".join(k[1] for k in keys) + " | train idle s |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for run in runs:
        cells = [f"{run.median(k):.3f}" if k in run.measured()[0] else "-" for k, _ in keys]
        lines.append(f"| {run.name} | " + " | ".join(cells) + f" | {run.train_idle_s():.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench_longtail")
    parser.add_argument("--balance-prompts", type=int, default=8, help="prompts a step in the balancing runs")
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    lt, few = "grpo_longtail.yaml", f"train.prompts_per_step={args.balance_prompts}"
    off = fit("balance_off", lt, args, "rollout.over_sample=1.0", "train.balance=off", few)
    tokens = fit("balance_tokens", lt, args, "rollout.over_sample=1.0", "train.balance=tokens", few)
    flops = fit("balance_flops", lt, args, "rollout.over_sample=1.0", "train.balance=flops", few)
    base_run = fit("os1.0", lt, args, "rollout.over_sample=1.0")
    os125 = fit("os1.25_balance_tokens", lt, args, "rollout.over_sample=1.25", "train.balance=tokens")
    os150 = fit("os1.5_balance_tokens", lt, args, "rollout.over_sample=1.5", "train.balance=tokens")
    pure = fit("os1.5_never_wait", lt, args, "rollout.over_sample=1.5", "rollout.max_aborts=null")
    dynamic = fit("demo_dynamic_sampling", "grpo.yaml", args, "algo.dynamic_sampling=reward")
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    runs = [off, tokens, flops, base_run, os125, os150, pure, dynamic]
    print(table(runs))
    same = {r.median("samples") for r in (base_run, os125, os150, pure)}
    if len(same) != 1:
        raise SystemExit(f"the over-sampling runs trained different numbers of samples a step: {same}")
    out = Path(args.out)
    gantt(off, out / "gantt_balance_off.png")
    gantt(tokens, out / "gantt_balance_tokens.png")
    full = [r["dynamic/batch_full"] >= DP for r in dynamic.measured()]
    base = base_run.median("time/rollout")
    cuts = {
        o: 1 - r.median("time/rollout") / base for o, r in (("1.25", os125), ("1.5", os150), ("pure", pure))
    }
    print(
        f"\nrollout cut: over_sample 1.25 -> {cuts['1.25']:.1%}, 1.5 -> {cuts['1.5']:.1%}; 1.5 never waiting for "
        f"an aborted prompt (rollout.max_aborts=null) -> {cuts['pure']:.1%} (samples a step: {same.pop()})"
    )
    print(
        f"train idle: balance off {off.train_idle_s():.2f} s, tokens {tokens.train_idle_s():.2f} s, "
        f"flops {flops.train_idle_s():.2f} s (cut {1 - flops.train_idle_s() / max(off.train_idle_s(), 1e-9):.0%})"
    )
    print(f"dynamic sampling: kept {dynamic.median('dynamic/drawn_groups') - dynamic.median('dynamic/dropped_groups'):.0f} "
          f"of {dynamic.median('dynamic/drawn_groups'):.0f} drawn groups, {dynamic.median('dynamic/draws'):.0f} draws "
          f"a step (median, both groups)")  # fmt: skip
    print(f"Gantt charts: {out / 'gantt_balance_off.png'}, {out / 'gantt_balance_tokens.png'}")
    step_ms = decode_step_ms(base_run.model_dir)
    print(
        f"decode step: {step_ms[1]:.2f} ms at 1 sequence, {step_ms[128]:.2f} ms at 128: a tail step costs "
        f"{step_ms[1] / step_ms[128]:.0%} of a full one"
    )
    idle_cut = 1 - tokens.train_idle_s() / max(off.train_idle_s(), 1e-9)
    print(
        f"longtail: rollout_cut={cuts['1.5']:.2f} imbalance_before={tokens.median('balance/imbalance_before'):.2f} "
        f"imbalance_after={tokens.median('balance/imbalance_after'):.2f} idle_cut={idle_cut:.2f} "
        f"batch_full={sum(full) / max(len(full), 1):.2f}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
