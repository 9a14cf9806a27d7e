"""Checkpoints in real runs on the shared cluster: resume (exactly once per prompt, one metrics curve, another
worker count, a damaged newest checkpoint), a killed worker, SIGTERM, a full disk, and the HF export.

Every run is the demo task cut to a few steps (8 prompts x 2 samples, no eval set) with a checkpoint every 2
steps and the per-step prompt-id log on; `prompt_audit` reads that log back. The runs whose subject is not the
rollout engine use the Hugging Face engine (`HF`: 5 s less start-up a run than vLLM on 2 cores); the first
run's lineage and the kill drill resume vLLM engines.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.runs import PROMPTS, assert_each_prompt_once, short_run, train_steps
from yatt_ray.checkpoint import CheckpointStore
from yatt_ray.config import Config
from yatt_ray.testing.drills import (
    committed_steps,
    corrupt_checkpoint,
    kill_training_worker,
    newest_position,
    newest_run_state,
    prompt_audit,
    prompt_records,
    surviving_records,
    when,
)
from yatt_ray.testing.faults import FAIL_WRITES

pytestmark = pytest.mark.cluster
# the first run's lineage trains in bf16 with the optimizer sharded over the data-parallel ranks, so its resumes
# on other worker counts cut the optimizer state from 2 shards to 1 whole and back
PRECISION = ("train.dtype=bf16", "train.distributed_optimizer=true")
HF = "rollout.engine=hf"


@pytest.fixture(scope="module")
def first_run(ray_cluster, demo_cache, tmp_path_factory):
    """4 steps on 2 workers (bf16, sharded optimizer), checkpoints at 2 and 4, the policy exported as HF at
    step 2."""
    tmp = tmp_path_factory.mktemp("resume")
    ckpt = str(tmp / "ckpt")
    return ckpt, short_run(ckpt, tmp, 4, "checkpoint.export_hf_steps=[2]", *PRECISION)


def test_run_commits_checkpoints_with_retention_and_export(first_run):
    ckpt, result = first_run
    assert train_steps(result) == [1, 2, 3, 4] and result.checkpoint_dir == ckpt
    assert committed_steps(ckpt) == [2, 4]
    assert CheckpointStore(ckpt).latest_valid().step == 4
    assert max(result.metric("checkpoint/failures")) == 0
    assert Path(ckpt, "hf", "step_00000002", "model.safetensors").exists()


def test_hf_export_loads_in_transformers_and_vllm(first_run):
    """The exported policy gives the same greedy tokens in transformers and in a vLLM engine (in a Ray task)."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = str(Path(first_run[0], "hf", "step_00000002"))
    tokenizer = AutoTokenizer.from_pretrained(export)
    prompt = tokenizer("12+7=")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    hf_tokens = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :]

    def vllm_greedy(path: str, ids: list[int]) -> list[int]:
        from yatt_ray.rollout import GenerateRequest, SamplingSpec, make_engine

        engine = make_engine("vllm", path, seed=0, kv_cache_gb=1.0)
        out = engine.generate(GenerateRequest([ids], SamplingSpec(n=1, max_new_tokens=4, temperature=0.0)))
        return list(out[0][0].token_ids)

    task = ray.remote(num_cpus=1)(vllm_greedy).remote(export, prompt)
    vllm_tokens = ray.get(task, timeout=600)
    assert vllm_tokens[: len(hf_tokens)] == hf_tokens.tolist()[: len(vllm_tokens)] and vllm_tokens


def test_resume_past_a_damaged_checkpoint_on_changing_worker_counts(first_run, tmp_path):
    """Step 4 is damaged: the resume warns, takes step 2, redoes 3-4 on one worker, runs to 6; the curve and
    the prompts continue as if nothing happened. Resumed again to 8 on 2 workers: the newest checkpoint still
    counts every prompt of steps 1-8 as consumed (a resume used to forget the ones before it). In bf16 with
    the optimizer sharded: its state is cut from 2 shards to 1 whole and back to 2 shards."""
    ckpt, first = first_run
    assert all(r["rollout_logp_diff"] < 0.05 for r in first.history if "reward_mean" in r)  # bf16 trainer
    corrupt_checkpoint(ckpt, 4)
    result = short_run(ckpt, tmp_path, 6, "train.dp_size=1", *PRECISION)
    assert result.metric("checkpoint/resumed_from") == [2.0]
    assert train_steps(result) == [1, 2, 3, 4, 5, 6]  # steps 1-2 come from the checkpoint's history
    assert result.history[0] == first.history[0]  # the same curve, not a new one
    assert committed_steps(ckpt)[-1] == 6
    assert_each_prompt_once(ckpt, 6)
    third = short_run(ckpt, tmp_path, 8, *PRECISION)
    assert third.metric("checkpoint/resumed_from") == [6.0] and train_steps(third) == list(range(1, 9))
    assert_each_prompt_once(ckpt, 8)


def test_a_continued_run_that_loses_a_worker_resumes_from_its_own_newest_commit(first_run, tmp_path):
    """docs/checkpoints.md's continuation (checkpoint.resume=<an earlier run's folder>) loses a worker after two commits
    of its own: it restarts from its own newest commit, not from the earlier folder again (which used to
    delete the commits it had written since), keeps every commit, and trains each prompt of the epoch once
    together with the earlier run."""
    earlier = first_run[0]
    base = int(newest_run_state(earlier)["step"])
    ckpt, seen = str(tmp_path / "ckpt"), []
    when(
        lambda: len(committed_steps(ckpt)) >= 2,
        lambda: seen.append((kill_training_worker(), committed_steps(ckpt))),
    )
    steps = base + 8
    result = short_run(
        ckpt, tmp_path, steps, f"checkpoint.resume={earlier}", "checkpoint.keep_last=10", *PRECISION
    )
    assert seen, "the drill did not kill a worker"
    resumed = result.metric("checkpoint/resumed_from")
    assert len(resumed) == 2 and resumed[0] == base, resumed  # the continuation, then the restart
    assert resumed[1] >= max(seen[0][1]), (resumed, seen)  # its own newest commit, not the earlier folder
    assert set(seen[0][1]) <= set(committed_steps(ckpt)) and committed_steps(ckpt)[-1] == steps
    assert train_steps(result) == list(range(1, steps + 1))
    assert_each_prompt_once(ckpt, steps, earlier=(earlier,))


def test_a_resumed_run_samples_what_the_uninterrupted_run_sampled(ray_cluster, demo_cache, tmp_path):
    """The HF engine at temperature 1 on one worker, every prompt the same (so the data order cannot matter):
    resumed from step 2, step 3 samples, scores and trains exactly as the uninterrupted run's step 3 did (the
    engine's sampling stream is in the checkpoint). Without KL the groups that scored alike skip the train step
    (`train.skip_zero_advantage`): that keeps no state a resume could lose."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from yatt_ray.tasks.demo import prepare_demo

    table = pq.read_table(prepare_demo(Config()).data.train_files[0]).slice(0, 1).to_pylist()[0]
    same = tmp_path / "same.parquet"
    pq.write_table(pa.Table.from_pylist([{**table, "id": i} for i in range(40)]), same)
    options = (
        f"data.train_files=[{same}]",
        "rollout.engine=hf",
        "train.dp_size=1",
        "rollout.temperature=1.0",
        "algo.kl_coef=0",
    )
    uninterrupted = short_run(str(tmp_path / "a"), tmp_path, 3, *options)
    resumed = short_run(
        str(tmp_path / "b"), tmp_path, 3, f"checkpoint.resume={tmp_path / 'a'}/step_00000002", *options
    )
    assert resumed.metric("checkpoint/resumed_from") == [2.0]

    def step_3(result) -> dict:
        row = next(r for r in result.history if "reward_mean" in r and r["step"] == 3)
        keys = ("reward_mean", "response_length", "accuracy", "truncated_fraction", "pg_loss", "entropy")
        keys += ("train/skipped_fraction", "grad_norm")
        return {k: row[k] for k in keys}

    assert max(uninterrupted.metric("train/skipped_fraction")) > 0  # some group did skip its train step
    assert step_3(resumed) == pytest.approx(step_3(uninterrupted), abs=1e-6)


def test_sigterm_then_ctrl_c_each_save_and_stop_and_the_next_run_resumes(ray_cluster, demo_cache, tmp_path):
    """SIGTERM (a scheduler's stop) stops the first run after its first commit, with a checkpoint of the step
    it stopped at; the second run resumes from there and is stopped by Ctrl-C (SIGINT, as a notebook's
    interrupt sends it: no traceback), again saved where it stopped; a third run resumes and finishes. One
    curve, each prompt trained once."""
    ckpt, steps = str(tmp_path / "ckpt"), 40
    stopped_at: list[int] = []

    def signal_after_a_commit_past(last: int, sig: signal.Signals) -> None:
        when(lambda: any(s > last for s in committed_steps(ckpt)), lambda: os.kill(os.getpid(), sig))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal_after_a_commit_past(max(stopped_at, default=0), sig)
        # 40 steps: a step takes 0.1-0.5 s and a stop lands 1-2 s after its signal (seen: signalled after
        # the commit of step 2, stopped at 10), so each run stops well before the end
        run = short_run(ckpt, tmp_path, steps, HF)
        assert run.stopped == sig.name
        if stopped_at:
            assert run.metric("checkpoint/resumed_from") == [float(stopped_at[-1])]
        stopped_at.append(train_steps(run)[-1])
        assert stopped_at[-1] < steps and committed_steps(ckpt)[-1] == stopped_at[-1]  # saved there
    assert stopped_at[0] < stopped_at[1], stopped_at
    last = short_run(ckpt, tmp_path, steps, HF)
    assert last.metric("checkpoint/resumed_from") == [float(stopped_at[-1])]
    assert train_steps(last) == list(range(1, steps + 1))
    assert_each_prompt_once(ckpt, steps)


def test_full_disk_during_a_save_keeps_training(ray_cluster, demo_cache, tmp_path, caplog):
    root = tmp_path / "ckpt"
    ckpt = f"faulty://{root}"
    when(lambda: bool(committed_steps(ckpt)), lambda: (root / "ranks" / FAIL_WRITES).write_text(""))
    # 8 steps, saves every 2: the disk fills after the first commit, however late the 0.2 s poll sees it
    # (with 4 steps a loaded machine could finish the last save before the drill struck)
    result = short_run(ckpt, tmp_path, 8, HF)
    assert train_steps(result) == list(range(1, 9))
    assert max(result.metric("checkpoint/failures")) > 0  # reported
    latest = CheckpointStore(ckpt).latest_valid()
    assert latest is not None and latest.step in (2, 4, 6)  # the checkpoint before the failure is intact


def test_dynamic_and_over_sampling_through_a_killed_worker_consume_each_prompt_once_per_epoch(
    ray_cluster, demo_cache, tmp_path
):
    """Dynamic sampling (dropped groups are consumed), over-sampling (aborted prompts are requeued, not
    consumed) and balancing on a 40-prompt data set, so the run crosses epochs; a worker is killed after the
    first checkpoint and the run restarts from it. Every finished epoch consumed each prompt exactly once:
    none lost, none repeated. With the optimizer sharded: the restarted ranks each read their own optimizer
    shard back. With checkpoint.resume=never: that refuses a used folder at the first start only; the restart
    continues the run from its own checkpoint (it used to fail with "already holds checkpoints")."""
    import pyarrow.parquet as pq

    from yatt_ray.tasks.demo import prepare_demo

    small = tmp_path / "small.parquet"
    pq.write_table(pq.read_table(prepare_demo(Config()).data.train_files[0]).slice(0, 40), small)
    ckpt, killed = str(tmp_path / "ckpt"), []
    when(lambda: bool(committed_steps(ckpt)), lambda: killed.append(kill_training_worker()))
    result = short_run(
        ckpt, tmp_path, 8, f"data.train_files=[{small}]", "algo.dynamic_sampling=reward", "algo.max_draws=3",
        "rollout.over_sample=1.5", "train.balance=tokens", "train.distributed_optimizer=true",
        "checkpoint.resume=never",
    )  # fmt: skip
    assert killed and result.metric("checkpoint/resumed_from"), "the drill did not restart the run"
    assert train_steps(result) == list(range(1, 9))  # one curve: redone steps appear once
    audit = prompt_audit(ckpt)
    assert audit.steps == 8, audit  # dropped groups are logged too: a step may hold more than 8 prompts
    assert audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit
    kept, _ = surviving_records(prompt_records(ckpt))
    by_epoch: dict[int, list] = {}
    for record in kept:
        for i, epoch in zip(record["ids"], record["epochs"]):
            by_epoch.setdefault(epoch, []).append(i)
    ids = set(pq.read_table(small).column("id").to_pylist())
    position = newest_position(ckpt)
    assert position is not None and position[0] == 8
    finished = [e for e in sorted(by_epoch) if e < position[1]]  # older than the oldest open epoch at the end
    assert finished, f"the run did not finish an epoch: {audit}, {position[1]}"
    for epoch in finished:
        assert sorted(by_epoch[epoch]) == sorted(ids), epoch
    assert (
        sum(result.metric("dynamic/dropped_groups")) > 0
        and sum(result.metric("rollout/requeued_prompts")) > 0
    )
    run = newest_run_state(ckpt)  # dynamic sampling's keep-rate estimate survives the restart
    assert run is not None and 0.1 <= run["keep_rate"] < 1.0, run["keep_rate"]


def test_two_verl_files_that_index_alike_resume_each_prompt_once_from_s3(
    ray_cluster, demo_cache, tmp_path, s3_options, monkeypatch
):
    """verl's GSM8K + MATH layout: gsm8k/train.parquet and math/train.parquet (one name in two folders), each
    indexing its 12 rows from 0 in extra_info.index. 2 steps, then a new run resumes to 5 (one worker, 8
    prompts a step: epoch 0 is steps 1-3): each of the 24 prompts of epoch 0 is trained exactly once. Keyed by
    index alone, the resume marked the other file's rows consumed (lost) and a step holding one index twice
    was not recorded (repeated). The run folder is on S3 (moto on 127.0.0.1: output.dir=s3://... with
    output.name), and with it the checkpoints: saves, the HF export and the resume all go through fsspec, and
    the second run is the same command again (train.steps raised), which finds the run by its name. The model
    comes from S3 too (model.path=s3://...), reached with the standard AWS_* variables only: fetched once per
    node into the model cache."""
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    from yatt_ray.tasks.demo import prepare_demo

    demo = pq.read_table(prepare_demo(Config()).data.train_files[0]).slice(0, 24).to_pylist()
    files = []
    for n, name in enumerate(("gsm8k", "math")):
        rows = [
            {
                "data_source": r["data_source"],
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
                "extra_info": {"split": "train", "index": i},
            }
            for i, r in enumerate(demo[12 * n : 12 * (n + 1)])
        ]
        (tmp_path / name).mkdir()
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name / "train.parquet")
        files.append(str(tmp_path / name / "train.parquet"))
    runs = f"s3://ckpt/{uuid.uuid4().hex}/runs"
    url = f"{runs}/verl/checkpoints"  # checkpoint.dir's default inside the run folder
    model = f"s3://ckpt/{uuid.uuid4().hex}/models/demo"
    for key, value in {"AWS_ENDPOINT_URL": s3_options["endpoint_url"], "AWS_ACCESS_KEY_ID": s3_options["key"],
                       "AWS_SECRET_ACCESS_KEY": s3_options["secret"], "AWS_DEFAULT_REGION": "us-east-1",
                       "YATT_RAY_MODEL_CACHE": str(tmp_path / "model_cache"),
                       "YATT_RAY_RUN_CACHE": str(tmp_path / "run_cache")}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    CheckpointStore(url, storage_options=s3_options).fs.put(
        prepare_demo(Config()).model.path + "/", model.removeprefix("s3://"), recursive=True
    )
    verl = (
        f"model.path={model}",
        f"data.train_files=[{files[0]},{files[1]}]", "data.answer_key=reward_model.ground_truth",
        "data.id_key=extra_info.index", "train.dp_size=1", HF, f"output.dir={runs}", "output.name=verl",
        *(f"checkpoint.storage_options.{k}={v}" for k, v in s3_options.items()),
    )  # fmt: skip
    first = short_run("", tmp_path, 2, "checkpoint.export_hf_steps=[2]", *verl)
    store = CheckpointStore(url, storage_options=s3_options)
    assert train_steps(first) == [1, 2] and store.list_committed() == [2]
    assert store.fs.exists(f"{store.root}/hf/step_00000002/model.safetensors")
    result = short_run("", tmp_path, 5, *verl)  # the same command, 5 steps: resumed mid-epoch
    assert first.checkpoint_dir == result.checkpoint_dir == url
    assert result.metric("checkpoint/resumed_from") == [2.0] and train_steps(result) == [1, 2, 3, 4, 5]
    assert store.list_committed() == [2, 4, 5] and store.latest_valid().step == 5  # every 2 steps + the end
    cached = result.config.model.path  # the workers read the fetched copy, the same path on every node
    assert (
        cached.startswith(str(tmp_path / "model_cache"))
        and Path(cached, ".yatt-complete").read_text() == model
    )
    # Ray Train's final report (the policy as a HF directory) goes beside the checkpoints, where every node
    # reaches it, not to the driver's disk; the driver then fetches it into the run folder
    reported = sorted(
        store.fs.glob(f"{url.removeprefix('s3://')}/ray/train-*/**/policy_hf/model.safetensors")
    )
    assert len(reported) == 2, reported  # each run's report (Ray Train runs named train-<date-time>)
    assert result.checkpoint_path == str(Path(result.output_dir) / "final_hf")
    assert Path(result.checkpoint_path, "model.safetensors").read_bytes() == store.fs.cat(reported[-1])
    # the run folder (metrics, config, the final policy) uploaded beside its checkpoints; the first curve kept
    folder = f"{runs.removeprefix('s3://')}/verl"
    curve = [json.loads(line) for line in store.fs.cat(f"{folder}/metrics.jsonl").splitlines()]
    assert [int(r["step"]) for r in curve if "reward_mean" in r] == [1, 2, 3, 4, 5]
    assert len(store.fs.glob(f"{folder}/metrics-*.jsonl")) == 1 and store.fs.exists(f"{folder}/config.yaml")
    assert store.fs.cat(f"{folder}/final_hf/model.safetensors") == store.fs.cat(reported[-1])
    audit = prompt_audit(url, storage_options=s3_options)
    assert audit.steps == 5 and audit.prompts == 5 * PROMPTS, audit
    assert audit.duplicated == 0 and audit.lost == 0 and audit.forgotten == 0, audit


def test_the_same_command_with_the_same_output_name_continues_the_run(ray_cluster, demo_cache, tmp_path):
    """docs/checkpoints.md's rule: `output.name` names the run's folder inside `output.dir`; the same command
    again (here with train.steps raised) continues from that folder's newest checkpoint: one curve with each
    step once, the earlier curve's file kept, every prompt of the epoch trained once over both runs."""
    first = short_run("", tmp_path, 2, "output.name=my-run", HF)
    again = short_run("", tmp_path, 4, "output.name=my-run", HF)
    folder = tmp_path / "my-run"
    assert first.output_dir == again.output_dir == str(folder)
    assert again.checkpoint_dir == first.checkpoint_dir == str(folder / "checkpoints")
    assert again.metric("checkpoint/resumed_from") == [2.0] and train_steps(again) == [1, 2, 3, 4]
    curve = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in curve if "reward_mean" in r] == [1, 2, 3, 4]
    kept = list(folder.glob("metrics-*.jsonl"))
    assert len(kept) == 1 and '"reward_mean"' in kept[0].read_text()
    assert_each_prompt_once(again.checkpoint_dir, 4)
