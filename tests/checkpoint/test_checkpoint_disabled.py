"""`checkpoint.enable=false`: no store is touched (no probe, no save, no resume lookup), and a stop request
still stops every rank after the same step (one-process gloo world, no cluster)."""

from __future__ import annotations

from pathlib import Path

from yatt_ray.checkpoint.training import TrainingCheckpoints, TrainState
from yatt_ray.config import load_config
from yatt_ray.fit import _check_checkpoints
from yatt_ray.roles import Layout


def disabled(tmp_path: Path):
    return load_config(None, ["checkpoint.enable=false", f"checkpoint.dir={tmp_path / 'ckpt'}"])


def test_the_driver_checks_nothing_and_says_so(tmp_path):
    config = disabled(tmp_path)
    assert (
        _check_checkpoints(config, tmp_path)
        == "checkpoints: off (checkpoint.enable=false): no saves, no resume"
    )
    assert not (tmp_path / "ckpt").exists()
    blank = load_config(None, ["checkpoint.enable=false"])
    _check_checkpoints(blank, tmp_path)
    assert blank.checkpoint.dir == ""  # Result.checkpoint_dir stays empty: there are none


def test_workers_neither_resume_nor_save_but_still_stop(tmp_path, single_process_world):
    config = disabled(tmp_path)
    layout = Layout(rank=0, dp_rank=0, dp_size=1, tp_rank=0, tp_size=1)
    checkpoints = TrainingCheckpoints(config, layout, control=None, hub=None)
    requests = iter([None, "SIGTERM"])
    checkpoints._stop_requested = lambda: next(requests)  # type: ignore[method-assign]
    state = TrainState(policy=None, critic=None, kl_coef=lambda: 0.0)
    assert checkpoints.resume(state) is None
    assert checkpoints.after_step(1, state) is False
    assert checkpoints.after_step(2, state) is True and checkpoints.stop_reason == "SIGTERM"
    checkpoints.finish(2, state)  # no final save
    assert checkpoints.metrics() == {}
    assert not (tmp_path / "ckpt").exists()
