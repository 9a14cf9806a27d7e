"""CheckpointSchedule with a fake clock, and PreemptionFlag with a real SIGTERM."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from yatt_ray.checkpoint import CheckpointError, CheckpointSchedule, PreemptionFlag


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_every_steps_aligned_to_multiples():
    schedule = CheckpointSchedule(every_steps=5)
    due = []
    for step in range(0, 21):
        if schedule.due(step):
            due.append(step)
            schedule.mark_saved(step)
    assert due == [5, 10, 15, 20]
    late = CheckpointSchedule(every_steps=5)
    assert not late.due(4) and late.due(5)
    assert late.due(6)  # a due save that was not made stays due until mark_saved
    late.mark_saved(6)
    assert not late.due(9) and late.due(10)
    resumed = CheckpointSchedule(every_steps=5)
    resumed.mark_saved(12)  # resumed from step 12: next save at the same step as an uninterrupted run
    assert [s for s in range(12, 15) if resumed.due(s)] == [] and resumed.due(15)


def test_every_minutes_with_fake_clock():
    clock = FakeClock()
    schedule = CheckpointSchedule(every_minutes=30, clock=clock)
    assert not schedule.due(1)
    clock.now += 29 * 60
    assert not schedule.due(2)
    clock.now += 60
    assert schedule.reason(3) == "every 30 minutes"
    schedule.mark_saved(3)
    assert not schedule.due(3) and not schedule.due(4)
    clock.now += 30 * 60
    assert schedule.due(4)


def test_both_rules_and_neither():
    clock = FakeClock()
    schedule = CheckpointSchedule(every_steps=100, every_minutes=1, clock=clock)
    assert schedule.reason(100) == "every 100 steps"
    clock.now += 61
    assert schedule.reason(7) == "every 1 minutes"
    schedule.mark_saved(7)  # a time-based save does not move the step grid
    assert not schedule.due(99) and schedule.due(100)
    off = CheckpointSchedule(clock=clock)
    clock.now += 1e6
    assert not any(off.due(s) for s in range(1000))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_steps": 0}, "every_steps=0"),
        ({"every_minutes": -1.0}, "every_minutes=-1.0"),
        ({"every_steps": 2.5}, "every_steps=2.5"),
    ],
)
def test_invalid_schedule(kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        CheckpointSchedule(**kwargs)


def test_sigterm_sets_flag_and_process_lives():
    before = signal.getsignal(signal.SIGTERM)
    flag = PreemptionFlag()
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.requested and flag.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a second one is ignored too
        time.sleep(0.05)
    finally:
        flag.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigusr1_optional_and_main_thread_only():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionFlag((signal.SIGTERM, signal.SIGUSR1)) as flag:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.wait(5) and flag.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before
    errors: list[BaseException] = []

    def in_thread():
        try:
            PreemptionFlag()
        except CheckpointError as exc:
            errors.append(exc)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])
