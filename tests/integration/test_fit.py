"""End to end on the shared local cluster: the demo run (two data-parallel groups, Megatron + vLLM).

One run of the demo config (80 GRPO steps, ~2 minutes here) feeds every check: it learns, its metrics
history, the files it writes, the final checkpoint as a Hugging Face directory, and the driver never
receiving a sample.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from tests.integration import runs
from yatt_ray.config import Config

pytestmark = pytest.mark.cluster

STEP_KEYS = {
    "reward_mean", "accuracy", "response_length", "kl", "entropy", "pg_loss", "grad_norm", "total_tokens_per_s",
    "time/rollout", "time/reward", "time/logprobs", "time/train", "time/weight_sync", "time/step",
    "rollout_logp_diff", "response_tokens_per_s", "response_tokens_per_s_per_worker", "perf/train_flops_per_s",
    "perf/rollout_flops_per_s", "perf/peak_flops", "perf/mfu_train", "perf/mfu_rollout",
}  # fmt: skip


@pytest.fixture(scope="module")
def run(shared_runs, monkeypatch_module):
    """The demo (examples/configs/grpo.yaml as it stands), once a session, with every object the driver fetches
    through ray.get recorded."""
    import ray

    received = []
    real_get = ray.get

    def recording_get(refs, *args, **kwargs):
        value = real_get(refs, *args, **kwargs)
        received.append(value)
        return value

    def start(out):
        monkeypatch_module.setattr(ray, "get", recording_get)
        try:
            return runs.run("grpo", out, quiet=False), received
        finally:
            monkeypatch_module.setattr(ray, "get", real_get)

    return shared_runs.get("demo", start)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_demo_learns_from_an_unsolved_start(run):
    result, _ = run
    evals = result.metric("eval/accuracy")
    assert len(evals) == 2  # before and after RL
    assert evals[0] < 0.5, f"the warm-up should leave the task unsolved, eval accuracy {evals[0]:.3f}"
    assert evals[1] > evals[0] + 0.1, f"greedy eval accuracy {evals[0]:.3f} -> {evals[1]:.3f}"
    rewards = result.metric("reward_mean")
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, f"mean reward of the first 10 steps {first:.3f}, of the last 10 {last:.3f}"


def test_history_has_every_step_and_metric(run):
    result, _ = run
    steps = [row for row in result.history if "reward_mean" in row]
    assert [int(r["step"]) for r in steps] == list(range(1, 81))
    for row in steps:
        assert set(row) >= STEP_KEYS, STEP_KEYS - set(row)
        assert 0.0 <= row["accuracy"] <= 1.0 and row["response_length"] > 0
        assert row["time/step"] >= row["time/rollout"] > 0


def test_engine_and_trainer_agree_each_step(run):
    """The rollout engine's log-probs match the trainer's recomputation: the weight sync worked."""
    result, _ = run
    for row in result.history:
        if "rollout_logp_diff" in row:
            assert row["rollout_logp_diff"] < 1e-3, row


def test_outputs_written(run):
    result, _ = run
    out = result.output_dir
    lines = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == len(result.history)
    png = Path(out, "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    import glob

    assert glob.glob(f"{out}/tensorboard/events.out.tfevents.*")
    from yatt_ray.metrics.startup import STAGE_NAMES

    marks = json.loads(Path(out, "startup.json").read_text())["marks"]
    assert set(marks) == set(STAGE_NAMES), set(STAGE_NAMES) ^ set(marks)  # the demo reaches every stage
    assert sorted(marks, key=marks.get) == list(STAGE_NAMES)  # in run order: the stream is waited for
    # before step 1 starts, so step 1 holds no cold start


def test_the_result_a_notebook_shows_and_the_run_folder_config(run):
    """What `fit()` hands a notebook: a summary, not the history; the history as a DataFrame, one row a step;
    the run folder's config.yaml is the config the run used (a later `--config` repeats it)."""
    result, _ = run
    text = repr(result)
    assert len(text) < 600 and "steps='80/80'" in text and result.checkpoint_path in text, text
    html = result._repr_html_()  # one table row per summary figure, not a row per step
    assert html.count("<tr>") == len(result.summary()) < 12 and len(html) < 2000, html
    frame = result.history_frame()
    assert list(frame.index) == list(range(0, 81))  # step 0: the eval before RL
    assert frame["reward_mean"].dropna().tolist() == result.metric("reward_mean")
    assert result.config.train.steps == 80  # and config.yaml holds it (`runs.run` checks every run's folder)


def test_final_checkpoint_is_a_hf_directory(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, _ = run
    assert result.checkpoint_path == str(Path(result.output_dir) / "final_hf")  # in the run folder
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint_path)
    tokenizer = AutoTokenizer.from_pretrained(result.checkpoint_path)
    assert model.config.num_hidden_layers == 2 and tokenizer("1+2=")["input_ids"][0] == tokenizer.bos_token_id


def test_driver_never_receives_samples(run):
    """Everything the driver fetched is small and holds no prompt text, token list or tensor."""
    result, received = run
    blob = pickle.dumps(received)
    assert len(blob) < 200_000, f"the driver fetched {len(blob)} bytes"
    import pyarrow.parquet as pq

    cfg = Config()
    from yatt_ray.tasks.demo import prepare_demo

    prepare_demo(cfg)
    prompts = pq.read_table(cfg.data.train_files[0]).column("prompt").to_pylist()
    leaked = [p for p in prompts[:500] if p.encode() in blob]
    assert not leaked, f"prompt text reached the driver: {leaked[:3]}"
    for row in result.history:
        assert all(isinstance(v, float) for v in row.values())
