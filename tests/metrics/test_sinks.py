import json
import math
import struct
import sys
import time

import numpy as np
import pytest
import torch

from yatt_ray.config import Config
from yatt_ray.errors import ConfigError
from yatt_ray.metrics import JsonlSink, MultiSink, TensorBoardSink, read_jsonl, validate_metrics
from yatt_ray.metrics.sinks import MlflowSink, WandbSink, build_sinks, flatten_params


def test_jsonl_writes_one_object_per_step_and_flushes(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"  # parent folder is created
    sink = JsonlSink(path)
    sink.write(0, {"reward_mean": 0.25, "tokens": 120})
    # flushed after each write: readable before close
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 0, "reward_mean": 0.25, "tokens": 120}
    sink.write(1, {"reward_mean": np.float32(0.5), "ok": True, "loss": float("nan")})
    sink.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    second = json.loads(lines[1])
    assert (
        second["step"] == 1
        and second["reward_mean"] == 0.5
        and second["ok"] == 1
        and math.isnan(second["loss"])
    )
    assert isinstance(second["reward_mean"], float)
    # append mode: a resumed run continues the file
    with JsonlSink(path) as again:
        again.write(2, {"reward_mean": 0.75})
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="is closed"):
        sink.write(3, {"x": 1.0})


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (torch.tensor(1.0), "Tensor of shape ()"),
        (torch.ones(3), r"Tensor of shape \(3,\)"),
        (np.ones(2), r"ndarray of shape \(2,\)"),
        ([1.0, 2.0], "list"),
        ("0.5", "str"),
        (None, "NoneType"),
        (1 + 2j, "complex"),
    ],
)
def test_non_scalar_rejected_naming_the_key(tmp_path, value, what):
    sink = JsonlSink(tmp_path / "m.jsonl")
    with pytest.raises(TypeError, match=rf"metric 'bad/key' must be a real scalar.*got {what}.*\.item\(\)"):
        sink.write(0, {"good": 1.0, "bad/key": value})
    sink.close()
    assert (tmp_path / "m.jsonl").read_text() == ""  # nothing half-written


def test_validate_step_and_keys():
    assert validate_metrics(3, {"a": np.int64(2), "b": 1.5}) == {"a": 2, "b": 1.5}
    with pytest.raises(TypeError, match="step must be an int"):
        validate_metrics(1.0, {})
    with pytest.raises(TypeError, match="step must be an int"):
        validate_metrics(True, {})
    with pytest.raises(ValueError, match="step must be >= 0"):
        validate_metrics(-1, {})
    with pytest.raises(ValueError, match="'step' is reserved"):
        validate_metrics(0, {"step": 1})
    with pytest.raises(TypeError, match="non-empty strings"):
        validate_metrics(0, {1: 1.0})


def _read_tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def test_tensorboard_scalars_read_back(tmp_path):
    with TensorBoardSink(tmp_path / "tb") as sink:
        sink.write(0, {"reward_mean": 0.25, "time/rollout": 1.5})
        sink.write(1, {"reward_mean": 0.5})
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    acc = _read_tensorboard(tmp_path / "tb")
    assert sorted(acc.Tags()["scalars"]) == ["reward_mean", "time/rollout"]
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(0, 0.25), (1, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("time/rollout")] == [(0, 1.5)]
    with pytest.raises(RuntimeError, match="is closed"):
        sink.write(2, {"reward_mean": 1.0})


def test_multisink_fans_out_and_validates_once(tmp_path):
    jsonl = JsonlSink(tmp_path / "m.jsonl")
    tb = TensorBoardSink(tmp_path / "tb")
    with MultiSink([jsonl, tb]) as sink:
        sink.write(5, {"accuracy": 0.75})
        with pytest.raises(TypeError, match="'bad'"):
            sink.write(6, {"accuracy": 1.0, "bad": torch.ones(2)})
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 5, "accuracy": 0.75}]
    assert [(e.step, e.value) for e in _read_tensorboard(tmp_path / "tb").Scalars("accuracy")] == [(5, 0.75)]


def test_multisink_close_closes_all_then_raises_first():
    closed = []

    class Broken:
        def close(self):
            closed.append("broken")
            raise OSError("disk gone")

    class Fine:
        def close(self):
            closed.append("fine")

    with pytest.raises(OSError, match="disk gone"):
        MultiSink([Broken(), Fine()]).close()
    assert closed == ["broken", "fine"]


