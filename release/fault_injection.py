"""Fault drills for checkpoints on this machine: does a run survive, and is each prompt trained on exactly once?

    python release/fault_injection.py                  # every scenario, ~10 minutes on 2 CPU cores
    python release/fault_injection.py --only kill,sigterm

Each scenario trains the demo GRPO task (tiny model, vLLM rollouts) for 6 steps with 2 data-parallel
workers, 8 prompts a step, a checkpoint every 2 steps and `checkpoint.log_prompt_ids=true`, and injects one
fault:

* baseline:      no fault (the reference row);
* worker kill:   SIGKILL one Ray Train worker after the first checkpoint; Ray Train restarts the workers and
                 they resume from the newest committed checkpoint by themselves;
* sigterm:       SIGTERM to the driver after the first checkpoint: save, exit cleanly; a second run resumes;
* corrupt:       a 4-step run, then bytes of its newest checkpoint flipped; the next run detects it by
                 checksum, warns, and resumes from the one before;
* disk full:     checkpoints on `faulty://` whose rank files fail with ENOSPC after the first checkpoint:
                 training goes on, failures are counted, the earlier checkpoint stays valid;
* dp 2 -> 1:     a 4-step run on 2 workers resumed on 1 worker.

It prints a table: scenario, survived (all 6 steps trained, each once), steps redone (steps trained again
after a rollback), prompts lost (counted as consumed by the checkpoint but never trained on), prompts
duplicated (trained on twice in the epoch). The target: nothing lost, nothing duplicated.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

import yatt_ray
from yatt_ray.checkpoint import CheckpointStore
from yatt_ray.checkpoint.drills import (
    committed_steps,
    corrupt_checkpoint,
    kill_training_worker,
    prompt_audit,
    when,
)
from yatt_ray.checkpoint.faults import FAIL_WRITES

REPO = Path(__file__).resolve().parents[1]
STEPS, PROMPTS = 6, 8


def config(ckpt_dir: str, out: Path, *overrides: str):
    from yatt_ray.config import Config
    from yatt_ray.tasks.demo import prepare_demo

    demo = prepare_demo(Config())
    return yatt_ray.load_config(
        REPO / "examples/configs/grpo.yaml",
        [f"model.path={demo.model.path}", f"data.train_files=[{demo.data.train_files[0]}]", "data.eval_files=[]",
         f"output.dir={out}", "output.progress=false", "output.tensorboard=false", "output.plot=false",
         f"train.steps={STEPS}", f"train.prompts_per_step={PROMPTS}", "rollout.n=2", "train.dp_size=2",
         f"checkpoint.dir={ckpt_dir}", "checkpoint.every_steps=2", "checkpoint.log_prompt_ids=true", *overrides],
    )  # fmt: skip


def trained_steps(result) -> list[int]:
    return [int(r["step"]) for r in result.history if "reward_mean" in r]


def row(name: str, ckpt_dir: str, result, note: str = "") -> dict:
    audit = prompt_audit(ckpt_dir)
    survived = (
        trained_steps(result) == list(range(1, STEPS + 1))
        and audit.steps == STEPS
        and audit.prompts == STEPS * PROMPTS
        and audit.duplicated == 0
        and audit.lost == 0
    )
    return {
        "scenario": name,
        "survived": "yes" if survived else "NO",
        "steps redone": audit.discarded_steps,
        "prompts lost": audit.lost,
        "prompts duplicated": audit.duplicated,
        "note": note,
    }


def baseline(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    return row("baseline", ckpt, yatt_ray.fit(config(ckpt, tmp)))


def worker_kill(tmp: Path) -> dict:
    ckpt, killed = str(tmp / "ckpt"), []
    when(lambda: bool(committed_steps(ckpt)), lambda: killed.append(kill_training_worker()))
    result = yatt_ray.fit(config(ckpt, tmp))
    resumed = result.metric("checkpoint/resumed_from")
    return row("worker kill", ckpt, result, f"killed pid {killed}, resumed from {resumed}")


def sigterm(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    when(lambda: bool(committed_steps(ckpt)), lambda: os.kill(os.getpid(), signal.SIGTERM))
    first = yatt_ray.fit(config(ckpt, tmp))
    stopped_at = max(trained_steps(first))
    second = yatt_ray.fit(config(ckpt, tmp))
    note = f"run 1 stopped={first.stopped} after step {stopped_at}; run 2 resumed from "
    return row("sigterm", ckpt, second, note + str(second.metric("checkpoint/resumed_from")))


def corrupt(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    yatt_ray.fit(config(ckpt, tmp, "train.steps=4"))
    newest = committed_steps(ckpt)[-1]
    corrupt_checkpoint(ckpt, newest)
    result = yatt_ray.fit(config(ckpt, tmp))
    return row("corrupt latest", ckpt, result, f"corrupted step {newest}, resumed from "
               f"{result.metric('checkpoint/resumed_from')}")  # fmt: skip


def disk_full(tmp: Path) -> dict:
    ckpt = f"faulty://{tmp / 'ckpt'}"
    sentinel = tmp / "ckpt" / "ranks" / FAIL_WRITES
    when(lambda: bool(committed_steps(ckpt)), lambda: sentinel.write_text("disk full drill\n"))
    result = yatt_ray.fit(config(ckpt, tmp))
    failures = max(result.metric("checkpoint/failures"))
    newest = CheckpointStore(ckpt).latest_valid()
    note = f"{failures:.0f} failed rank writes (ENOSPC); newest valid checkpoint: step {newest.step if newest else None}"
    sentinel.unlink()
    out = row("disk full", ckpt, result, note)
    if failures == 0 or newest is None:
        out["survived"] = "NO"
    return out


def dp_change(tmp: Path) -> dict:
    ckpt = str(tmp / "ckpt")
    yatt_ray.fit(config(ckpt, tmp, "train.steps=4"))
    result = yatt_ray.fit(config(ckpt, tmp, "train.dp_size=1"))
    return row("dp 2 -> 1", ckpt, result, f"resumed from {result.metric('checkpoint/resumed_from')}")


SCENARIOS = {
    "baseline": baseline,
    "kill": worker_kill,
    "sigterm": sigterm,
    "corrupt": corrupt,
    "diskfull": disk_full,
    "dpchange": dp_change,
}


def print_table(rows: list[dict]) -> None:
    keys = ["scenario", "survived", "steps redone", "prompts lost", "prompts duplicated", "note"]
    widths = {k: max(len(k), *(len(str(r[k])) for r in rows)) for k in keys}
    print(" | ".join(k.ljust(widths[k]) for k in keys))
    print("-+-".join("-" * widths[k] for k in keys))
    for r in rows:
        print(" | ".join(str(r[k]).ljust(widths[k]) for k in keys), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated of {list(SCENARIOS)}")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="yatt-faults-") as tmp:
        for name in args.only.split(","):
            folder = Path(tmp, name)
            folder.mkdir()
            try:
                rows.append(SCENARIOS[name](folder))
            except Exception as exc:  # a scenario that crashes did not survive; the others still run
                rows.append({"scenario": name, "survived": "NO", "steps redone": "-", "prompts lost": "-",
                             "prompts duplicated": "-", "note": f"{type(exc).__name__}: {exc}"[:200]})  # fmt: skip
            print(f"[{name}] {rows[-1]}", flush=True)
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
