"""Train-phase MFU of the Megatron trainer (`MegatronPolicy.train_step`) on a random Qwen2-shaped model.

    python release/bench_train_mfu.py                              # Qwen2.5-0.5B's shape, bf16, 64 x 1024 tokens
    python release/bench_train_mfu.py --micro-batch-size 8 --steps 10
    python release/bench_train_mfu.py --dtype fp32 --rows 16       # fp32 weights (tf32 only if torch allows it)
    python release/bench_train_mfu.py --preset qwen2-1.5b --max-tokens 16384   # micro-batches by a token budget
    python release/bench_train_mfu.py --preset tiny                # seconds on a CPU (what the test runs)

What runs: one process, a world of size 1 (torch.distributed with an in-memory store; "cpu:gloo,cuda:nccl"
as `fit` uses on GPUs, else gloo), and in it the library's own trainer, `MegatronPolicy(dir, dtype=...,
lr=1e-5)` (Megatron GPTModel, local layer spec, Megatron DDP, AdamW on fp32 main weights), built from a Hugging
Face directory of random weights (seed 0, `Qwen2ForCausalLM`, written under a temp dir or --out):
  - qwen2-0.5b: Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14 heads / 2 kv heads (head_dim 64), MLP 4864,
    vocab 151936, tied embeddings, q/k/v biases, rope_theta 1e6;
  - qwen2-1.5b: Qwen2.5-1.5B's shape: hidden 1536, 28 layers, 12 heads / 2 kv heads (head_dim 128), MLP 8960,
    vocab 151936, tied embeddings, q/k/v biases; micro-batches of 16 rows (16,384 tokens) by default;
  - tiny: the same family at hidden 64, 2 layers, 4 heads / 2 kv heads, MLP 176, vocab 512.
Each step is one `train_step` (an optimizer step) over --rows random sequences of exactly --length tokens (no
padding, group_size 1), in micro-batches of --micro-batch-size rows, with a policy-gradient-like loss (random
per-row advantages, an entropy bonus, normalised by the step's token count). The first --warmup steps are not
measured. A measured step's time is the wall time of the `train_step` call, bracketed by
`torch.cuda.synchronize()` on a GPU: forward + backward over every micro-batch, the (single-rank) gradient
sync, clipping and the optimizer step, plus the trainer's host-side packing of the rows.

MFU is the library's `perf/mfu_train`, computed by the same function (`yatt_ray.step.perf_metrics`, formulas in
`yatt_ray.metrics.flops`): model FLOPs of the step = 3 x F_fwd (forward + backward), F_fwd = 2 N T + 4 L q P
over the step's T tokens (N matmul parameters incl. the LM head, P the causal (query, key) pairs), scaled by the
tokens the trainer reports it ran (`forward_tokens`; equal to T here); achieved = FLOPs / step time;
MFU = achieved / peak. The peak is `worker_perf_model`'s, as a worker registers it: the dense datasheet table
for the CUDA device and matmul dtype (bf16; fp32, or tf32 when torch.backends.cuda.matmul.allow_tf32), or on
a CPU a short measured matmul peak in the run's dtype with torch's threads; --peak-flops overrides it (as
`cluster.peak_flops` does). Not counted in the FLOPs: norms, RoPE, softmax, the log-prob / entropy over the
vocabulary, the optimizer (so MFU is model FLOPs utilisation, not hardware utilisation).

Reported: per measured step its time, tokens/s, achieved TFLOP/s and MFU; the medians over the measured steps;
peak memory (torch.cuda.max_memory_allocated / max_memory_reserved on a GPU, the process's peak RSS on a CPU);
load averages before and after. The last line is
    train_mfu: preset=<p> dtype=<d> mfu=<x.xxx> tokens_per_s=<n> step_s=<s> peak_source="<...>"
with the median step time, tokens/s = the step's tokens / that time, and mfu=nan when the peak is unknown (an
accelerator missing from the table: pass --peak-flops). Run it on an idle machine (`uptime`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rows: int  # default sequences per step
    length: int  # default tokens per sequence
    micro_batch_size: int  # default rows per micro-batch


PRESETS = {
    # Qwen2.5-0.5B (config.json of Qwen/Qwen2.5-0.5B): ~494M parameters, 136M of them the tied embedding
    "qwen2-0.5b": Preset(896, 24, 14, 2, 4864, 151936, 32768, rows=64, length=1024, micro_batch_size=4),
    # Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B): ~1.54B parameters, 233M of them the tied embedding
    "qwen2-1.5b": Preset(1536, 28, 12, 2, 8960, 151936, 32768, rows=64, length=1024, micro_batch_size=16),
    "tiny": Preset(64, 2, 4, 2, 176, 512, 512, rows=8, length=64, micro_batch_size=4),
}
SEED = 0


def build_model_dir(preset: Preset, out_dir: Path, dtype: torch.dtype, length: int) -> Path:
    """Write a random `Qwen2ForCausalLM` of `preset`'s shape (seed 0, weights in `dtype`) to `out_dir`: config.json
    and model.safetensors, all the trainer reads (no tokenizer)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=max(preset.max_positions, length),
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_batch(rows: int, length: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Full-length random rows (no padding): input_ids, attention_mask [rows, length], advantages [rows]."""
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, vocab, (rows, length), generator=g),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "advantages": torch.randn(rows, generator=g),
    }


def make_loss_fn(global_tokens: float, entropy_coef: float = 0.01):
    """A policy-gradient-like loss over the predicted tokens, divided by the step's token count (the library's
    convention: normalised by the global normaliser, gradients accumulate over micro-batches)."""

    def loss_fn(logp, entropy, micro):
        mask = micro["attention_mask"][:, 1:].to(logp.dtype)
        per_token = -micro["advantages"][:, None].to(logp.dtype) * logp - entropy_coef * entropy
        loss = (per_token * mask).sum() / global_tokens
        return loss, {"loss": loss.detach()}

    return loss_fn


def init_world() -> bool:
    """A one-process world (in-memory store); False when one exists already (the caller then leaves it)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def close_world() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def micro_batching(args: argparse.Namespace) -> dict:
    """`train_step`'s micro-batch arguments: a token budget (--max-tokens) or rows (--micro-batch-size)."""
    if args.max_tokens:
        return {"max_tokens_per_micro_batch": args.max_tokens}
    return {"micro_batch_size": args.micro_batch_size}


