"""Import megatron-core without compiling anything at import time.

`import megatron.core` runs `megatron.core.jit`, which sets `jit_fuser = torch.compile`, and the fusion modules
decorate their functions with it at import. `torch.compile(fn)` resolves its backend when it is called, so that
import brings in TorchDynamo and Inductor: about 1.6 of the 3.0 s `import megatron.core` takes on a 2-core VM,
in every training worker of every run, though this library runs none of Megatron's compiled fusions
(`yatt_ray.train.fused` replaces the two it reaches). `import_megatron` imports it with `torch.compile`
deferred: a decorated function is compiled by the real `torch.compile`, with the same arguments, on its first
call. Megatron's inference module also imports W&B when installed (about 0.3 s); it is hidden for that import
only, so Megatron sees none (it logs nothing to W&B here) while every later `import wandb` works as usual.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch


def import_megatron() -> None:
    """Import `megatron.core` (once per process) with `torch.compile` deferred and W&B hidden while it loads."""
    if "megatron.core" in sys.modules:
        return
    with _deferred_torch_compile(), _hidden_module("wandb"):
        import megatron.core  # noqa: F401


def deferred_compile(real: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile` that compiles on the first call: `deferred_compile(torch.compile)(fn, **options)` and
    the decorator forms `(fn)` / `(**options)(fn)` behave as `torch.compile`'s, minus the import it costs."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_later(fn, **options)
        compiled: Any = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later


@contextlib.contextmanager
def _deferred_torch_compile() -> Iterator[None]:
    real = torch.compile
    torch.compile = deferred_compile(real)  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = real


@contextlib.contextmanager
def _hidden_module(name: str) -> Iterator[None]:
    """`import name` raises ImportError inside the block, unless it was imported before it."""
    if name in sys.modules:
        yield
        return
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get(name, 0) is None:
            del sys.modules[name]