def test_flatten_params_dots_keys_and_redacts_secrets():
    tree = {
        "algo": {"lr": 1e-6, "kl": {"coef": 0.1}},
        "data": {"prompt_key": "prompt", "max_tokens": 8, "files": ["a", "b"]},
        "checkpoint": {
            "storage_options": {"key": "AKIA", "client_kwargs": {"endpoint_url": "x"}},
            "extra": {},
        },
        "genrm": {"api_key": "sk-1", "token": "", "db_password": "pw"},
    }
    assert flatten_params(tree) == {
        "algo.lr": 1e-6,
        "algo.kl.coef": 0.1,
        "data.prompt_key": "prompt",  # a column name, not a secret
        "data.max_tokens": 8,
        "data.files": ["a", "b"],
        "checkpoint.storage_options.key": "<redacted>",
        "checkpoint.storage_options.client_kwargs.endpoint_url": "<redacted>",
        "checkpoint.extra": {},
        "genrm.api_key": "<redacted>",
        "genrm.token": "",  # nothing to hide
        "genrm.db_password": "<redacted>",
    }


@pytest.fixture
def file_store_env(monkeypatch):
    """No MLflow env from outside; whatever the sink sets is undone after the test."""
    for name in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(name, "x")  # recorded as unset, so teardown removes what the sink sets
        monkeypatch.delenv(name)