def profile_step(policy, batch: dict, loss_fn, args: argparse.Namespace) -> None:
    """One more `train_step` under torch.profiler: its wall time, the time the device ran kernels (on a GPU; the
    rest of the wall time it waited for the host: launches, Python, syncs; and the host syncs of one step more,
    `count_host_syncs`), and the top `args.profile` ops by self time on the device (GPU), then on the host."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        policy.train_step(batch, loss_fn, **micro_batching(args))
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    line = f"\nprofiled step: {wall:.3f} s wall"
    if cuda:  # the kernels' own events (a CPU op's device time is its kernels', counted there)
        kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
        busy = sum(e.self_device_time_total for e in kernels) / 1e6
        line += f"; GPU kernels {busy:.3f} s ({busy / wall:.0%} busy; the rest it waited on the host)"
        line += f"; {count_host_syncs(policy, batch, loss_fn, args)} host syncs a step"
    print(line)
    for sort in (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]:  # host time: launches
        print(events.table(sort_by=sort, row_limit=args.profile, max_name_column_width=60), flush=True)


def count_host_syncs(policy, batch: dict, loss_fn, args: argparse.Namespace) -> int:
    """CUDA: how many times one more `train_step` made the host wait for the GPU (torch's sync debug mode warns
    at each synchronising call: a copy to the host, `.item()`, a synchronize); each stalls the launch queue."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            policy.train_step(batch, loss_fn, **micro_batching(args))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in seen)


