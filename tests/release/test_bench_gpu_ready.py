"""release/bench_gpu_ready.py on a small micro-batch: it runs in a process of its own (its one-rank world), and
its last line has the form issue 55 asks for, with values inside issue 55's bounds (launches per layer at the
0.5B shape too, not only the tiny one tests/train/test_gpu_proxies.py counts)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAST_LINE = re.compile(
    r"^gpu_ready: ops_per_layer=(\d+) host_syncs_per_step=(\d+) logprob_peak_mib=(\d+\.\d) fits_7b=([01])$"
)


def test_the_bench_prints_the_four_proxies():
    out = subprocess.run(
        [sys.executable, "release/bench_gpu_ready.py", "--tokens", "1024", "--shapes", "qwen2-0.5b"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    last = LAST_LINE.match(out.stdout.strip().splitlines()[-1])
    assert last, out.stdout[-2000:]
    ops, syncs, peak, fits = int(last[1]), int(last[2]), float(last[3]), last[4]
    assert 0 < ops <= 60 and syncs <= 1 and 0 < peak <= 1024 and fits == "1", last[0]
