"""release/bench_vs_trl.py's micro-batch for TRL (the whole benchmark is a training run: run by hand): TRL
holds about as many tokens per forward / backward as yatt_ray's token budget lets it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "release" / "bench_vs_trl.py"
_spec = importlib.util.spec_from_file_location("bench_vs_trl", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_vs_trl", bench)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize(
    ("budget", "row_tokens", "expected"),
    [
        (None, 23, 128),  # no budget: the config's row count
        (16384, 23, 256),  # 712 rows fit: all 256 completions in one micro-batch
        (4096, 23, 128),  # 178 fit: the largest divisor of 256 under it
        (1000, 23, 32),  # 43 fit
        (10, 23, 1),  # not one row fits: one row at a time, as yatt_ray gives a long group its own
    ],
)
def test_trl_takes_the_rows_the_budget_holds_as_a_divisor_of_the_batch(budget, row_tokens, expected):
    micro = bench.trl_micro_batch(256, 128, budget, row_tokens)
    assert micro == expected
    assert 256 % micro == 0


def test_trl_micro_batch_never_exceeds_the_batch():
    assert bench.trl_micro_batch(24, 128, None, 23) == 24
    assert bench.trl_micro_batch(24, 128, 10**6, 23) == 24
    assert bench.trl_micro_batch(24, 128, 23 * 7, 23) == 6  # 7 fit; 6 divides 24