def one_line(text: str) -> str:
    """`text` as a double-quoted token with no whitespace but single spaces and no inner quotes."""
    return '"' + " ".join(text.replace('"', "'").split()) + '"'


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-0.5b")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--rows", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="rows per micro-batch (preset's)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="fill micro-batches by this token budget instead (the trainer's max_tokens_per_micro_batch)",
    )
    p.add_argument("--steps", type=int, default=6, help="measured steps")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps before them")
    p.add_argument("--peak-flops", type=float, default=None, help="peak FLOP/s of the device (override)")
    p.add_argument("--out", default=None, help="directory for the model (default: a temp dir, removed)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="then one more step under torch.profiler: top N ops",
    )
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.rows = args.rows or preset.rows
    args.length = args.length or preset.length
    args.micro_batch_size = args.micro_batch_size or preset.micro_batch_size
    if args.steps < 1 or args.warmup < 0 or args.rows < 1 or args.length < 2 or args.micro_batch_size < 1:
        p.error("need --steps >= 1, --warmup >= 0, --rows >= 1, --length >= 2, --micro-batch-size >= 1")
    if args.max_tokens is not None and args.max_tokens < args.length:
        p.error(f"--max-tokens {args.max_tokens} is below one row's {args.length} tokens")
    if args.peak_flops is not None and args.peak_flops <= 0:
        p.error("--peak-flops must be > 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.out is None:
        with tempfile.TemporaryDirectory(prefix="bench_train_mfu_") as tmp:
            return run(args, Path(tmp) / "model")
    return run(args, Path(args.out))


def run(args: argparse.Namespace, model_dir: Path) -> dict:
    from yatt_ray.config import AlgoConfig
    from yatt_ray.host_memory import cpu_env
    from yatt_ray.metrics.flops import causal_pairs
    from yatt_ray.step import perf_metrics
    from yatt_ray.train.kernel_timing import worker_perf_model
    from yatt_ray.train.policy import MegatronPolicy

    os.environ.update(cpu_env())  # as in the library's workers, before the first GEMM
    preset = PRESETS[args.preset]
    torch_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cuda = torch.cuda.is_available()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)

    start = time.perf_counter()
    build_model_dir(preset, model_dir, torch_dtype, args.length)
    built_s = time.perf_counter() - start
    owned = init_world()
    try:
        start = time.perf_counter()
        policy = MegatronPolicy(model_dir, dtype=args.dtype, lr=1e-5, seed=SEED)
        policy_s = time.perf_counter() - start
        threads = torch.get_num_threads()
        perf = worker_perf_model(policy.shape, threads, args.peak_flops, torch_dtype)
        if args.peak_flops is not None:
            perf = dataclasses.replace(perf, peak_source="--peak-flops")
        params = sum(p.numel() for p in policy.model.parameters())
        device = torch.cuda.get_device_name() if cuda else f"CPU, {threads} torch thread(s)"
        print(
            f"model: {args.preset} ({params / 1e6:.1f}M parameters, {perf.flops.matmul_params / 1e6:.1f}M "
            f"in matmuls), {args.dtype}, on {device}; HF dir written in {built_s:.1f} s, trainer built in "
            f"{policy_s:.1f} s"
        )
        print(
            f"step: {args.rows} rows x {args.length} tokens, micro-batches of "
            f"{f'{args.max_tokens} tokens at most' if args.max_tokens else f'{args.micro_batch_size} rows'}; "
            f"{args.warmup} warm-up + {args.steps} measured steps"
        )
        peak_text = f"{perf.peak_flops / 1e12:.3f} TFLOP/s" if perf.peak_flops else "unknown"
        print(f"peak: {peak_text} ({perf.peak_source})\n", flush=True)

        tokens = args.rows * args.length
        lengths = torch.full((args.rows,), args.length)
        sums = {"prompt_tokens": 0.0, "response_tokens": float(tokens), "causal_pairs": causal_pairs(lengths)}
        loss_fn = make_loss_fn(float(args.rows * (args.length - 1)))
        algo = AlgoConfig()  # ppo_epochs = ppo_mini_batches = 1: one optimizer step per measured step
        rows = []
        header = f"{'step':>4} {'seconds':>9} {'tokens/s':>11} {'TFLOP/s':>9} {'MFU':>7} {'grad_norm':>10} {'loss':>10}"
        print(header)
        for step in range(args.warmup + args.steps):
            batch = make_batch(args.rows, args.length, preset.vocab_size, seed=SEED + step)
            sync()
            start = time.perf_counter()
            out = policy.train_step(batch, loss_fn, **micro_batching(args))
            sync()
            seconds = time.perf_counter() - start
            perf_out = perf_metrics(perf, sums, {"train": seconds}, out, algo, workers=1)
            row = {
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "flops_per_s": perf_out["perf/train_flops_per_s"],
                "mfu": perf_out.get("perf/mfu_train", float("nan")),
                "forward_tokens": out["forward_tokens"],
            }
            measured = step >= args.warmup
            if measured:
                rows.append(row)
            print(
                f"{step:>4} {seconds:>9.3f} {row['tokens_per_s']:>11.1f} {row['flops_per_s'] / 1e12:>9.4f} "
                f"{row['mfu']:>7.4f} {out['grad_norm']:>10.4f} {out['loss']:>10.5f}"
                + ("" if measured else "  (warm-up)"),
                flush=True,
            )
        if args.profile:
            profile_step(
                policy, make_batch(args.rows, args.length, preset.vocab_size, seed=SEED), loss_fn, args
            )
        if cuda:
            memory = (
                f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated, "
                f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved"
            )
        else:  # ru_maxrss is in KiB on Linux
            memory = f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    finally:
        if owned:
            close_world()

    step_s = statistics.median(r["seconds"] for r in rows)
    mfu = statistics.median(r["mfu"] for r in rows)
    tokens_per_s = tokens / step_s
    flops_per_s = statistics.median(r["flops_per_s"] for r in rows)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print(f"bench_train_mfu: medians over {len(rows)} measured steps")
    print(f"  step time          {step_s:10.4f} s")
    print(f"  tokens/s           {tokens_per_s:10.1f}  ({tokens} tokens a step)")
    print(f"  model TFLOP/s      {flops_per_s / 1e12:10.4f}  (train FLOPs = 3 x forward)")
    print(f"  peak TFLOP/s       {(perf.peak_flops or float('nan')) / 1e12:10.4f}  ({perf.peak_source})")
    print(f"  MFU                {mfu:10.4f}")
    print(f"  {memory}")
    summary = {
        "preset": args.preset,
        "dtype": args.dtype,
        "mfu": mfu,
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "peak_flops": perf.peak_flops,
        "peak_source": perf.peak_source,
        "steps": rows,
    }
    print(
        f"train_mfu: preset={args.preset} dtype={args.dtype} mfu={mfu:.3f} tokens_per_s={tokens_per_s:.0f} "
        f"step_s={step_s:.4f} peak_source={one_line(perf.peak_source)}",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
