"""Patches that let megatron-core 0.16.1 run on a CPU-only torch build.

Megatron assumes CUDA in a handful of places that a CPU run reaches (see `shared/notes/cpu-stack.md`). Every
patch the library applies lives in this one module, each with the reason next to it. `apply_cpu_shims()` is
idempotent and does nothing at all when CUDA is available, so GPU runs see an unmodified Megatron.

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

import torch

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