def _mlflow_run(uri, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return client, client.get_run(run_id)


def test_mlflow_file_store_metrics_with_steps_and_params(tmp_path, file_store_env):
    import os

    uri = f"file:{tmp_path / 'mlruns'}"
    params = {"algo": {"lr": 1e-6}, "reward": {"function": "x" * 700}, "data": {"files": ["a.jsonl"]}}
    with MlflowSink(uri, "exp", run_name="run-1", params=params) as sink:
        assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # MLflow 3 refuses a file store otherwise
        sink.write(0, {"reward_mean": 0.25, "tokens": 120})
        sink.write(1, {"reward_mean": 0.5, "loss": float("nan")})
        sink.write(1, {"reward_mean": 0.75})  # a step redone after a restart
        sink.write(0, {"idle/mean": 0.125})  # idle rows come after later training rows
    client, run = _mlflow_run(uri, sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-1"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    history = [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "reward_mean")]
    assert sorted(history) == [(0, 0.25), (1, 0.5), (1, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "idle/mean")] == [(0, 0.125)]
    assert math.isnan(run.data.metrics["loss"]) and run.data.metrics["tokens"] == 120
    assert run.data.params["algo.lr"] == "1e-06"
    assert run.data.params["data.files"] == "['a.jsonl']"
    long = run.data.params["reward.function"]
    assert len(long) == MlflowSink.PARAM_VALUE_LIMIT == 500 and long == "x" * 497 + "..."
    with pytest.raises(RuntimeError, match="is closed"):
        sink.write(2, {"reward_mean": 1.0})
    sink.close()  # closing twice is a no-op
    # a second run into the same store and experiment
    with MlflowSink(uri, "exp") as again:
        again.write(0, {"reward_mean": 0.0})
    assert _mlflow_run(uri, again.run_id)[1].info.experiment_id == run.info.experiment_id


def test_mlflow_refused_store_is_a_config_error(tmp_path, file_store_env, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # an explicit choice is kept
    with pytest.raises(ConfigError, match=r"output.mlflow_tracking_uri='file:.*mlruns'.*maintenance mode"):
        MlflowSink(f"file:{tmp_path / 'mlruns'}")


def _read_wandb_records(path):
    """Records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header, then LevelDB-log blocks of
    32 KiB holding chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) of protobuf
    ``Record`` messages. A chunk not yet fully written ends the read."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_wandb_records(run_dir, timeout_s=20.0):
    """The run's records once the exit record is on disk: ``finish()`` can return before W&B's background
    process has flushed the file (seen here: 7 bytes just after, the whole log a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        logs = list(run_dir.glob("run-*.wandb"))
        records = _read_wandb_records(logs[0]) if logs else []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            assert len(logs) == 1
            return records
        assert time.monotonic() < deadline, f"no exit record in {run_dir} after {timeout_s} s: {logs}"
        time.sleep(0.05)


def _wandb_history(records):
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                "/".join(item.nested_key) or item.key: json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_X_DISABLE_META", "true")  # host metadata takes ~3 s to gather here
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_wandb_offline_history_config_and_repeated_steps(tmp_path, wandb_env):
    params = {"algo": {"lr": 1e-6}, "checkpoint": {"storage_options": {"secret": "s"}}}
    with WandbSink("proj", directory=tmp_path, run_name="run-1", params=params) as sink:
        sink.write(0, {"reward_mean": 0.25})
        sink.write(1, {"reward_mean": 0.5})
        sink.write(1, {"reward_mean": 0.75})  # redone step: kept as a second row
        sink.write(0, {"idle/mean": 0.125})  # an earlier step: kept, not dropped by W&B
        sink.write(2, {"reward_mean": float("nan"), "tokens": 7})
    sink.close()
    run_dir = sink.run_dir
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    records = _finished_wandb_records(run_dir)  # an exit record: the run was finished
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "proj" and run.display_name == "run-1"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["algo.lr"] == 1e-6 and config["checkpoint.storage_options.secret"] == "<redacted>"
    history = _wandb_history(records)
    assert history[:4] == [
        {"step": 0, "reward_mean": 0.25},
        {"step": 1, "reward_mean": 0.5},
        {"step": 1, "reward_mean": 0.75},
        {"step": 0, "idle/mean": 0.125},
    ]
    assert history[4]["step"] == 2 and history[4]["tokens"] == 7 and math.isnan(history[4]["reward_mean"])
    # every metric is plotted against our step, not W&B's row counter
    metrics = {
        r.metric.glob_name or r.metric.name: r.metric.step_metric for r in records if r.metric.ByteSize()
    }
    assert metrics.get("*") == "step"
    with pytest.raises(RuntimeError, match="is closed"):
        sink.write(3, {"reward_mean": 1.0})


def test_wandb_bad_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"output.wandb_mode='cloud' is not a W&B mode.*'offline'"):
        WandbSink(mode="cloud")


@pytest.mark.parametrize(
    ("module", "make", "key", "package"),
    [
        ("mlflow", lambda: MlflowSink("file:/nowhere"), "output.mlflow", "mlflow-skinny"),
        ("wandb", lambda: WandbSink(), "output.wandb", "wandb"),
    ],
)
def test_missing_package_names_key_and_install_command(monkeypatch, module, make, key, package):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail
    with pytest.raises(
        ConfigError, match=rf"{key}=true needs the '{package}' package.*pip install {package}"
    ):
        make()


def test_build_sinks_from_config(tmp_path, file_store_env, wandb_env, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("WANDB_DIR")
    config = Config()
    config.output.dir = str(tmp_path / "runs")
    config.output.tensorboard = False
    config.output.mlflow = config.output.wandb = True
    output_dir = tmp_path / "runs" / "20260101-000000"
    sinks = build_sinks(config, output_dir)
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "MlflowSink", "WandbSink"]
    with MultiSink(sinks) as sink:
        sink.write(0, {"reward_mean": 0.5})
    mlflow_sink, wandb_sink = sinks[1], sinks[2]
    assert (
        mlflow_sink.tracking_uri == f"file:{tmp_path / 'runs' / 'mlruns'}"
    )  # shared by the runs in output.dir
    run = MlflowClient(tracking_uri=mlflow_sink.tracking_uri).get_run(mlflow_sink.run_id)
    assert run.info.run_name == "20260101-000000" and run.data.metrics == {"reward_mean": 0.5}
    assert run.data.params["output.run_dir"] == str(output_dir)
    assert run.data.params["train.lr"] == str(config.train.lr)
    assert wandb_sink.run_dir.parent == output_dir / "wandb"
    assert read_jsonl(output_dir / "metrics.jsonl") == [{"step": 0, "reward_mean": 0.5}]

    # a sink that fails to start closes those already made
    config.output.wandb_mode = "bogus"
    with pytest.raises(ConfigError, match="output.wandb_mode='bogus'"):
        build_sinks(config, tmp_path / "runs" / "20260101-000001")
    runs = MlflowClient(tracking_uri=mlflow_sink.tracking_uri).search_runs([run.info.experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
