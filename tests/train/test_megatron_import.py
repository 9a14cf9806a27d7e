"""What a training worker imports before it trains: Megatron without TorchDynamo's compiler stack, and the run's
driver-side actor without torch (each fresh process of every run pays for its imports)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from yatt_ray.train.megatron_import import deferred_compile


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_deferred_compile_compiles_once_on_the_first_call_with_the_given_options():
    calls: list[tuple] = []

    def fake_compile(fn, **options):
        calls.append((fn.__name__, options))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def double(x):
        return 2 * x

    compile_later = deferred_compile(fake_compile)
    plain, with_options = compile_later(double), compile_later(mode="max-autotune")(double)
    assert calls == [] and plain.__name__ == "double"  # nothing compiled by decorating
    assert plain(3) == ("compiled", 6) and plain(4) == ("compiled", 8)
    assert with_options(5) == ("compiled", 10)
    assert calls == [("double", {}), ("double", {"mode": "max-autotune"})]  # once each, options passed on


def test_megatron_imports_without_the_compiler_stack_and_leaves_wandb_importable():
    out = _run(
        "import sys, importlib.util\n"
        "from yatt_ray.train.megatron_import import import_megatron\n"
        "import_megatron()\n"
        "from megatron.core import jit, parallel_state\n"
        "from megatron.core.models.gpt import GPTModel\n"
        "print('inductor' if 'torch._inductor.compile_fx' in sys.modules else 'no-inductor')\n"
        "print('wandb-loaded' if sys.modules.get('wandb') else 'no-wandb')\n"
        "if importlib.util.find_spec('wandb'):\n"
        "    import wandb; print('wandb-importable', wandb.__name__)\n"
        "import torch\n"
        "f = jit.jit_fuser(lambda x: x * 2)\n"
        "print('jit', f(torch.ones(2)).tolist())\n"
    )
    lines = out.splitlines()
    assert "no-inductor" in lines and "no-wandb" in lines, out
    assert "jit [2.0, 2.0]" in lines, out  # Megatron's fuser still works: compiled on its first call
    if importlib.util.find_spec("wandb"):  # hidden from Megatron only while it loaded
        assert "wandb-importable wandb" in lines, out


def test_the_run_actor_module_imports_no_torch():
    out = _run("import sys, yatt_ray.run_control; print('torch' in sys.modules)")
    assert out.strip() == "False", out
    # the checkpoint package still offers the writer's names (imported when asked for)
    out = _run(
        "from yatt_ray.checkpoint import AsyncCheckpointWriter, load; print(AsyncCheckpointWriter.__name__)"
    )
    assert out.strip() == "AsyncCheckpointWriter"
