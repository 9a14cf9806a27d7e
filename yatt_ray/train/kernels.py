"""CPU kernel choices, made by measuring them on the machine at hand (once; cached per machine and shape).

Which kernel is faster depends on the CPU: on one 2-core AMD EPYC with AVX-512, oneDNN ran the trainer's fp32
GEMMs at 470 GFLOP/s and MKL (`torch.matmul`) at 190; on another, AVX2-only, the whole box reached 108. So the
trainer does not assume; a worker measures, at its model's shapes, in its dtype and with the threads it was given:

  - linear: oneDNN (`cpu_shims.OneDnnLinear`) or MKL (`torch.matmul`) for Megatron's linear layers, by the
    rate of [2048, hidden] x [hidden, ffn] products, forward and the two backward layouts;
  - threads: the intra-op thread count from 1 to the worker's CPUs that runs that product fastest;
  - attention: grouped-query attention through the fused kernel's own GQA support (`enable_gqa`) or with the
    key / value heads expanded first, by the time of a fused forward + backward (`attention.packed_attention`);
    and up to which packed-row length whole rows with their visibility mask beat the per-sample causal calls
    (`dense_rows`; tens of tokens usually: below that the many tiny kernel calls cost more than the mask).

Each choice keeps the measured figures, so the placement plan can print why (`KernelChoice.describe`). Results are
cached in `$XDG_CACHE_HOME/yatt_ray/kernels.json` (or `~/.cache/...`), keyed by CPU model, torch version, dtype,
threads and shape: the driver measures while it plans (a single-machine cluster's workers then find the result)
and a worker on another machine measures its own. On CUDA nothing is measured (cuBLAS and flash attention).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

LINEAR = ("onednn", "mkl")
GQA = ("native", "expand")


@dataclass(frozen=True)
class KernelChoice:
    """What a CPU worker runs: `linear` in LINEAR, `threads`, `gqa` in GQA, `dense_rows` (packed rows up to
    this length attend as whole masked rows; 0 = never); `rates`: the measured figures (GFLOP/s of each linear
    kernel and thread count, milliseconds of each GQA form and of both attention forms per row length)."""

    linear: str
    threads: int
    gqa: str
    dense_rows: int
    rates: dict

    def describe(self) -> str:
        r = self.rates
        linear = ", ".join(f"{k} {r[f'linear_{k}']:.0f}" for k in LINEAR if f"linear_{k}" in r)
        threads = ", ".join(f"{t}: {r[f'threads_{t}']:.0f}" for t in range(1, 257) if f"threads_{t}" in r)
        gqa = ", ".join(f"{k} {r[f'gqa_{k}']:.1f} ms" for k in GQA if f"gqa_{k}" in r) or "no grouped heads"
        rows = f"whole masked rows up to {self.dense_rows} tokens" if self.dense_rows else "no masked rows"
        return (
            f"kernels (measured on this machine): linear {self.linear} (GFLOP/s {linear}); {self.threads} "
            f"thread(s) (GFLOP/s {threads}); attention GQA {self.gqa} ({gqa}), {rows}"
        )


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "yatt_ray" / "kernels.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


def choose_kernels(shape, max_threads: int, dtype: torch.dtype = torch.float32) -> KernelChoice:
    """The fastest kernels for `shape` (a `LlamaShape`) with up to `max_threads` threads, from the cache or
    measured now (about a second) and cached. The caller's thread count is restored."""
    from yatt_ray.train.cpu_shims import onednn_linear_available

    key = cache_key("v3", dtype, max_threads, shape.hidden_size, shape.ffn_hidden_size, shape.num_heads,
                    shape.num_kv_heads, shape.head_dim, onednn_linear_available(dtype))  # fmt: skip
    return cached_measurement(
        key, lambda: asdict(_measure(shape, max(1, max_threads), dtype)), lambda v: KernelChoice(**v)
    )


def cache_key(*parts) -> str:
    """A cache key for a measurement on this machine: the CPU model and torch version, then `parts`."""
    return "|".join(map(str, (parts[0], _cpu_model(), torch.__version__, *parts[1:])))


