"""DriverProgress without Ray: `receive` (what `poll` does after its fetch) and `close`, and `poll` against a
stand-in hub with `ray.get` replaced (Ray is imported, never started)."""

import json

import pytest

from yatt_ray.config import Config
from yatt_ray.metrics.history import MetricRow
from yatt_ray.metrics.sinks import read_jsonl
from yatt_ray.metrics.timeline import Span, to_wire
from yatt_ray.progress import DriverProgress, idle_report_line, idle_stats


def T(values: dict) -> MetricRow:
    """A training step's row."""
    return MetricRow("train", values)


def _config() -> Config:
    cfg = Config()
    cfg.output.tensorboard = False
    cfg.output.progress = False
    cfg.output.plot = True
    return cfg


def _step_spans(step, t0, worker="rank0", acc="gpu0"):
    """A 10 s trainer step: busy 0..4 (rollout), waiting 4..6, busy 6..10 (train) -> 20% idle."""
    return [
        Span("trainer", worker, acc, "rollout", step, t0, t0 + 4, True),
        Span("trainer", worker, acc, "wait_reward", step, t0 + 4, t0 + 6, False),
        Span("trainer", worker, acc, "train", step, t0 + 6, t0 + 10, True),
    ]


def _genrm(step, t0):
    return [Span("genrm", "genrm-1", "gpu1", "judge", step, t0 + 3, t0 + 6, True)]  # 70% idle


def test_idle_rows_once_a_step_is_settled_and_the_rest_at_close(tmp_path, capsys):
    progress = DriverProgress(None, _config(), tmp_path)
    progress.receive([T({"step": 1.0, "reward_mean": 0.1, "accuracy": 0.0})], to_wire(_step_spans(1, 100.0)))
    assert not any("idle/mean" in r for r in progress.history)  # step 1 may still grow
    progress.receive(
        [T({"step": 2.0, "reward_mean": 0.2, "accuracy": 0.5})],
        to_wire(_genrm(2, 110.0) + _step_spans(2, 110.0)),
    )
    # step 1 is settled now; gpu1 (known by now) did nothing in step 1's window: idle 1.0 there
    idle_rows = [r for r in progress.history if "idle/mean" in r]
    assert idle_rows == [{"step": 1.0, "idle/mean": pytest.approx(0.6), "idle/max": 1.0}]
    progress.close()
    idle_rows = [r for r in progress.history if "idle/mean" in r]
    assert [r["step"] for r in idle_rows] == [1.0, 2.0]
    assert idle_rows[1] == {"step": 2.0, "idle/mean": pytest.approx(0.45), "idle/max": pytest.approx(0.7)}
    # training rows are untouched and are still the only rows with reward_mean; every value is a float
    assert [r["step"] for r in progress.history if "reward_mean" in r] == [1.0, 2.0]
    assert all(isinstance(v, float) for r in progress.history for v in r.values())
    # every history row reached metrics.jsonl
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == len(progress.history)

    idle = read_jsonl(tmp_path / "idle.jsonl")
    assert idle[0] == {
        "step": 1,
        "idle/mean": pytest.approx(0.6),
        "idle/max": 1.0,
        "idle/gpu0": pytest.approx(0.2),
        "idle/gpu1": 1.0,
    }
    assert idle[1]["idle/gpu1"] == pytest.approx(0.7) and idle[1]["idle/gpu0"] == pytest.approx(0.2)
    trace = json.loads((tmp_path / "timeline.json").read_text())
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == 7
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "idle (bubble)" in out and "genrm 85.0%" in out and "trainer 20.0%" in out


def test_without_spans_nothing_of_the_timeline_is_written(tmp_path, capsys):
    progress = DriverProgress(None, _config(), tmp_path)
    progress.receive([T({"step": 1.0, "reward_mean": 0.1, "accuracy": 0.0})])
    progress.close()
    assert not any((tmp_path / name).exists() for name in ("timeline.json", "timeline.png", "idle.jsonl"))
    assert len(progress.history) == 1 and "idle" not in capsys.readouterr().out


