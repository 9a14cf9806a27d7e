"""CPU kernel choices, made by measuring them on the machine at hand (once; cached per machine and shape).

Which kernel is faster depends on the CPU: on one 2-core AMD EPYC with AVX-512, oneDNN ran the trainer's fp32
GEMMs at 470 GFLOP/s and MKL (`torch.matmul`) at 190; on another, AVX2-only, the whole box reached 108. So the
trainer does not assume; a worker measures, at its model's shapes, in its dtype and with the threads it was given:

  - linear: oneDNN (`cpu_shims.OneDnnLinear`) or MKL (`torch.matmul`) for Megatron's linear layers, by the
    rate of the model's own four linear layers at 512 tokens, forward and the two backward products, the two
    kernels taking turns (`linear_rates`; on one AVX2 EPYC a first, shorter measurement of one product picked
    oneDNN at 88 against 76 GFLOP/s, where a 25M-100M model's layers run at 115-170 on MKL, 80-140 on oneDNN);
  - threads: the intra-op thread count from 1 to the worker's CPUs that runs those layers fastest;
  - weight gradient (when the layers run on oneDNN): dW = dy^T x [N, K] for T rows, in one of three forms
    (`cpu_shims.weight_grad`): as oneDNN takes it ("direct"), which first copies dy^T [N, T] into its layout
    (a single-threaded transpose); for a layer wider out than in (N > K: the MLP's gate + up, q/k/v) as
    (x^T dy)^T ("transposed"), which copies only x^T [K, T]; or with MKL ("mkl"), which reads both operands
    transposed where they lie, no copy, at MKL's GEMM rate. Timed over the model's four layers at a short and
    a long row count (`WGRAD_ROWS`); a row count takes the form measured at the nearest of them. On one
    AVX-512 EPYC the gate + up gradient of a 25M model took 92 ms direct, 48 transposed at 4096 tokens (MKL
    ran at half oneDNN's rate there); on another, where MKL's GEMMs ran at 0.92 of oneDNN's, the copy-free MKL
    form took 16-23 ms against 17-25 direct at 640-1024 rows;
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
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from yatt_ray.cluster import CPU_ENV

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
    measured now (3-6 s on 2 cores at 25M-100M shapes) and cached. The caller's thread count is restored."""
    from yatt_ray.train.cpu_shims import onednn_linear_available

    key = cache_key("v6", dtype, max_threads, shape.hidden_size, shape.ffn_hidden_size, shape.num_heads,
                    shape.num_kv_heads, shape.head_dim, onednn_linear_available(dtype))  # fmt: skip
    return cached_measurement(
        key, lambda: asdict(_measure(shape, max(1, max_threads), dtype)), lambda v: KernelChoice(**v)
    )


# environment variables that cap the instruction set a GEMM library uses (an AVX-512 CPU run as an AVX2 one)
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def cache_key(*parts) -> str:
    """A cache key for a measurement on this machine: the CPU model, torch version and the instruction-set
    caps set in the environment (`ISA_CAPS`: the same CPU measures differently under them) and the CPU math
    settings (`cluster.CPU_ENV`), then `parts`."""
    caps = ",".join(f"{k}={os.environ[k]}" for k in (*ISA_CAPS, *CPU_ENV) if os.environ.get(k))
    return "|".join(
        map(str, (parts[0], _cpu_model(), torch.__version__, *([caps] if caps else []), *parts[1:]))
    )


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
        kernels = {"mkl": lambda a, b: torch.matmul(a, b.t())}
        if onednn_linear_available(dtype):
            kernels["onednn"] = onednn_mm_t
        rates.update({f"linear_{k}": r for k, r in linear_rates(shape, dtype, kernels).items()})
        linear = max(kernels, key=lambda k: rates[f"linear_{k}"])
        rates[f"threads_{max_threads}"] = rates[f"linear_{linear}"]
        for t in range(1, max_threads):
            torch.set_num_threads(t)
            rates[f"threads_{t}"] = linear_rates(shape, dtype, {linear: kernels[linear]}, rounds=2)[linear]
        threads = max(range(1, max_threads + 1), key=lambda t: rates[f"threads_{t}"])
        torch.set_num_threads(threads)
        wgrad = []
        for rows in WGRAD_ROWS if linear == "onednn" else ():
            seconds = wgrad_seconds(shape, dtype, rows)
            rates.update({f"wgrad_{form}_{rows}": 1e3 * s for form, s in seconds.items()})
            best = min(WGRAD, key=lambda form: seconds[form])
            wgrad.append((rows, best if seconds[best] < WGRAD_WIN * seconds["direct"] else "direct"))
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
    return KernelChoice(linear, threads, gqa, dense_rows, rates, tuple(wgrad))


