import json
import math

import numpy as np
import pytest
import torch

from yatt_ray.metrics import JsonlSink, MultiSink, TensorBoardSink, read_jsonl, validate_metrics


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