def test_poll_counts_hub_rows_not_history_rows(tmp_path, monkeypatch):
    """Idle rows join the history, so the next fetch must start from the number of rows the hub gave."""
    import ray

    class Method:
        def __init__(self, fn):
            self.remote = fn

    class StandInHub:
        def __init__(self):
            self.rows = [T({"step": 1.0, "reward_mean": 0.1, "accuracy": 0.0})]
            self.spans = to_wire(_step_spans(1, 100.0) + _step_spans(2, 110.0))
            self.asked = []
            self.rows_since = Method(lambda i: self.asked.append(i) or self.rows[i:])
            self.spans_since = Method(lambda i: self.spans[i:])

    monkeypatch.setattr(ray, "get", lambda refs, timeout: list(refs))
    hub = StandInHub()
    progress = DriverProgress(hub, _config(), tmp_path)
    progress.poll()
    assert len(progress.history) == 2  # the row and step 1's idle row
    hub.rows.append(T({"step": 2.0, "reward_mean": 0.2, "accuracy": 0.5}))
    progress.poll()
    assert hub.asked == [0, 1]
    assert [r["step"] for r in progress.history if "reward_mean" in r] == [1.0, 2.0]
    assert len(progress.spans) == 6  # no span fetched twice


def test_idle_helpers():
    assert idle_stats({"a": 0.25, "b": 0.75}) == {"idle/mean": 0.5, "idle/max": 0.75}
    assert idle_stats({}) == {}
    assert idle_report_line({}, []) == ""


def test_redone_steps_keep_one_curve_in_the_history_and_in_metrics_jsonl(tmp_path):
    """A restart from the step-2 checkpoint redoes steps 3-4: the file is written as one curve while the run
    goes (no rewrite afterwards), and the count of redone steps is kept."""
    progress = DriverProgress(None, _config(), tmp_path)
    first = [T({"step": float(s), "reward_mean": 0.1 * s, "accuracy": 0.0}) for s in (1, 2, 3, 4)]
    progress.receive(first + [MetricRow("checkpoint", {"step": 2.0, "checkpoint/resumed_from": 2.0})])
    redone = [T({"step": float(s), "reward_mean": 1.0 + s, "accuracy": 1.0}) for s in (3, 4, 5)]
    progress.receive(redone)
    rows = read_jsonl(tmp_path / "metrics.jsonl")  # before close: already one curve
    train = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["reward_mean"] for r in train][2:] == [4.0, 5.0, 6.0]
    assert progress.curve.redone == 2 and [r["step"] for r in progress.history if "reward_mean" in r] == [
        1,
        2,
        3,
        4,
        5,
    ]
    progress.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows


def test_the_report_shows_throughput_and_mfu_medians_without_the_first_step():
    from yatt_ray.progress import flops_text, perf_report_lines

    def row(step, scale):
        return {
            "step": float(step), "response_tokens_per_s": 100.0 * scale, "total_tokens_per_s": 300.0 * scale,
            "response_tokens_per_s_per_worker": 50.0 * scale, "total_tokens_per_s_per_worker": 150.0 * scale,
            "perf/train_flops_per_s": 2e9 * scale, "perf/rollout_flops_per_s": 1e8 * scale,
            "perf/peak_flops": 1e10, "perf/mfu_train": 0.2 * scale, "perf/mfu_rollout": 0.01 * scale,
        }  # fmt: skip

    lines = perf_report_lines([row(1, 0.01), row(2, 1.0), row(3, 1.0), row(4, 3.0)])  # step 1: the cold start
    assert lines[0].split() == [
        "throughput", "response", "100.0", "tok/s,", "total", "300.0", "tok/s", "(50.0,", "150.0", "per",
        "worker),", "median", "of", "steps", "2-4",
    ]  # fmt: skip
    assert lines[1].split()[:3] == ["rollout", "100.00", "MFLOP/s"] and lines[1].endswith("MFU 1.0%")
    assert "2.00 GFLOP/s per accelerator of 10.00 GFLOP/s peak: MFU 20.0%" in lines[2]
    assert perf_report_lines([]) == [] and flops_text(3.2e12) == "3.20 TFLOP/s"
