"""The MetricsHub as a plain class (no Ray): metric rows and timeline spans."""

import pickle

import pytest

from yatt_ray.metrics.history import MetricRow
from yatt_ray.metrics.hub import MetricsHub
from yatt_ray.metrics.timeline import Span, from_wire, to_wire


def _spans(n, worker="rank0"):
    return [Span("trainer", worker, "node-abc/gpu:0", "train", i, float(i), i + 0.5, True) for i in range(n)]


def test_rows_keep_their_kind_and_refuse_what_is_not_a_number():
    hub = MetricsHub()
    hub.push(MetricRow("train", {"step": 1, "reward_mean": 0.5}))
    with pytest.raises(TypeError, match="'text'"):
        hub.push(MetricRow("train", {"step": 2, "text": "hello"}))
    with pytest.raises(ValueError, match="kind 'sample' is unknown"):
        hub.push(MetricRow("sample", {"step": 2}))  # type: ignore[arg-type]
    assert hub.rows_since(0) == [MetricRow("train", {"step": 1.0, "reward_mean": 0.5})]


def test_spans_append_and_read_from_an_index():
    hub = MetricsHub()
    hub.push_spans(to_wire(_spans(2)))
    hub.push_spans(to_wire(_spans(3, worker="rank1")))
    assert from_wire(hub.spans_since(0)) == _spans(2) + _spans(3, worker="rank1")
    assert from_wire(hub.spans_since(4)) == _spans(3, worker="rank1")[2:]
    assert hub.spans_since(5) == []
    assert hub.rows_since(0) == []  # spans and rows are separate lists


def test_a_bad_span_rejects_the_whole_push():
    hub = MetricsHub()
    good = to_wire(_spans(1))[0]
    leak = ("trainer", "rank0", "gpu0", "Q: what is 3+4? A: " + "7" * 80, 1, 0.0, 1.0, True)
    with pytest.raises(ValueError, match="phase must be a printable name of 1 to 64 characters"):
        hub.push_spans([good, leak])
    assert hub.spans_since(0) == []


def test_repeated_names_pickle_once():
    """Names are interned, so a reply of many spans stays small (the driver fetches a few bytes per span)."""
    hub = MetricsHub()
    for i in range(500):
        hub.push_spans(
            [("trainer", "rank0", "node-abcdef01/gpu:0", "weight_sync", i, 1e9 + i, 1e9 + i, True)]
        )
    per_span = len(pickle.dumps(hub.spans_since(0))) / 500
    assert per_span < 40, per_span
