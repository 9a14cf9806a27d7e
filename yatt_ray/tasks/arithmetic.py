"""The verifiable demo task: two-number addition, written as parquet in the shape verl users know.

Each row holds `prompt` ("17+8="), `ground_truth` ("25"), `data_source` ("arithmetic") and a unique `id`.
The rule reward is exact match of the decoded response (up to EOS) with the ground truth.

The demo's operands run 0..19, so there are 400 distinct problems and training sees them all; its "eval"
is the greedy accuracy on a fixed sample of them. We tried holding a quarter of the pairs out: the tiny
model learns the pairs it is shown by heart and scored 0% on unseen ones before and after RL, so a held-out
split would measure nothing here. The demo shows the RL machinery at work, not generalisation.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA_SOURCE = "arithmetic"


def make_problems(count: int, seed: int, max_operand: int = 99, id_offset: int = 0) -> list[dict]:
    """`count` problems a+b with 0 <= a, b <= max_operand, drawn with a fixed seed."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(count)]
    return [_row(id_offset + i, a, b) for i, (a, b) in enumerate(pairs)]


def _row(row_id: int, a: int, b: int) -> dict:
    return {"id": row_id, "prompt": f"{a}+{b}=", "ground_truth": str(a + b), "data_source": DATA_SOURCE}


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write rows as a parquet file (columns: id, prompt, ground_truth, data_source), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.rename(path)
    return path
