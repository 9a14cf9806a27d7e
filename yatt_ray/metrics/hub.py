"""The one channel from workers to the driver: a small actor that holds per-step scalar metrics.

Workers push one row of scalars per step; the driver polls for new rows to drive its progress bar and
sinks. Rows with anything but numbers are refused, so samples can never reach the driver this way.
"""

from __future__ import annotations

import numbers


def start_hub():
    """The hub as a Ray actor (no CPU reserved: it only stores a few numbers per step)."""
    import ray

    return ray.remote(num_cpus=0)(MetricsHub).remote()


def check_scalars(row: dict) -> dict[str, float]:
    """`row` with every value as a float; TypeError naming the key when a value is not a real number."""
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"metric {key!r} is a {type(value).__name__}; only scalar numbers may reach the driver"
            )
        out[str(key)] = float(value)
    return out


class MetricsHub:
    """Append-only list of metric rows; `rows_since(i)` returns rows i, i+1, ..."""

    def __init__(self) -> None:
        self._rows: list[dict[str, float]] = []

    def push(self, row: dict) -> None:
        self._rows.append(check_scalars(row))

    def rows_since(self, index: int) -> list[dict[str, float]]:
        return self._rows[index:]