ROW_LENGTHS = (64, 128, 256, 512)  # packed-row lengths tried for `dense_rows`, shortest first


def linear_shapes(shape) -> list[tuple[int, int]]:
    """(in, out) features of a decoder layer's four linear layers: q/k/v, attention output, MLP gate + up and
    MLP down (what one token costs: 2 x sum(in x out) FLOPs forward, twice that backward)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    h, f = shape.hidden_size, shape.ffn_hidden_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * f), (f, h)]


def linear_rates(
    shape, dtype: torch.dtype, kernels: dict, tokens: int = 512, rounds: int = 4
) -> dict[str, float]:
    """GFLOP/s of each kernel (name -> mm(a [M, K], b [N, K]) = a b^T) over one decoder layer's linear layers
    (`linear_shapes`) at `tokens` rows: per layer the forward x W^T and both backward products (dy W, dy^T x).
    The kernels take turns, `rounds` times, and each keeps its fastest pass: a burst of load from another
    process (a cluster starting beside the measurement) then slows one pass of each, not one kernel's figure."""
    layers = []
    for k_in, n_out in linear_shapes(shape):
        x, w = torch.randn(tokens, k_in, dtype=dtype), torch.randn(n_out, k_in, dtype=dtype)
        layers.append((x, w, torch.randn(tokens, n_out, dtype=dtype)))
    flops = sum(6.0 * tokens * x.shape[1] * w.shape[0] for x, w, _ in layers)

    def one_pass(mm):
        for x, w, g in layers:
            mm(x, w)
            mm(g, w.t())
            mm(g.t(), x.t())

    best = fastest_passes({name: lambda mm=mm: one_pass(mm) for name, mm in kernels.items()}, rounds)
    return {name: flops / seconds / 1e9 for name, seconds in best.items()}


def fastest_passes(passes: dict, rounds: int) -> dict[str, float]:
    """Seconds of each candidate's fastest pass (name -> a callable running one pass): one untimed warm-up
    pass each (oneDNN builds its primitives, MKL its buffers), then `rounds` rounds in which the candidates
    take turns, so that a burst of load from another process slows a pass of each, not one candidate's figure."""
    for run in passes.values():
        run()
    best = dict.fromkeys(passes, float("inf"))
    for _ in range(rounds):
        for name, run in passes.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def wgrad_seconds(shape, dtype: torch.dtype, tokens: int, rounds: int = 3) -> dict[str, float]:
    """Seconds of the weight gradients of `shape`'s four linear layers (`linear_shapes`) at `tokens` rows in
    each WGRAD form (`cpu_shims.weight_grad`), the forms taking turns, each keeping its fastest pass."""
    from yatt_ray.train.cpu_shims import weight_grad

    pairs = [
        (torch.randn(tokens, n, dtype=dtype), torch.randn(tokens, k, dtype=dtype))
        for k, n in linear_shapes(shape)
    ]

    def one_pass(form: str) -> None:
        for g, x in pairs:
            weight_grad(g, x, form)

    return fastest_passes({form: lambda form=form: one_pass(form) for form in WGRAD}, rounds)


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


def active_wgrad_form(rows: int) -> str:
    """The weight-gradient form (WGRAD) for `rows` rows (default "direct", without a measurement)."""
    return "direct" if _ACTIVE is None else _ACTIVE.wgrad_form(rows)


def active_dense_rows() -> int:
    """Packed rows up to this length attend as whole masked rows (default 0: never, without a measurement)."""
    return 0 if _ACTIVE is None else _ACTIVE.dense_rows