def cached_measurement(key: str, measure, read=lambda v: v):
    """`read(value)` of `key` in the machine's cache (`cache_path()`), or `measure()` now (a JSON value),
    stored under `key` and read. An entry `read` cannot take (another version's) is measured again; a cache
    that cannot be written (a read-only home) only means measuring next time too."""
    path = cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a damaged file: it is rewritten below
        cached = {}
    if not isinstance(cached, dict):
        cached = {}
    if key in cached:
        try:
            return read(cached[key])
        except (KeyError, TypeError, ValueError):
            pass
    value = measure()
    cached[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return read(value)


def _measure(shape, max_threads: int, dtype: torch.dtype) -> KernelChoice:
    from yatt_ray.train.cpu_shims import onednn_linear_available, onednn_mm_t

    before = torch.get_num_threads()
    rates: dict[str, float] = {}
    try:
        torch.set_num_threads(max_threads)
        x = torch.randn(2048, shape.hidden_size, dtype=dtype)
        w = torch.randn(shape.ffn_hidden_size, shape.hidden_size, dtype=dtype)
        kernels = {"mkl": lambda a, b: torch.matmul(a, b.t())}
        if onednn_linear_available(dtype):
            kernels["onednn"] = onednn_mm_t
        for name, mm in kernels.items():
            rates[f"linear_{name}"] = _gemm_rate(mm, x, w)
        linear = max(kernels, key=lambda k: rates[f"linear_{k}"])
        for t in range(1, max_threads + 1):
            torch.set_num_threads(t)
            rates[f"threads_{t}"] = (
                rates[f"linear_{linear}"] if t == max_threads else _gemm_rate(kernels[linear], x, w)
            )
        threads = max(range(1, max_threads + 1), key=lambda t: rates[f"threads_{t}"])
        torch.set_num_threads(threads)
        gqa = "native"
        if shape.num_heads != shape.num_kv_heads:
            for form in GQA:
                rates[f"gqa_{form}"] = 1e3 * _attention_seconds(shape, dtype, form)
            gqa = min(GQA, key=lambda k: rates[f"gqa_{k}"])
        dense_rows = 0
        for length in ROW_LENGTHS:
            for form in ("rows", "sequences"):
                rates[f"{form}_{length}"] = 1e3 * _packed_seconds(shape, dtype, length, form, gqa)
            if rates[f"rows_{length}"] >= rates[f"sequences_{length}"]:
                break
            dense_rows = length
    finally:
        torch.set_num_threads(before)
    return KernelChoice(linear, threads, gqa, dense_rows, rates)


ROW_LENGTHS = (64, 128, 256, 512)  # packed-row lengths tried for `dense_rows`, shortest first


def _gemm_rate(mm, x: torch.Tensor, w: torch.Tensor, seconds: float = 0.09) -> float:
    """GFLOP/s of the forward product x w^T and the backward ones (g w, g^T x), best of three windows."""
    g = torch.randn(x.shape[0], w.shape[0], dtype=x.dtype)
    flops = 3 * 2.0 * x.shape[0] * x.shape[1] * w.shape[0]

    def once():
        mm(x, w)
        mm(g, w.t())
        mm(g.t(), x.t())

    once()
    best = 0.0
    for _ in range(3):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            once()
            count += 1
        best = max(best, flops * count / (time.perf_counter() - start) / 1e9)
    return best


def _attention_seconds(shape, dtype: torch.dtype, form: str, length: int = 384, rows: int = 4) -> float:
    q = torch.randn(rows, shape.num_heads, length, shape.head_dim, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(rows, shape.num_kv_heads, length, shape.head_dim, dtype=dtype, requires_grad=True)
            for _ in "kv")  # fmt: skip

    return _best_seconds(lambda: grouped_attention(q, k, v, None, form).sum().backward())


def _best_seconds(once, trials: int = 3) -> float:
    """The shortest of `trials` timed calls of `once()`, after one untimed warm-up call."""
    once()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


def _packed_seconds(shape, dtype: torch.dtype, length: int, form: str, gqa: str, tokens: int = 1024) -> float:
    """Best of two forward + backward times of the packed attention over tokens / length rows of `length`
    tokens (a quarter shared body, 8 samples in the rest), as whole masked rows or per-sample sequences."""
    from yatt_ray.train.attention import segment_layout

    rows, body = max(1, tokens // length), length // 4
    own = torch.arange(length - body) * 8 // (length - body) + 1
    segment = torch.cat([torch.zeros(body, dtype=torch.long), own]).expand(rows, length)
    layout = segment_layout(segment, dense_up_to=length if form == "rows" else 0)
    heads, groups, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    q = torch.randn(length, rows, heads, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(length, rows, groups, d, dtype=dtype, requires_grad=True) for _ in "kv")
    global _ACTIVE
    saved, _ACTIVE = _ACTIVE, KernelChoice("onednn", torch.get_num_threads(), gqa, 0, {})
    try:
        from yatt_ray.train.attention import packed_attention

        return _best_seconds(lambda: packed_attention(q, k, v, layout).sum().backward(), trials=2)
    finally:
        _ACTIVE = saved


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


def kernels_for(model_path: str, max_threads: int, dtype_name: str) -> KernelChoice | None:
    """`choose_kernels` for the policy in `model_path` (a Hugging Face directory) in the trainer's dtype
    ("fp32" / "bf16"); None on CUDA."""
    from yatt_ray.train.hf_convert import LlamaShape
    from yatt_ray.train.trainer_base import DTYPES

    if torch.cuda.is_available():
        return None
    return choose_kernels(LlamaShape.from_hf_dir(model_path), max_threads, DTYPES[dtype_name])


_ACTIVE: KernelChoice | None = None


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


def active_dense_rows() -> int:
    """Packed rows up to this length attend as whole masked rows (default 0: never, without a measurement)."""
    return 0 if _ACTIVE is None else _ACTIVE.dense_rows
