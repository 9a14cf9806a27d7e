"""What the trainer's GPU step would cost, counted on the CPU (no GPU needed): the proxies that hold GPU gains.

    python release/bench_gpu_ready.py                    # the ~0.5B and 1.5B Qwen2 shapes, 16,384-token micro-batch
    python release/bench_gpu_ready.py --tokens 4096      # a smaller micro-batch (quicker)
    python release/bench_gpu_ready.py --shapes 1024:8:8:2816 --group 4   # any hidden:heads:kv_heads:mlp point

Measured (definitions in `yatt_ray.testing.gpu_proxies`):
  - ops_per_layer: kernel-launching ops of one decoder layer, forward + backward, over one GRPO micro-batch of
    --tokens tokens (groups of 8 samples of a 256-token prompt, long-tailed response lengths) through the
    trainer's own forward (`MegatronPolicy._forward`: packed attention, log-probs from the hidden states) and the
    library's GRPO loss (`step.policy_loss_fn`), on the GPU's code path (`gpu_proxies.gpu_kernels`: Megatron's own
    linear layers, not the CPU's oneDNN route): the
    count of a 2-layer model less a 1-layer one's, at each shape's widths (heads, kv heads, hidden, MLP) with
    the vocabulary cut to 1,024 (the output layer is not a layer); the largest over the shapes.
  - host_syncs_per_step: ops that would make a GPU wait, in one whole `train_step` (two micro-batches, the
    gradient sync, clipping, the optimizer, the metrics) of the 2-layer model with the GRPO loss.
  - logprob_peak_mib: the extra peak of log-probs + entropy, forward and backward, for --tokens positions at
    vocabulary 151,936 and hidden 1,536 (bf16, a GPU's chunking), measured on fake tensors; the float32 logits
    and their gradient alone would be tokens x 151,936 x 8 bytes.
  - fits_7b: GRPO with Qwen2.5-7B-Instruct on 8 x H100 80 GB (examples/configs/grpo_qwen7b_gsm8k.yaml) passes
    the placement plan and its memory check.

The targets (issue 55): ops_per_layer <= 60, host_syncs_per_step <= 2, logprob_peak_mib <= 1024, fits_7b = 1.
Last line: `gpu_ready: ops_per_layer=<n> host_syncs_per_step=<n> logprob_peak_mib=<x> fits_7b=<0|1>`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # hidden, heads, kv heads, MLP (Qwen2.5-0.5B and Qwen2.5-1.5B's config.json)
    "qwen2-0.5b": (896, 14, 2, 4864),
    "qwen2-1.5b": (1536, 12, 2, 8960),
}


def policy_of(folder: Path, layers: int, shape: tuple[int, int, int, int]):
    from yatt_ray.testing.gpu_proxies import qwen2_dir
    from yatt_ray.train import MegatronPolicy

    hidden, heads, kv, ffn = shape
    qwen2_dir(folder / f"l{layers}", hidden, layers, heads, kv, ffn, vocab=1024)
    return MegatronPolicy(folder / f"l{layers}", lr=1e-5)


def shape_arg(text: str) -> str:
    """A preset's name, or a `hidden:heads:kv_heads:mlp` point (added to SHAPES under that name)."""
    if text not in SHAPES:
        try:
            hidden, heads, kv, ffn = (int(x) for x in text.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a preset ({', '.join(SHAPES)}) or hidden:heads:kv:mlp"
            ) from None
        SHAPES[text] = (hidden, heads, kv, ffn)
    return text


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="real tokens of the micro-batch")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=list(SHAPES),
        type=shape_arg,
        help=f"presets ({', '.join(SHAPES)}) or hidden:heads:kv_heads:mlp points",
    )
    p.add_argument("--group", type=int, default=8, help="samples a prompt in the micro-batch")
    args = p.parse_args(argv)

    import torch.distributed as dist

    from yatt_ray.testing.gpu_proxies import (
        fits_7b,
        grpo_micro_batch,
        logprob_peak_mib,
        micro_batch_counts,
        step_syncs,
    )
    from yatt_ray.train import init_parallel_state

    print(
        f"load average before: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}", flush=True
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state(1)
    micro = grpo_micro_batch(args.tokens, vocab=1024, group=args.group)
    rows, real = len(micro["batch"]["input_ids"]), int(micro["batch"]["attention_mask"].sum())
    print(f"micro-batch: {rows} rows, {real} tokens, groups of {micro['group']}", flush=True)
    per_layer, syncs = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shapes:
            start = time.perf_counter()
            counts = [
                micro_batch_counts(policy_of(Path(tmp) / name.replace(":", "-"), n, SHAPES[name]), micro)
                for n in (1, 2)
            ]
            per_layer[name] = sum(counts[1].ops.values()) - sum(counts[0].ops.values())
            layer_ops = counts[1].ops - counts[0].ops
            top = ", ".join(f"{k} {v}" for k, v in layer_ops.most_common(8))
            print(f"{name}: {per_layer[name]} ops per layer ({top}); {time.perf_counter() - start:.0f} s")
        two = policy_of(Path(tmp) / "syncs", 2, SHAPES[args.shapes[0]])
        step = step_syncs(two, micro, micro_batch_size=(rows + 1) // 2)
        syncs = sum(step.syncs.values())
        print(f"one train_step of 2 micro-batches: {syncs} host syncs ({dict(step.syncs)})")
        peak = logprob_peak_mib(args.tokens, 1536, 151_936)
        dense = args.tokens * 151_936 * 8 / 2**20
        print(
            f"log-probs at {args.tokens} x 151,936 x 1,536: {peak:.0f} MiB extra (float32 logits + grad {dense:.0f})"
        )
        fits, estimate = fits_7b(Path(tmp))
        print(f"GRPO Qwen2.5-7B on 8 x H100 80 GB: {'fits' if fits else 'does not fit'} {estimate}")
    out = {
        "ops_per_layer": max(per_layer.values()),
        "host_syncs_per_step": syncs,
        "logprob_peak_mib": round(peak, 1),
        "fits_7b": int(fits),
    }
    print("gpu_ready: " + " ".join(f"{k}={v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
