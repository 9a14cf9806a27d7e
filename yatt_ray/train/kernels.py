"""CPU kernel choices: what a worker runs (`KernelChoice`: linear layers on oneDNN or MKL, the thread count,
the GQA form, the packed attention's dense rows, the weight-gradient form) and the choice in effect in this
process (`apply_kernels`, `active_*`), read by `cpu_shims` and `attention`. The choice is made by measuring on
the machine at hand (`kernel_timing`, once; cached per machine and shape)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LINEAR = ("onednn", "mkl")
GQA = ("native", "expand")
WGRAD = ("direct", "transposed", "mkl")  # forms of a layer's weight gradient (`cpu_shims.weight_grad`)
WGRAD_ROWS = (1024, 4096)  # rows (tokens) at which they are compared for `KernelChoice.wgrad`, fewest first
WGRAD_WIN = 0.95  # another form is taken at a row count where it needs under this fraction of "direct"'s time


@dataclass(frozen=True)
class KernelChoice:
    """What a CPU worker runs: `linear` in LINEAR, `threads`, `gqa` in GQA, `dense_rows` (packed rows up to
    this length attend as whole masked rows; 0 = never), `wgrad` ((rows, form) pairs, rows ascending: the
    weight-gradient form in WGRAD measured best at that row count, `wgrad_form`; empty = "direct"); `rates`:
    the measured figures (GFLOP/s of each linear kernel and thread count, milliseconds of each GQA form, of
    both attention forms per row length and of each weight-gradient form per row count)."""

    linear: str
    threads: int
    gqa: str
    dense_rows: int
    rates: dict
    wgrad: tuple = ()

    def __post_init__(self):  # pairs read back from the JSON cache arrive as lists
        object.__setattr__(self, "wgrad", tuple((int(n), str(f)) for n, f in self.wgrad))
        unknown = [f for _, f in self.wgrad if f not in WGRAD]
        if unknown:  # a damaged or foreign cache entry: `cached_measurement` measures again
            raise ValueError(f"weight-gradient forms {unknown} are not among {WGRAD}")

    def wgrad_form(self, rows: int) -> str:
        """The weight-gradient form for `rows` rows: the one measured at the nearest (log scale) of the
        measured row counts; "direct" when none was measured."""
        if not self.wgrad:
            return "direct"
        return min(self.wgrad, key=lambda pair: abs(math.log(max(rows, 1) / pair[0])))[1]

    def describe(self) -> str:
        r = self.rates
        linear = ", ".join(f"{k} {r[f'linear_{k}']:.0f}" for k in LINEAR if f"linear_{k}" in r)
        threads = ", ".join(f"{t}: {r[f'threads_{t}']:.0f}" for t in range(1, 257) if f"threads_{t}" in r)
        gqa = ", ".join(f"{k} {r[f'gqa_{k}']:.1f} ms" for k in GQA if f"gqa_{k}" in r) or "no grouped heads"
        rows = f"whole masked rows up to {self.dense_rows} tokens" if self.dense_rows else "no masked rows"
        return (
            f"kernels (measured on this machine): linear {self.linear} (GFLOP/s {linear}); {self.threads} "
            f"thread(s) (GFLOP/s {threads}); attention GQA {self.gqa} ({gqa}), {rows}{self._wgrad_text()}"
        )

    def _wgrad_text(self) -> str:
        r = self.rates
        parts = [
            f"{form} at {rows} rows ("
            + ", ".join(f"{k} {r[f'wgrad_{k}_{rows}']:.1f}" for k in WGRAD if f"wgrad_{k}_{rows}" in r)
            + " ms)"
            for rows, form in self.wgrad
        ]
        return f"; weight gradient {', '.join(parts)}" if parts else ""


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, form: str, mask=None
) -> torch.Tensor:
    """Fused attention, q [S, h, L, d], k / v [S, g, L, d] -> [S, h, L, d], GQA in `form`: causal, or with
    `mask` ([S, 1, L, L] bool, True = attend) when given."""
    causal = mask is None
    if k.shape[1] != q.shape[1] and form == "expand":
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=gqa)


_ACTIVE: KernelChoice | None = None


@contextlib.contextmanager
def kernels_in_effect(choice: KernelChoice | None) -> Iterator[None]:
    """`choice` as this process's kernels inside the block (the thread count left as it is), then the
    previous choice again."""
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, choice
    try:
        yield
    finally:
        _ACTIVE = saved


def apply_kernels(choice: KernelChoice | None) -> None:
    """Make `choice` this process's kernels (None: the defaults, oneDNN where available and native GQA)."""
    global _ACTIVE
    _ACTIVE = choice
    if choice is not None:
        torch.set_num_threads(choice.threads)


def active_linear() -> str:
    return "onednn" if _ACTIVE is None else _ACTIVE.linear


def active_gqa() -> str:
    return "native" if _ACTIVE is None else _ACTIVE.gqa


def active_wgrad_form(rows: int) -> str:
    """The weight-gradient form (WGRAD) for `rows` rows (default "direct", without a measurement)."""
    return "direct" if _ACTIVE is None else _ACTIVE.wgrad_form(rows)


def active_dense_rows() -> int:
    """Packed rows up to this length attend as whole masked rows (default 0: never, without a measurement)."""
    return 0 if _ACTIVE is None else _ACTIVE.dense_rows
