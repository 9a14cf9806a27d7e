"""The verifiable demo task: two-number addition, written as parquet in the shape verl users know.

Each row holds `prompt` ("37+48="), `ground_truth` ("85"), `data_source` ("arithmetic") and a unique `id`.
The rule reward is exact match of the decoded response (up to EOS) with the ground truth.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA_SOURCE = "arithmetic"


def make_problems(count: int, seed: int, max_operand: int = 99, id_offset: int = 0) -> list[dict]:
    """`count` addition problems a+b with 0 <= a, b <= max_operand, drawn with a fixed seed."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "id": id_offset + i,
                "prompt": f"{a}+{b}=",
                "ground_truth": str(a + b),
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write rows as a parquet file (columns: id, prompt, ground_truth, data_source)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
