import json
import math

import pytest

from yatt_ray.metrics import PhaseTimer
from yatt_ray.metrics.timeline import (
    Span,
    SpanRecorder,
    accelerator_key,
    busy_union,
    chrome_trace,
    from_wire,
    idle_fractions,
    idle_summary,
    last_settled_step,
    plot_gantt,
    step_windows,
    to_wire,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def span(start, end, *, acc="gpu0", worker="rank0", role="trainer", phase="train", step=1, busy=True):
    return Span(role, worker, acc, phase, step, float(start), float(end), busy)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---- busy_union ---------------------------------------------------------------------------------------------
def test_busy_union_merges_overlaps_and_keeps_gaps():
    # [0,2] u [1,3] = [0,3] (3 s); gap (3,5); [5,6] inside [5,8]; [7,9] overlaps [5,8] -> [5,9] (4 s): 7 s
    spans = [span(0, 2), span(1, 3), span(5, 8), span(5, 6), span(7, 9)]
    assert busy_union(spans, 0, 10) == pytest.approx(7.0)
    # clipped to [2, 6]: [2,3] + [5,6] = 2 s
    assert busy_union(spans, 2, 6) == pytest.approx(2.0)


def test_busy_union_ignores_waiting_spans_and_outside_spans():
    spans = [span(0, 4, busy=False), span(1, 2), span(20, 30)]
    assert busy_union(spans, 0, 10) == pytest.approx(1.0)
    assert busy_union([], 0, 10) == 0.0
    assert busy_union(spans, 4, 4) == 0.0
    with pytest.raises(ValueError, match="ends before it starts"):
        busy_union(spans, 5, 4)


# ---- windows and idle fractions ----------------------------------------------------------------------------
def two_accelerator_example():
    """Step 1 on gpu0 (trainer) runs 0..10; gpu1 (GenRM) judges 2..5 and 4..6 (union 2..6) and waits 6..8.
    Step 2 runs 10..20: gpu0 busy 10..14 and 16..20 (8 s), gpu1 judges 12..13 tagged step 1 (by time, busy)."""
    return [
        span(0, 6, phase="rollout"),
        span(6, 10, phase="train"),
        span(2, 5, acc="gpu1", worker="genrm-1", role="genrm", phase="judge"),
        span(4, 6, acc="gpu1", worker="genrm-1", role="genrm", phase="judge"),
        span(6, 8, acc="gpu1", worker="genrm-1", role="genrm", phase="wait", busy=False),
        span(10, 14, phase="rollout", step=2),
        span(14, 16, phase="wait_reward", step=2, busy=False),
        span(16, 20, phase="train", step=2),
        span(12, 13, acc="gpu1", worker="genrm-1", role="genrm", phase="judge", step=1),
        span(30, 31, acc="gpu2", worker="rank1", phase="train", step=3),
    ]


def test_step_windows_from_trainer_spans_only():
    spans = two_accelerator_example()
    assert step_windows(spans) == {1: (0.0, 10.0), 2: (10.0, 20.0), 3: (30.0, 31.0)}
    # a GenRM span outside the trainer's window does not stretch it; role=None uses every span
    late = spans + [span(9, 25, acc="gpu1", role="genrm", worker="genrm-1", step=2)]
    assert step_windows(late)[2] == (10.0, 20.0)
    assert step_windows(late, role=None)[2] == (9.0, 25.0)
    assert step_windows([]) == {}


def test_idle_fractions_two_accelerators():
    spans = two_accelerator_example()
    idle = idle_fractions(spans, {1: (0.0, 10.0), 2: (10.0, 20.0)})
    # every accelerator of any span, every step; gpu2 never busy in these windows -> 1.0
    assert idle == {
        1: {"gpu0": pytest.approx(0.0), "gpu1": pytest.approx(0.6), "gpu2": 1.0},
        2: {"gpu0": pytest.approx(0.2), "gpu1": pytest.approx(0.9), "gpu2": 1.0},
    }
    assert idle_fractions(spans, {}) == {}
    assert idle_fractions([], {1: (0.0, 1.0)}) == {1: {}}
    assert idle_fractions(spans, {5: (3.0, 3.0)})[5]["gpu0"] == 0.0  # zero-length window


def test_idle_summary_mean_max_and_per_role():
    spans = two_accelerator_example()
    fractions = {1: {"gpu0": 0.0, "gpu1": 0.6, "gpu2": 1.0}, 2: {"gpu0": 0.2, "gpu1": 0.9, "gpu2": 1.0}}
    summary = idle_summary(fractions, spans)
    assert summary["mean"] == pytest.approx(3.7 / 6) and summary["max"] == 1.0
    assert summary["genrm"] == pytest.approx(0.75)  # gpu1 only
    assert summary["trainer"] == pytest.approx((0.0 + 0.2 + 1.0 + 1.0) / 4)  # gpu0 and gpu2
    assert idle_summary({}, spans) == {}


def test_last_settled_step_waits_for_the_slowest_trainer_worker():
    spans = [span(0, 1, worker="rank0", step=3), span(0, 1, worker="rank1", step=2)]
    assert last_settled_step(spans) == 1
    assert last_settled_step(spans + [span(2, 3, worker="rank1", step=3)]) == 2
    genrm_only = [span(0, 1, role="genrm", worker="genrm-1", step=9)]
    assert last_settled_step(genrm_only) is None and last_settled_step([]) is None


# ---- Chrome trace -------------------------------------------------------------------------------------------
def test_chrome_trace_events_in_microseconds_with_named_rows(tmp_path):
    spans = [
        span(100.0, 100.5, acc="node-a/gpu:1", worker="rank1", phase="rollout"),
        span(100.25, 101.0, acc="node-a/gpu:0", worker="rank0", phase="wait_reward", busy=False, step=2),
    ]
    trace = chrome_trace(spans)
    events = trace["traceEvents"]
    meta = [e for e in events if e["ph"] == "M"]
    names = {(e["name"], e["pid"], e.get("tid")): e["args"] for e in meta}
    assert names[("process_name", 1, None)] == {"name": "node-a/gpu:0"}  # pids in sorted accelerator order
    assert names[("process_name", 2, None)] == {"name": "node-a/gpu:1"}
    assert names[("thread_name", 1, 1)] == {"name": "rank0"} and names[("thread_name", 2, 2)] == {
        "name": "rank1"
    }
    complete = [e for e in events if e["ph"] == "X"]
    assert complete == [
        {
            "name": "rollout",
            "cat": "trainer",
            "ph": "X",
            "ts": 0.0,
            "dur": 500000.0,
            "pid": 2,
            "tid": 2,
            "args": {"step": 1, "busy": True},
        },
        {
            "name": "wait_reward",
            "cat": "trainer",
            "ph": "X",
            "ts": 250000.0,
            "dur": 750000.0,
            "pid": 1,
            "tid": 1,
            "args": {"step": 2, "busy": False},
        },
    ]
    out = write_chrome_trace(tmp_path / "sub" / "timeline.json", spans)
    assert json.loads(out.read_text()) == trace
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


# ---- Gantt chart --------------------------------------------------------------------------------------------
def test_gantt_png_written_and_grows_with_rows(tmp_path):
    spans = two_accelerator_example()
    out = plot_gantt(spans, tmp_path / "plots" / "timeline.png", title="full coexistence")
    data = out.read_bytes()
    assert out == tmp_path / "plots" / "timeline.png"
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    one_row = plot_gantt([span(0, 1), span(2, 3, phase="rollout")], tmp_path / "one.png").read_bytes()
    height = lambda png: int.from_bytes(png[20:24], "big")  # noqa: E731  (the IHDR height field)
    assert height(one_row) < height(data)  # three rows (gpu0/rank0, gpu1/genrm-1, gpu2/rank1) are taller
    with pytest.raises(ValueError, match="no spans"):
        plot_gantt([], tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


# ---- recording ----------------------------------------------------------------------------------------------
def test_recorder_records_spans_also_when_the_body_raises():
    clock = FakeClock(1000.0)
    rec = SpanRecorder("trainer", "rank0", "cpu:rank0", clock=clock)
    rec.step = 4
    with rec.span("rollout"):
        clock.advance(2.0)
    with pytest.raises(KeyError), rec.span("wait_reward", busy=False):
        clock.advance(1.5)
        raise KeyError("boom")
    with rec.span("train", step=7):
        clock.advance(0.5)
    assert rec.drain() == [
        Span("trainer", "rank0", "cpu:rank0", "rollout", 4, 1000.0, 1002.0, True),
        Span("trainer", "rank0", "cpu:rank0", "wait_reward", 4, 1002.0, 1003.5, False),
        Span("trainer", "rank0", "cpu:rank0", "train", 7, 1003.5, 1004.0, True),
    ]
    assert rec.drain() == []
    with pytest.raises(ValueError, match="role must be a printable name"):
        SpanRecorder("x" * 65, "rank0", "cpu:rank0")


def test_phase_timer_with_a_recorder_records_spans_and_keeps_totals():
    perf, wall = FakeClock(0.0), FakeClock(500.0)
    rec = SpanRecorder("trainer", "rank1", "node-a/gpu:1", clock=wall)
    timer = PhaseTimer(clock=perf, recorder=rec)
    rec.step = 2
    with timer.phase("rollout"):
        perf.advance(3.0)
        wall.advance(3.0)
    with timer.phase("reward", busy=False):
        perf.advance(1.0)
        wall.advance(1.0)
    assert timer.totals() == {"rollout": 3.0, "reward": 1.0}
    assert [(s.phase, s.step, s.start, s.end, s.busy) for s in rec.drain()] == [
        ("rollout", 2, 500.0, 503.0, True),
        ("reward", 2, 503.0, 504.0, False),
    ]


def test_accelerator_key():
    assert accelerator_key("abcdef0123456789", [3, 4], "rank0") == "node-abcdef01/gpu:3"
    assert accelerator_key("abcdef0123456789", [], "rank2") == "cpu:rank2"


# ---- wire format --------------------------------------------------------------------------------------------
def test_wire_round_trip():
    spans = two_accelerator_example()
    wire = to_wire(spans)
    assert all(isinstance(t, tuple) and len(t) == 8 for t in wire)
    assert wire[0] == ("trainer", "rank0", "gpu0", "rollout", 1, 0.0, 6.0, True)
    assert from_wire(wire) == spans
    assert from_wire([list(wire[0])]) == spans[:1]  # lists (e.g. from JSON) are accepted
    assert from_wire([("trainer", "rank0", "gpu0", "train", 1, 0, 1, 1)])[0].busy is True


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            ("trainer", "rank0", "gpu0", "x" * 65, 1, 0.0, 1.0, True),
            "phase must be a printable name of 1 to 64",
        ),
        (("trainer", "What is 12+7? The answer\n", "gpu0", "train", 1, 0.0, 1.0, True), "worker must be"),
        (("trainer", "rank0", "", "train", 1, 0.0, 1.0, True), "accelerator must be"),
        ((7, "rank0", "gpu0", "train", 1, 0.0, 1.0, True), "role must be"),
        (("trainer", "rank0", "gpu0", "train", "1", 0.0, 1.0, True), "step must be an int"),
        (("trainer", "rank0", "gpu0", "train", 1.0, 0.0, 1.0, True), "step must be an int"),
        (("trainer", "rank0", "gpu0", "train", 1, "0.0", 1.0, True), "start must be a finite number"),
        (("trainer", "rank0", "gpu0", "train", 1, 0.0, [1.0], True), "end must be a finite number"),
        (("trainer", "rank0", "gpu0", "train", 1, 0.0, math.inf, True), "end must be a finite number"),
        (("trainer", "rank0", "gpu0", "train", 1, 2.0, 1.0, True), "ends before it starts"),
        (("trainer", "rank0", "gpu0", "train", 1, 0.0, 1.0, "yes"), "busy must be a bool"),
        (("trainer", "rank0", "gpu0", "train", 1, 0.0, 1.0, 2), "busy must be a bool"),
        (("trainer", "rank0", "gpu0", "train", 1, 0.0), "a wire span is a tuple"),
        ({"role": "trainer"}, "a wire span is a tuple"),
    ],
)
def test_wire_validation_rejects_text_and_non_numbers(row, message):
    with pytest.raises(ValueError, match=message):
        from_wire([row])
