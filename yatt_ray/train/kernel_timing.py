"""CPU kernel choices (`kernels.KernelChoice`) and the CPU matmul peak behind MFU (`cpu_peak`,
`worker_perf_model`), made by measuring them on the machine at hand (once; cached per machine and shape).

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

import time
from dataclasses import asdict

import torch

from yatt_ray.machine_cache import cache_key, cached_measurement
from yatt_ray.metrics.flops import ModelFlops, PerfModel, cuda_matmul_dtype, table_peak
from yatt_ray.model_shape import LlamaShape, linear_shapes
from yatt_ray.train.kernels import (
    GQA,
    WGRAD,
    WGRAD_ROWS,
    WGRAD_WIN,
    KernelChoice,
    grouped_attention,
    kernels_in_effect,
)


def choose_kernels(shape, max_threads: int, dtype: torch.dtype = torch.float32) -> KernelChoice:
    """The fastest kernels for `shape` (a `LlamaShape`) with up to `max_threads` threads, from the cache or
    measured now (3-6 s on 2 cores at 25M-100M shapes) and cached. The caller's thread count is restored."""
    from yatt_ray.train.cpu_shims import onednn_linear_available

    key = cache_key("v6", dtype, max_threads, shape.hidden_size, shape.ffn_hidden_size, shape.num_heads,
                    shape.num_kv_heads, shape.head_dim, onednn_linear_available(dtype))  # fmt: skip
    return cached_measurement(
        key, lambda: asdict(_measure(shape, max(1, max_threads), dtype)), lambda v: KernelChoice(**v)
    )


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
    from yatt_ray.train.attention import packed_attention

    with kernels_in_effect(KernelChoice("onednn", torch.get_num_threads(), gqa, 0, {})):
        return _best_seconds(lambda: packed_attention(q, k, v, layout).sum().backward(), trials=2)


def kernels_for(model_path: str, max_threads: int, dtype_name: str) -> KernelChoice | None:
    """`choose_kernels` for the policy in `model_path` (a Hugging Face directory) in the trainer's dtype
    ("fp32" / "bf16"); None on CUDA."""
    from yatt_ray.train.trainer_base import DTYPES

    if torch.cuda.is_available():
        return None
    return choose_kernels(LlamaShape.from_hf_dir(model_path), max_threads, DTYPES[dtype_name])


def measure_matmul_flops(
    threads: int,
    size: int = 1024,
    seconds: float = 1.0,
    trials: int = 5,
    dtype: torch.dtype = torch.float32,
) -> float:
    """The CPU's matmul FLOP/s in `dtype` with `threads` torch threads: 2 n^3 per [n, n] x [n, n] product, the best
    of `trials` windows of `seconds / trials` each after one warm-up product (the best, so that a moment of
    contention from another process does not lower the peak: measured at 0.3 s in three windows while a Ray
    cluster started beside it, one AVX2 EPYC gave 96 GFLOP/s where it reaches 130-160 idle), over both GEMM
    libraries of the torch build:
    MKL (`torch.matmul`) and oneDNN (vLLM's CPU kernel, and the trainer's where faster: on one AVX-512 AMD EPYC
    MKL reached under half of oneDNN, on an AVX2 one MKL was the faster). The caller's thread count is restored."""
    from yatt_ray.train.cpu_shims import onednn_linear_available, onednn_mm_t

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        kernels = [torch.matmul] + ([onednn_mm_t] if onednn_linear_available(dtype) else [])
        best = 0.0
        for mm in kernels:
            mm(a, b)
            best = max(best, *(_matmul_rate(mm, a, b, seconds / trials) for _ in range(trials)))
        return best
    finally:
        torch.set_num_threads(before)


def _matmul_rate(mm, a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    count, start = 0, time.perf_counter()
    while True:
        mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] * count / elapsed


def worker_perf_model(
    shape, threads: int, override: float | None, dtype: torch.dtype = torch.float32
) -> PerfModel:
    """This worker's PerfModel: `cluster.peak_flops` when set, else the table for its CUDA device and `dtype`,
    else (CPU) a measured matmul peak in `dtype` with its `threads` (measured once per machine and cached
    beside the kernel choices, `machine_cache.cache_path()`: ~2 s off every later start; `cpu_peak`)."""
    flops = ModelFlops.from_shape(shape)
    if override is not None:
        return PerfModel(flops, override, "cluster.peak_flops")
    if torch.cuda.is_available():
        name, key = torch.cuda.get_device_name(), cuda_matmul_dtype(dtype)
        peak = table_peak(name, key)
        source = f"table: {name} {key}" if peak else f"unknown: {name} {key} (set cluster.peak_flops)"
        return PerfModel(flops, peak, source)
    peak, source = cpu_peak(threads, dtype)
    return PerfModel(flops, peak, source)


def cpu_peak(threads: int, dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """(FLOP/s, where it came from): this CPU's matmul peak in `dtype` with `threads`, measured once per machine,
    dtype and thread count and cached beside the kernel choices (`machine_cache.cache_path()`; the driver
    measures it while it plans, so a one-machine cluster's workers read it instead of measuring while the
    others start)."""
    from yatt_ray.train.cpu_shims import onednn_linear_available

    # A CPU without bf16 units (no oneDNN bf16 product: AVX2 only) computes bf16 in fp32 after conversion, at
    # best at its fp32 rate, which is then the peak (its bf16 GEMMs measure far below it, size-dependent).
    native = dtype == torch.float32 or onednn_linear_available(dtype)
    peak_dtype = dtype if native else torch.float32
    key = cache_key("peak-v3", peak_dtype, threads)
    name = "bf16" if peak_dtype == torch.bfloat16 else "fp32"
    peak = cached_measurement(key, lambda: measure_matmul_flops(threads, dtype=peak_dtype), float)
    source = f"measured: {name} matmul (best of MKL, oneDNN), {threads} thread(s)"
    return peak, source + ("" if native else "; this CPU has no bf16 matmul units")
