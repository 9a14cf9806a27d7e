"""Metrics: per-phase timers, sinks (JSONL, TensorBoard), plots of training curves, and model FLOPs / peaks for MFU
(`flops`)."""

from yatt_ray.metrics.plot import plot_history
from yatt_ray.metrics.sinks import JsonlSink, MultiSink, Sink, TensorBoardSink, read_jsonl, validate_metrics
from yatt_ray.metrics.timers import PhaseTimer

__all__ = [
    "JsonlSink",
    "MultiSink",
    "PhaseTimer",
    "Sink",
    "TensorBoardSink",
    "plot_history",
    "read_jsonl",
    "validate_metrics",
]
