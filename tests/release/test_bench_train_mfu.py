"""release/bench_train_mfu.py at its tiny preset on the CPU: it trains, and its last line has the promised form."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "release" / "bench_train_mfu.py"
_spec = importlib.util.spec_from_file_location("bench_train_mfu", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_train_mfu"] = bench
_spec.loader.exec_module(bench)

LAST_LINE = re.compile(
    r"^train_mfu: preset=(?P<preset>\S+) dtype=(?P<dtype>\S+) mfu=(?P<mfu>\d+\.\d{3}) "
    r'tokens_per_s=(?P<tokens_per_s>\d+) step_s=(?P<step_s>\d+\.\d+) peak_source="(?P<source>[^"\n]+)"$'
)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_tiny_preset_reports_mfu(dtype, capsys, tmp_path):
    summary = bench.main(
        ["--preset", "tiny", "--dtype", dtype, "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "m")]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, lines[-1]
    assert (match["preset"], match["dtype"]) == ("tiny", dtype)
    mfu, tokens_per_s, step_s = float(match["mfu"]), float(match["tokens_per_s"]), float(match["step_s"])
    assert 0 < mfu < 1
    assert tokens_per_s > 0 and step_s > 0
    assert match["source"].startswith("measured:")  # no CUDA here: the CPU's measured matmul peak
    assert summary["mfu"] == pytest.approx(mfu, abs=5e-4)
    assert len(summary["steps"]) == 2
    for row in summary["steps"]:
        assert row["forward_tokens"] == 8 * 64  # no padding: the trainer ran every token of the step
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0
    assert (tmp_path / "m" / "config.json").is_file()


def test_mfu_is_the_library_formula(capsys):
    """Against a fixed peak: MFU = 3 x F_fwd / step time / peak, F_fwd = 2 N T + 4 L q P (metrics.flops)."""
    peak = 1e12
    summary = bench.main(["--preset", "tiny", "--steps", "1", "--warmup", "0", "--peak-flops", str(peak)])
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith('peak_source="--peak-flops"')
    p = bench.PRESETS["tiny"]
    q, kv = p.hidden_size, p.hidden_size // p.num_heads * p.num_kv_heads
    n = p.num_layers * (
        2 * p.hidden_size * q + 2 * p.hidden_size * kv + 3 * p.hidden_size * p.intermediate_size
    )
    n += p.hidden_size * p.vocab_size
    tokens, pairs = 8 * 64, 8 * 64 * 65 / 2
    train = 3 * (2 * n * tokens + 4 * p.num_layers * q * pairs)
    (row,) = summary["steps"]
    assert summary["mfu"] == pytest.approx(train / row["seconds"] / peak, rel=1e-9)
