import pytest

from yatt_ray.metrics import PhaseTimer


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_accumulates_per_phase():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("rollout"):
        clock.advance(2.5)
    with timer.phase("train"):
        clock.advance(1.0)
    clock.advance(10.0)  # outside any phase: not counted
    with timer.phase("rollout"):
        clock.advance(0.5)
    assert timer.totals() == {"rollout": 3.0, "train": 1.0}


def test_overlapping_different_phases_each_count_their_time():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("step"):
        clock.advance(1.0)
        with timer.phase("reward"):
            clock.advance(2.0)
    assert timer.totals() == {"step": 3.0, "reward": 2.0}


def test_reentering_an_open_phase_raises():
    timer = PhaseTimer(clock=FakeClock())
    with (
        timer.phase("rollout"),
        pytest.raises(RuntimeError, match="'rollout' is already open"),
        timer.phase("rollout"),
    ):
        pass
    with timer.phase("rollout"):  # closed again: usable
        pass


def test_time_counted_when_body_raises():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with pytest.raises(KeyError), timer.phase("reward"):
        clock.advance(4.0)
        raise KeyError("boom")
    assert timer.totals() == {"reward": 4.0}


def test_reset_and_totals_is_a_copy():
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    with timer.phase("a"):
        clock.advance(1.0)
    snapshot = timer.totals()
    snapshot["a"] = 99.0
    assert timer.totals() == {"a": 1.0}
    timer.reset()
    assert timer.totals() == {}
    with timer.phase("a"), pytest.raises(RuntimeError, match="phases are open"):
        timer.reset()


def test_default_clock_measures_real_time():
    timer = PhaseTimer()
    with timer.phase("x"):
        pass
    assert 0.0 <= timer.totals()["x"] < 1.0
    with pytest.raises(ValueError, match="non-empty string"), timer.phase(""):
        pass
