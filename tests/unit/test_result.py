"""The Result a run returns, as a notebook shows it, its history as a DataFrame, and the run folder's config.yaml
(no cluster)."""

import sys

import pytest

from yatt_ray import load_config
from yatt_ray.fit import Result, read_run_config, write_run_config
from yatt_ray.testing.run_folder import check_run_folder

fit_module = sys.modules["yatt_ray.fit"]  # `yatt_ray.fit` the attribute is the function

STEPS = 40


def a_result(config=None) -> Result:
    history = [{"step": 0.0, "eval/reward_mean": 0.2, "eval/accuracy": 0.125}]
    for step in range(1, STEPS + 1):
        history.append(
            {"step": float(step), "reward_mean": 0.5 + step / 100, "accuracy": step / 50, "lr": 5e-4}
        )
        history.append({"step": float(step), "idle/mean": 0.1, "idle/max": 0.2})
    history.append({"step": float(STEPS), "eval/reward_mean": 0.9, "eval/accuracy": 0.875})
    return Result(
        history=history,
        checkpoint_path="/runs/grpo/20260101-000000/checkpoints/final/policy_hf",
        output_dir="/runs/grpo/20260101-000000",
        rollout_engine="hf",
        config=config,
    )


def test_the_repr_is_a_short_summary_with_the_figures():
    result = a_result()
    text = repr(result)
    assert len(text) < 300 and "\n" not in text, text  # not the 81-row history
    for figure in ("steps=40", "reward_mean=0.9", "accuracy=0.8", "eval/accuracy='0.125 -> 0.875'"):
        assert figure in text, text
    assert "checkpoint_path='/runs/grpo/20260101-000000/checkpoints/final/policy_hf'" in text
    assert "output_dir='/runs/grpo/20260101-000000'" in text
    assert "idle" not in text and "lr" not in text
    html = result._repr_html_()
    assert (
        len(html) < 1500 and "0.125 -&gt; 0.875" in html and "policy_hf" in html and "history_frame()" in html
    )


def test_the_summary_counts_steps_against_the_config_and_says_why_a_run_stopped():
    config = load_config("examples/configs/grpo.yaml", [f"train.steps={STEPS + 10}"])
    result = a_result(config)
    result.stopped, result.steps_redone = "SIGTERM", 2
    text = repr(result)
    assert f"steps='40/{STEPS + 10}'" in text and "stopped='SIGTERM'" in text and "steps_redone=2" in text
    assert "Config(" not in text  # the config stays out of the view
    empty = repr(Result())
    assert empty == "Result(steps=0, checkpoint_path=None, output_dir='')"


def test_the_history_frame_has_one_row_per_step():
    frame = a_result().history_frame()
    assert list(frame.index) == list(range(STEPS + 1)) and frame.index.name == "step"
    assert frame.loc[STEPS, "reward_mean"] == pytest.approx(0.9)
    assert frame.loc[STEPS, "eval/accuracy"] == 0.875 and frame.loc[STEPS, "idle/mean"] == 0.1  # rows merged
    assert frame.loc[0, "eval/accuracy"] == 0.125 and frame["reward_mean"].isna()[0]  # step 0: eval only
    assert "step" not in frame.columns
    assert Result().history_frame().empty


def test_config_yaml_round_trips_to_the_resolved_config(tmp_path):
    config = load_config(
        "examples/configs/grpo.yaml",
        ["train.steps=7", "data.eval_files=[]", "algo.dynamic_sampling=off", "output.wandb_mode=offline",
         "data.train_files=[/data/a.parquet, /data/b.parquet]", "critic.value_clip=null", "train.lr=1e-5"],
    )  # fmt: skip
    config.freeze()
    path = write_run_config(config, tmp_path)
    assert path == tmp_path / "config.yaml" and path.read_text().startswith("# ")
    assert read_run_config(tmp_path) == config
    assert (
        load_config(path) == config
    )  # valid as it stands: `--config <run folder>/config.yaml` repeats the run
    check_run_folder(tmp_path, config)


def test_config_yaml_redacts_the_storage_options(tmp_path):
    config = load_config(
        None, ["checkpoint.storage_options.key=AKIA123", "checkpoint.storage_options.secret=s3cr3t"]
    )
    write_run_config(config, tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    assert "AKIA123" not in text and "s3cr3t" not in text
    assert read_run_config(tmp_path).checkpoint.storage_options == {
        "key": "<redacted>",
        "secret": "<redacted>",
    }
    check_run_folder(tmp_path, config)
    with pytest.raises(AssertionError, match=r"train.steps: 80 in config.yaml, 3 in the run's config"):
        check_run_folder(tmp_path, load_config(None, ["train.steps=3"]))


def test_the_driver_writes_config_yaml_once_the_config_is_resolved_and_frozen(tmp_path, monkeypatch):
    """`fit` writes config.yaml right after it froze the resolved config, before the run starts."""
    import ray

    import yatt_ray.placement as placement

    class Plan:
        genrm = None  # no judge

        def describe(self) -> str:
            return "plan"

    seen = {}

    def run(config, plan, files, real_gpus, output_dir, startup):
        seen["frozen"] = config.__dict__.get("_frozen")
        seen["on_disk"] = read_run_config(output_dir)
        return Result(output_dir=str(output_dir), config=config)

    monkeypatch.setattr(fit_module, "_check_checkpoints", lambda config, output_dir: "checkpoints")
    monkeypatch.setattr(fit_module, "connect", lambda config: None)
    monkeypatch.setattr(fit_module, "_start_autoscaling_coordinator", lambda: None)
    monkeypatch.setattr(fit_module, "check_shared", lambda paths, timeout_s: None)  # one node
    monkeypatch.setattr(fit_module, "_model_sizes", lambda config: None)
    monkeypatch.setattr(fit_module, "_gpu_memory_gb", lambda plan, timeout_s: 80.0)  # no CPU kernel timing
    monkeypatch.setattr(fit_module, "_check_device_memory", lambda config, plan, sizes, read_gb: "memory")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(placement, "plan_placement", lambda config, resources, sizes=None: Plan())

    def resolve(config, plan, on_gpu):
        config.rollout.engine = "hf"
        return "hf"

    monkeypatch.setattr(fit_module, "_resolve_engine", resolve)
    monkeypatch.setattr(fit_module, "_run", run)
    config = load_config(None, ["train.steps=3"])
    from yatt_ray.metrics.startup import Startup
    from yatt_ray.model_source import model_source

    result = fit_module._start(config, {}, tmp_path, Startup(), model_source(""))
    assert seen["frozen"] and seen["on_disk"] == config and config.rollout.engine == "hf"
    check_run_folder(result.output_dir, result.config)
