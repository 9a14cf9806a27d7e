"""Patches that let megatron-core 0.16.1 run on a CPU-only torch build.

Megatron assumes CUDA in a handful of places that a CPU run reaches (see `shared/notes/cpu-stack.md`). Every
patch the library applies lives in this one module, each with the reason next to it. `apply_cpu_shims()` is
idempotent and does nothing at all when CUDA is available, so GPU runs see an unmodified Megatron.

Two changes are for speed, not for function. glibc's malloc keeps the memory freed tensors give back
(`host_memory.keep_freed_memory`: no fresh, zero-faulted pages for every activation). And Megatron's
tensor-parallel linear layers run their matmuls (forward, input gradient; the weight gradient in the form
measured fastest, `weight_grad`) through oneDNN instead of `torch.matmul`. torch's CPU wheel does
fp32 GEMM with MKL, which on AMD CPUs picks a slow code path: measured on this project's 2-core AMD EPYC
(AVX-512), `torch.matmul` [2560, 512] x [512, 2048] reached 190 GFLOP/s and oneDNN 470-510 GFLOP/s, fp32 both
(largest difference 1.4e-4 on outputs of size ~20: accumulation order); on other CPUs MKL can be the faster,
so each worker measures both and takes the faster (`kernel_timing.choose_kernels`). `release/bench_vs_trl.py` shows
what it buys end to end.

Not patched on purpose:
- `torch.cuda.manual_seed_all`: `torch.manual_seed` calls it, so redirecting it to `torch.manual_seed` recurses;
  on a CPU build it only queues a lazy call that never runs, which is harmless.
- `torch.cuda.manual_seed` / `get_rng_state`: Megatron's seed function and tracker call them; the tracker
  subclass below seeds and reads CPU generator states itself instead (`manual_seed` alone is a harmless lazy
  no-op on a CPU build, so the seed function's own call to it does nothing; seed the CPU generator directly).
- `torch.cuda.empty_cache`: already a no-op when CUDA was never initialised.
- Megatron's optimizer and grad clipping (`get_megatron_optimizer`, `clip_grad_norm_fp32`) hard-code CUDA; the
  trainer uses plain `torch.optim` and its own norm instead of patching them.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from yatt_ray.host_memory import keep_freed_memory
from yatt_ray.train.kernels import active_linear, active_wgrad_form

_APPLIED = False


def apply_cpu_shims() -> bool:
    """Patch Megatron/torch for a CPU-only run; return True if patches are (now) in place, False on CUDA."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _patch_torch_cuda()
    _patch_rng_tracker()
    _patch_linear_matmuls()
    keep_freed_memory()
    _APPLIED = True
    return True


def _patch_torch_cuda() -> None:
    # Megatron passes `device=torch.cuda.current_device()` when it allocates buffers (attention, rotary
    # embedding, TP collectives' output tensors, DDP grad buffers). "cpu" is a valid `device=` for all of them.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    # `dist_checkpointing.save`, `parallel_state.update_pg_timeout` and DDP's grad-buffer offload call
    # `torch.cuda.synchronize()`; CPU ops are synchronous, so there is nothing to wait for.
    torch.cuda.synchronize = lambda device=None: None


def _patch_rng_tracker() -> None:
    """Point Megatron's tensor-parallel RNG tracker at the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    # The tracker's private helpers index `torch.cuda.default_generators` / call `_C._cuda_setRNGState`,
    # which do not exist on a CPU build. Redirect them to the CPU generator's state.
    def get_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's named-RNG-state tracker, keeping CPU generator states.

        `add` seeds a fresh CPU generator (the base class seeds "the CUDA generator" through
        `torch.cuda.manual_seed`, a no-op on a CPU build, so every state would be the same). `fork` drops the
        base class's "CPU RNG state changed within GPU RNG context" warning: on CPU the tracked state lives in
        the very generator that warning watches; the swap-in, run, swap-back logic is unchanged.
        """

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if outer_name != "default-rng":
                    outer_state = self.states_[outer_name]
                torch.set_rng_state(outer_state)
                self._current_state_name = outer_name

    # `initialize_rng_tracker` instantiates the class by its module-level name; trackers made from now on
    # are CPU ones. Drop any tracker already built so the next `get_cuda_rng_tracker()` makes a CPU one.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom.initialize_rng_tracker(force_reset=True)


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN's dense linear op (`torch.ops.mkldnn._linear_pointwise`) and it
    runs in `dtype` on this CPU (bf16 needs AVX-512 or AMX: on an AVX2-only CPU oneDNN has no bf16 inner
    product, "could not create a primitive descriptor"; a tiny product is tried once per dtype)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        onednn_mm_t(torch.ones(2, 4, dtype=dtype), torch.ones(3, 4, dtype=dtype))
    except RuntimeError:
        return False
    return True


