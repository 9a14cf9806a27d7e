"""The CPU train step at `bench_vs_trl.py`'s shapes, with and without two of its speed-ups, side by side.

    python release/bench_train_step.py                      # 25m, 3 processes per malloc setting, 10 steps each
    python release/bench_train_step.py --size 34m --runs 2

What runs: `MegatronPolicy.train_step` in one process (a world of size 1, the kernels measured as a worker
measures them), on a random model of the --size shape (`bench_vs_trl.SIZES`, char-level vocabulary) and a GRPO-like
batch: --groups groups of 8 samples of one prompt (6-8 tokens), responses of 1 + Poisson(2.5) tokens (at most
16; what the benchmark's warmed-up models sample), one micro-batch of all rows. Two comparisons:

  - flat rows: the model over the packed rows' real tokens as one row (`SharedPrefixRows.flat`, the trainer's
    path) against the padded rows [G, L] (every group padded to the longest), alternating step by step in
    a process with the trainer's malloc setting;
  - malloc: a process with glibc's malloc kept from returning freed memory (`host_memory.keep_freed_memory`,
    the trainer's setting) against one with glibc's defaults, both running flat steps only (tensors of two
    sizes taking turns raise glibc's dynamic mmap threshold and hide much of its cost); each process also
    reports its page faults and system time.
Each run starts the three processes one after another; --runs rounds of them.

Each process discards its first --warmup steps of each form. Reported: per process the median step of each
form; overall the median over processes. Last line:
    train_step: size=<s> flat_speedup=<padded / flat> malloc_speedup=<default / kept> step_s=<flat, kept>
Run it on an idle machine (`uptime`); the ratios are measured side by side, absolute times are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "release"))


def make_batch(groups: int, n: int, seed: int = 0):
    """[groups * n, 24] rows: each group's prompt (6-8 tokens) and its samples' responses, right-padded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(groups * n, 24, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for group in range(groups):
        prompt = torch.randint(5, 30, (int(torch.randint(6, 9, (1,), generator=g)),), generator=g)
        for j in range(n):
            r, p = group * n + j, len(prompt)
            length = min(16, 1 + int(torch.poisson(torch.tensor(2.5), generator=g)))
            ids[r, :p], ids[r, p : p + length] = prompt, torch.randint(5, 30, (length,), generator=g)
            mask[r, : p + length] = 1
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(groups * n, generator=g)}


def child(args: argparse.Namespace) -> dict:
    """One process: alternating flat / padded steps; returns their medians, page faults and system time."""
    import torch
    from bench_train_mfu import init_world
    from bench_vs_trl import SIZES

    import yatt_ray.train.policy as policy_module
    from yatt_ray.host_memory import cpu_env
    from yatt_ray.model_shape import LlamaShape
    from yatt_ray.models.tiny import TinyModelSpec, build_tiny_model
    from yatt_ray.train import cpu_shims
    from yatt_ray.train.kernel_timing import choose_kernels
    from yatt_ray.train.kernels import apply_kernels

    os.environ.update(cpu_env())  # as in the library's workers, before the first GEMM
    if args.malloc == "default":
        cpu_shims.keep_freed_memory = lambda: False
    torch.set_num_threads(args.threads)
    hidden, layers, heads, kv, inter = SIZES[args.size]
    spec = TinyModelSpec(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                         intermediate_size=inter)  # fmt: skip
    model_dir = Path(tempfile.mkdtemp()) / "model"
    build_tiny_model(model_dir, spec)
    apply_kernels(choose_kernels(LlamaShape.from_hf_dir(model_dir), args.threads))
    init_world()
    policy = policy_module.MegatronPolicy(model_dir, lr=1e-4)
    batch = make_batch(args.groups, 8)
    tokens = float(batch["attention_mask"][:, 1:].sum())

    def loss_fn(logp, entropy, micro):
        mask = micro["attention_mask"][:, 1:].to(logp.dtype)
        loss = (-micro["advantages"][:, None] * logp * mask).sum() / tokens
        return loss, {"loss": loss.detach()}

    flat_rows = policy_module.model_rows
    forms = args.forms.split(",")
    times: dict[str, list[float]] = {form: [] for form in forms}
    before = resource.getrusage(resource.RUSAGE_SELF)
    for step in range(len(forms) * (args.warmup + args.steps)):
        form = forms[step % len(forms)]
        policy_module.model_rows = flat_rows if form == "flat" else (lambda model, packed: packed)
        start = time.perf_counter()
        policy.train_step(batch, loss_fn, micro_batch_size=len(batch["input_ids"]), group_size=8)
        times[form].append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        **{form: statistics.median(t[args.warmup :]) for form, t in times.items()},
        "faults": after.ru_minflt - before.ru_minflt,
        "sys_s": after.ru_stime - before.ru_stime,
    }


# the processes of one run: (forms alternating step by step, malloc setting)
PROCESSES = (("flat,padded", "kept"), ("flat", "default"), ("flat", "kept"))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="25m", help="a bench_vs_trl.py shape: 25m, 34m, 100m")
    p.add_argument("--groups", type=int, default=32, help="prompts per step (8 samples each)")
    p.add_argument("--runs", type=int, default=3, help="rounds of the three processes")
    p.add_argument("--steps", type=int, default=8, help="measured steps per form and process")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per form and process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--malloc", choices=("kept", "default"), help=argparse.SUPPRESS)  # a child process
    p.add_argument("--forms", default="flat", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.malloc:
        print(json.dumps(child(args)))
        return
    print(f"load average before: {os.getloadavg()}", flush=True)
    results: dict[tuple[str, str], list[dict]] = {kind: [] for kind in PROCESSES}
    for run in range(args.runs):
        for forms, malloc in PROCESSES:
            cmd = [sys.executable, __file__, *argv, "--malloc", malloc, "--forms", forms]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results[(forms, malloc)].append(r)
            steps = ", ".join(f"{form} {r[form]:.3f} s" for form in forms.split(","))
            print(f"run {run + 1} malloc {malloc:7s}: {steps}; {r['faults']} page faults, "
                  f"{r['sys_s']:.1f} s system", flush=True)  # fmt: skip

    def median(forms: str, malloc: str, form: str) -> float:
        return statistics.median(r[form] for r in results[(forms, malloc)])

    flat_speedup = median("flat,padded", "kept", "padded") / median("flat,padded", "kept", "flat")
    malloc_speedup = median("flat", "default", "flat") / median("flat", "kept", "flat")
    print(f"load average after: {os.getloadavg()}")
    print(f"train_step: size={args.size} flat_speedup={flat_speedup:.2f} malloc_speedup={malloc_speedup:.2f} "
          f"step_s={median('flat', 'kept', 'flat'):.3f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
