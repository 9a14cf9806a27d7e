"""Start-up stage marks (metrics/startup.py) and the loop state a resume applies, without a cluster."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_controller import controller
from yatt_ray.checkpoint.training import Resumed
from yatt_ray.metrics.startup import (
    IMPORT_WINDOW_S,
    STAGE_NAMES,
    Startup,
    first_step_seconds,
    format_table,
    origin,
    report_line,
    startup_table,
    write_startup,
)


def test_the_table_orders_stages_by_the_run_and_times_each_from_the_previous_mark(tmp_path):
    marks = {"command": 100.0, "ray_started": 104.0, "fit_called": 102.5, "first_step_done": 130.0}
    assert startup_table(marks) == [
        ("command", 0.0, 0.0),
        ("fit_called", 2.5, 2.5),
        ("ray_started", 4.0, 1.5),
        ("first_step_done", 30.0, 26.0),
    ]
    assert first_step_seconds(marks) == 30.0 and first_step_seconds({"command": 1.0}) is None
    assert "30.0 s from the command to the end of step 1 (longest: first_step_done 26.0" in report_line(marks)
    assert format_table(marks).splitlines()[-1].startswith("first_step_done")
    write_startup(tmp_path / "startup.json", marks)
    saved = json.loads((tmp_path / "startup.json").read_text())
    assert saved["marks"] == marks and [r["stage"] for r in saved["table"]][-1] == "first_step_done"


def test_the_start_counts_from_the_command_only_for_a_fresh_process_first_fit():
    """A notebook (or a benchmark that warmed a model up first) counted its minutes before fit() as start-up."""
    assert origin(105.0, 100.0, earlier_fits=0) == (100.0, "the command")
    assert origin(100.0 + IMPORT_WINDOW_S + 1, 100.0, 0) == (100.0 + IMPORT_WINDOW_S + 1, "the fit() call")
    assert origin(105.0, 100.0, earlier_fits=1) == (105.0, "the fit() call")  # a second fit() in the process
    marks = {"command": 0.0, "first_step_done": 12.0}
    assert "12.0 s from the fit() call to the end of step 1" in report_line(marks, "the fit() call")


def test_the_first_mark_of_a_stage_wins_and_unknown_stages_are_refused():
    startup = Startup()
    assert "command" in startup.marks and set(startup.marks) <= set(STAGE_NAMES)
    startup.mark("ray_started", 5.0)
    startup.mark("ray_started", 9.0)  # a restart does not move it
    assert startup.marks["ray_started"] == 5.0
    with pytest.raises(ValueError, match="unknown start-up stage 'warp'"):
        startup.mark("warp")


def resumed(keep_rate: float) -> Resumed:
    return Resumed(step=4, epoch=0, position={}, kl_coef=0.02, keep_rate=keep_rate)


def test_a_restored_keep_rate_applies_only_with_dynamic_sampling(single_process_world):
    """A checkpoint's keep rate of 0.4 made a run without dynamic sampling start 2.5x the prompts it needs."""
    off, *_ = controller()
    off.apply_resumed(resumed(0.4))
    assert off.collector.keep_rate == 1.0 and off.kl_ctl.value == 0.02
    on, *_ = controller(**{"algo.dynamic_sampling": "reward"})
    on.apply_resumed(resumed(0.4))
    assert on.collector.keep_rate == 0.4
