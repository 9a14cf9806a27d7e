"""How the integration tests start a run: one helper (`run`) over the example configs, the checkpoint drills'
short demo run (`short_run`) and the engine-actor placement (`ENGINES`), and the audits several modules share.

A run is `fit()` on `examples/configs/<preset>.yaml`, the way a user starts it, with the test's overrides last;
the runs several tests read are started once a session through the `shared_runs` fixture
(tests/integration/conftest.py).
"""

from __future__ import annotations

from pathlib import Path

import yatt_ray
from yatt_ray.testing.drills import prompt_audit

REPO = Path(__file__).resolve().parents[2]
PROMPTS = 8  # the short run's prompts a step
QUIET = ("output.progress=false", "output.tensorboard=false", "output.plot=false")
# two engine actors on logical GPUs of their own, beside the two trainers' (on the shared cluster)
ENGINES = ("rollout.engine=hf", "placement.mode=disaggregated", "placement.rollout_engines=2",
           "cluster.use_gpu=true", "cluster.cpus_per_worker=1")  # fmt: skip


def run(preset: str, out: str | Path, *overrides: str, quiet: bool = True) -> yatt_ray.Result:
    """`fit()` on examples/configs/<preset>.yaml writing to `out`, without the progress bar (and, `quiet`,
    without TensorBoard events and the plot), `overrides` ("section.key=value") last."""
    outputs = QUIET if quiet else QUIET[:1]
    config = yatt_ray.load_config(
        REPO / f"examples/configs/{preset}.yaml", [f"output.dir={out}", *outputs, *overrides]
    )
    return yatt_ray.fit(config)


def short_run(ckpt_dir: str, out: str | Path, steps: int, *overrides: str) -> yatt_ray.Result:
    """The demo task cut to `steps` steps of PROMPTS prompts x 2 samples on 2 workers, no eval set, a checkpoint
    every 2 steps with the per-step prompt-id log (what `prompt_audit` reads) in `ckpt_dir` ("": the run
    folder's checkpoints/)."""
    from yatt_ray.config import Config
    from yatt_ray.tasks.demo import prepare_demo

    demo = prepare_demo(Config())
    where = (f"checkpoint.dir={ckpt_dir}",) if ckpt_dir else ()
    return run(
        "grpo", out, f"model.path={demo.model.path}", f"data.train_files=[{demo.data.train_files[0]}]",
        "data.eval_files=[]", f"train.steps={steps}", f"train.prompts_per_step={PROMPTS}", "rollout.n=2",
        "train.dp_size=2", *where, "checkpoint.every_steps=2", "checkpoint.log_prompt_ids=true", *overrides,
    )  # fmt: skip


def train_steps(result: yatt_ray.Result) -> list[int]:
    """The steps that trained, in the order the history has them (each once in a run that resumed)."""
    return [int(r["step"]) for r in result.history if "reward_mean" in r]


def assert_each_prompt_once(
    ckpt_dir: str, steps: int, earlier: tuple[str, ...] = (), prompts: int | None = PROMPTS
) -> None:
    """The prompt log of `ckpt_dir` (and the `earlier` runs' it continued) has `steps` steps, every prompt of
    them trained once: none repeated, none lost, none forgotten at a stop; `prompts` a step when given."""
    audit = prompt_audit(ckpt_dir, earlier=earlier)
    assert audit.steps == steps, audit
    assert prompts is None or audit.prompts == steps * prompts, audit
    assert audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit
