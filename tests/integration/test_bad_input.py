"""Bad input fails before any cluster work, with a message that names the value and the fix."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import yatt_ray
from yatt_ray.models.tiny import build_tiny_model
from yatt_ray.testing.drills import live_actor_pids


def config(tmp_path, *over):
    return yatt_ray.load_config("examples/configs/grpo.yaml", [f"output.dir={tmp_path}/run", *over])


@pytest.fixture(scope="module")
def good_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 0, "prompt": "1+2=", "ground_truth": "3"}] * 8), path)
    return path


def test_missing_model_directory(tmp_path, good_data):
    with pytest.raises(yatt_ray.ConfigError, match="no_model' does not exist; .*Fix model.path") as info:
        yatt_ray.fit(config(tmp_path, f"model.path={tmp_path}/no_model", f"data.train_files=[{good_data}]"))
    assert "no_model" in str(info.value)


def test_parquet_without_prompt_column(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+2=", "ground_truth": "3"}]), bad)
    with pytest.raises(yatt_ray.DataError, match="no column 'prompt'.*data.prompt_key"):
        yatt_ray.fit(config(tmp_path, f"model.path={model}", f"data.train_files=[{bad}]"))


def test_model_without_data_is_not_silently_the_demo(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    with pytest.raises(yatt_ray.ConfigError, match="data.train_files is empty while the other input is set"):
        yatt_ray.fit(config(tmp_path, f"model.path={model}"))


def test_unknown_algorithm_and_kl(tmp_path):
    with pytest.raises(yatt_ray.ConfigError, match="algo.name='ppo2' is unknown"):
        yatt_ray.fit(config(tmp_path, "algo.name=ppo2"))
    with pytest.raises(yatt_ray.ConfigError, match="algo.kl_estimator='k4' is unknown; valid: k1, k2, k3"):
        yatt_ray.fit(config(tmp_path, "algo.kl_estimator=k4"))


def test_more_workers_than_the_cluster_can_place(tmp_path, ray_cluster, demo_cache):
    """The shared cluster declares 8 CPUs: 8 workers plus a data CPU do not fit; nothing is started."""
    import ray

    before = len(ray.util.placement_group_table())
    with pytest.raises(yatt_ray.PlacementError, match=r"needs 9 CPUs .* cluster has 8.*Lower train.dp_size"):
        yatt_ray.fit(config(tmp_path, "train.dp_size=8"))
    assert len(ray.util.placement_group_table()) == before


def test_disaggregated_placement_without_accelerators_for_the_judge(tmp_path, ray_cluster, demo_cache):
    """The shared cluster declares 4 logical GPUs: 2 trainers + 3 judge replicas do not fit; nothing starts."""
    import ray

    over = (
        "reward.mode=genrm",
        "placement.mode=disaggregated",
        "reward.genrm.replicas=3",
        "cluster.use_gpu=true",
    )
    with pytest.raises(
        yatt_ray.PlacementError, match=r"disaggregated placement needs 5 GPUs: .* cluster has 4"
    ):
        yatt_ray.fit(config(tmp_path, "train.dp_size=2", "train.prompts_per_step=2", *over))
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in names if "yatt-genrm" in n], names


def test_a_reward_that_raises_mid_run_stops_once_with_its_type(tmp_path, ray_cluster, demo_cache):
    """The driver's dry call passes; the 20th call in the worker raises (step 2). The run stops with a
    RewardError naming reward.function and the sample, and no restarted attempt runs into it again."""
    model = build_tiny_model(tmp_path / "model")
    raised = tmp_path / "raised.log"
    rows = [
        {"id": i, "prompt": f"{i}+1=", "ground_truth": str(i + 1), "data_source": str(raised)}
        for i in range(64)
    ]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    fn = "tests.reward.rule_fns:fails_on_the_twentieth_call"
    over = (f"model.path={model}", f"data.train_files=[{data}]", "train.dp_size=1", "train.prompts_per_step=8",
            "rollout.n=2", "train.steps=4", f"reward.function={fn}", "output.progress=false")  # fmt: skip
    with pytest.raises(yatt_ray.RewardError, match=rf"reward.function={fn!r}.*ZeroDivisionError") as info:
        yatt_ray.fit(config(tmp_path, *over))
    assert "raised in a training worker" in str(info.value)
    assert raised.read_text().count("raised") == 1  # the attempt after it did not train into it again
    # the run's actor (metrics hub and run control) ended with the run, though `info`'s traceback holds its handle
    assert not live_actor_pids("RunActor", settle_s=10), "the run left its RunActor alive"


@pytest.fixture(scope="module")
def images_nowhere(ray_cluster, tmp_path_factory):
    """A tiny LLaVA and 32 visual problems whose images all point nowhere: a parquet file in verl's layout
    ([{"path": ...}]) and a jsonl file of bare path strings."""
    import json

    from yatt_ray.models.tiny_vlm import build_tiny_vlm
    from yatt_ray.tasks import visual

    tmp = tmp_path_factory.mktemp("nowhere")
    model = build_tiny_vlm(tmp / "vlm")
    rows = visual.make_problems(32, seed=5)
    for r in rows:
        r["images"] = [{"path": str(tmp / "gone" / f"{r['id']}.png")}]
    parquet = visual.write_rows(rows, tmp / "train.parquet")
    jsonl = tmp / "train.jsonl"
    jsonl.write_text("".join(json.dumps({**r, "images": [r["images"][0]["path"]]}) + "\n" for r in rows))
    return str(model), parquet, str(jsonl)


def vision_config(tmp_path, model: str, data: str, *over: str):
    return yatt_ray.load_config(
        "examples/configs/grpo_vision.yaml",
        [f"model.path={model}", f"data.train_files=[{data}]", "data.eval_files=[]", f"output.dir={tmp_path}/run",
         "output.progress=false", "output.tensorboard=false", "output.plot=false", "rollout.engine=hf",
         "train.dp_size=1", "train.prompts_per_step=4", "rollout.n=2", "train.steps=2", *over],
    )  # fmt: skip


def test_a_vision_run_whose_images_all_fail_to_load_stops_naming_the_column_and_ids(tmp_path, images_nowhere):
    """Not a pipeline read again and again for ever: the epoch's rows all rejected stop the run, once."""
    import time

    model, parquet, _ = images_nowhere
    start = time.monotonic()
    with pytest.raises(yatt_ray.DataError) as info:
        yatt_ray.fit(vision_config(tmp_path, model, parquet))
    message = str(info.value)
    assert "all 32 rows of epoch 0 were rejected: their images (column data.image_key='images')" in message
    assert re.search(
        r"For example id (\d+): row \1 image 0 \(path '[^']*gone/\1\.png'\) does not exist", message
    )
    assert "raised in a training worker" in message and time.monotonic() - start < 300


def test_a_stop_request_ends_a_run_that_waits_for_usable_rows(tmp_path, images_nowhere, monkeypatch):
    """SIGTERM to the driver (its flag raised as the run starts) while every row is rejected and no bound is
    set: the workers, with no step under way, see it and the run returns as stopped, not an error."""
    import signal

    from yatt_ray import run_control

    class Received:  # the driver's PreemptionFlag once SIGTERM arrived
        requested, received = True, signal.SIGTERM

        def close(self) -> None:
            pass

    original = run_control.StopOnSignal.__init__

    def sigterm_at_start(self, control, enabled: bool) -> None:
        original(self, control, enabled=False)
        self.flag = Received()

    monkeypatch.setattr(run_control.StopOnSignal, "__init__", sigterm_at_start)
    model, _, jsonl = images_nowhere
    result = yatt_ray.fit(vision_config(tmp_path, model, jsonl, "data.max_rejected_in_a_row=null"))
    assert result.stopped == "SIGTERM" and not [r for r in result.history if "reward_mean" in r]