def onednn_mm_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K].T -> [M, N] with oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


def weight_grad(g: torch.Tensor, x: torch.Tensor, form: str | None = None) -> torch.Tensor:
    """dW = g^T x [N, K] for g [T, N], x [T, K] in `form` (`kernels.WGRAD`; default: the one measured for T
    rows, `kernels.active_wgrad_form`). oneDNN reads its first operand in its own layout, so "direct" (g^T,
    x^T) copies g^T [N, T] first; for N > K "transposed" computes (x^T g)^T instead: it copies only x^T [K, T],
    reads g^T as the weight operand (reordered inside the product) and returns the [K, N] result laid out as
    [N, K]; "mkl" is `torch.mm`, which reads both transposed operands where they lie."""
    form = active_wgrad_form(g.shape[0]) if form is None else form
    if form == "mkl":
        return torch.mm(g.t(), x)
    if g.shape[1] > x.shape[1] and form == "transposed":
        return onednn_mm_t(x.t().contiguous(), g.t()).t().contiguous()
    return onednn_mm_t(g.t(), x.t())


class OneDnnLinear(torch.autograd.Function):
    """y = x W^T + b on oneDNN (the weight gradient in its measured form, `weight_grad`); the input gradient
    is summed over `tp_group` when `allreduce_dgrad` (a column-parallel layer's input is replicated over the
    TP ranks).

    x [..., K], W [N, K] (this rank's shard), b [N] or None -> y [..., N]. Backward: dx = dy W, dW = dy^T x,
    db = sum(dy), over the flattened leading dimensions.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.allreduce_dgrad, ctx.tp_group = bias is not None, allreduce_dgrad, tp_group
        out = onednn_mm_t(x.reshape(-1, x.shape[-1]), weight)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_mm_t(g, weight.t()).view(x.shape)  # strided views: oneDNN reads them as they are
            if ctx.allreduce_dgrad:
                torch.distributed.all_reduce(grad_x, group=ctx.tp_group)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(g, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(dim=0)
        return grad_x, grad_w, grad_b, None, None


def _patch_linear_matmuls() -> None:
    """Route Megatron's ColumnParallelLinear / RowParallelLinear matmuls through `OneDnnLinear` (see the
    module docstring). Calls with options this library never sets (sequence parallelism, fused gradient
    accumulation, deferred weight gradients) keep Megatron's own function."""
    if not onednn_linear_available():
        return
    from megatron.core.tensor_parallel import layers

    def routed(original):
        def linear(input, weight, bias=None, **options):
            plain = not (
                options.get("sequence_parallel")
                or options.get("gradient_accumulation_fusion")
                or options.get("grad_output_buffer")
            )
            if not plain or active_linear() != "onednn" or not onednn_linear_available(input.dtype):
                return original(input, weight, bias, **options)
            dgrad = options.get("async_grad_allreduce")
            dgrad = options.get("allreduce_dgrad", False) if dgrad is None else dgrad
            return OneDnnLinear.apply(input, weight, bias, dgrad, options.get("tp_group"))

        linear.__dict__.update(original.__dict__)  # Megatron's function reads its own `warned` flag by name
        return linear

    layers.linear_with_grad_accumulation_and_async_allreduce = routed(
        layers.linear_with_grad_accumulation_and_async_allreduce
    )
    layers.linear_with_frozen_weight = routed(layers.linear_with_frozen_weight)
