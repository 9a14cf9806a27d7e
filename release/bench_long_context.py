"""Memory and time of one forward + backward over a long packed group: the dense attention path against the
packed (fused) one.

    python release/bench_long_context.py                       # samples of 512, 1024, 2048 tokens
    python release/bench_long_context.py --lengths 256 512 --samples 4

What runs: a random 25.3M-parameter Qwen2-shaped Megatron model (hidden 512, 6 layers, 8 query / 2 key-value
heads of 64, MLP 1408, q/k/v biases, vocabulary 8192, untied), fp32, one process, built by the trainer's own
`build_gpt_model`. The input is one group: a prompt of --prompt tokens and --samples responses of L tokens each
(different tokens per sample, so only the prompt is shared), packed by `pack_shared_prefix` as the trainer packs
a prompt's samples. One forward + backward of the library's loss shape: per-token log-probs and entropies of
the targets (the trainer's `head_logprobs_and_entropy` from the hidden states), a weighted sum, `backward()`.

The two paths:
  - dense (the trainer until this round): Megatron's unfused `DotProductAttention` over the packed rows'
    [G, 1, P, P] mask, the group split into sub-groups of at most max(2 T, 512) packed tokens (T = prompt + L,
    the padded width; the old cap), and log-probs through a float32 log_softmax over the whole [P, V] logits;
  - packed (now): `attention="packed"` (a fused causal kernel per [prompt; sample] sequence, no P x P tensor),
    the whole group one packed row, log-probs in chunks from the hidden states (no [P, V] logits).

Each (path, L) runs in a fresh process, after a small warm-up forward + backward. Peak memory is the peak
resident set during the measured forward + backward less the resident set just before it (on a GPU,
torch.cuda.max_memory_allocated less the allocation before). A run that would not fit is stopped by an address-
space limit (this machine's available memory at the start, less 2 GiB) and reported as "oom". The old path's
score tensors grow with the square of the packed length: at L = 2048 that is ~2.7 GB per layer and tensor.

Last line: `long_context: mem_ratio_at_max=<old/new> time_ratio_at_max=<old/new> max_len_new=<P>`, the ratios
at the longest L both paths ran, and the packed length P of the longest group the packed path ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

SHAPE = dict(
    vocab_size=8192, hidden_size=512, ffn_hidden_size=1408, num_layers=6, num_heads=8, num_kv_heads=2,
    head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, max_positions=65536, tie_word_embeddings=False,
    family="qwen2", qkv_bias=True,
)  # fmt: skip


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def group(prompt: int, samples: int, length: int, vocab: int, seed: int = 0):
    """One prompt and `samples` responses of `length` tokens: input_ids, attention_mask [samples, prompt + length]."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(2, vocab, (prompt,), generator=g)
    rows = [torch.cat([head, torch.randint(2, vocab, (length,), generator=g)]) for _ in range(samples)]
    ids = torch.stack(rows)
    return ids, torch.ones_like(ids)


def reference_logprobs(logits: torch.Tensor, targets: torch.Tensor):
    """The unchunked form: a float32 log_softmax over [G, P, V]."""
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def one_pass(model, path: str, ids: torch.Tensor, mask: torch.Tensor) -> None:
    from yatt_ray.train.logprobs import head_logprobs_and_entropy
    from yatt_ray.train.model import forward_packed, hidden_state_output, output_weight
    from yatt_ray.train.packing import pack_shared_prefix

    cap = max(2 * ids.shape[1], 512) if path == "dense" else None
    packed = pack_shared_prefix(ids, mask, ids.shape[0], max_len=cap)
    if path == "dense":
        logp, entropy = reference_logprobs(forward_packed(model, packed), packed.targets)
    else:
        hidden_state_output(model)  # as the trainer's policy: hidden states out, no logits
        logp, entropy = head_logprobs_and_entropy(
            forward_packed(model, packed), output_weight(model), packed.targets
        )
    real = (packed.segment >= 0).float()
    ((logp - 0.01 * entropy) * real).sum().backward()


def child(path: str, prompt: int, samples: int, length: int) -> dict:
    """One measurement in this (fresh) process."""
    import torch.distributed as dist

    from yatt_ray.model_shape import LlamaShape
    from yatt_ray.train import build_gpt_model, init_parallel_state, seed_everything

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_parallel_state(1)
    seed_everything(0)
    model = build_gpt_model(LlamaShape(**SHAPE), attention=path)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    one_pass(model, path, *group(16, 2, 16, SHAPE["vocab_size"]))  # warm-up
    model.zero_grad(set_to_none=True)
    ids, mask = group(prompt, samples, length, SHAPE["vocab_size"])
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    with open("/proc/self/statm") as f:
        virtual = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    budget = virtual + max(available - 2 * 2**30, 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (budget, budget))
    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if cuda else rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        one_pass(model, path, ids, mask)
    except (RuntimeError, MemoryError) as error:
        if "memory" not in str(error).lower() and not isinstance(error, MemoryError):
            raise
        return {"path": path, "length": length, "oom": True}
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    packed_len = prompt - 1 + samples * (length + 1)
    return {
        "path": path, "length": length, "packed": packed_len, "seconds": seconds,
        "peak_gib": (peak - before) / 2**30, "oom": False,
    }  # fmt: skip


def measure(path: str, prompt: int, samples: int, length: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--prompt", str(prompt), "--samples", str(samples),
           "--lengths", str(length)]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": path, "length": length, "oom": False, "timeout": True}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        if out.returncode < 0 or "memory" in out.stderr.lower():
            return {"path": path, "length": length, "oom": True}
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--timeout", type=float, default=900, help="seconds for one (path, length) run")
    p.add_argument("--child", choices=("dense", "packed"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.prompt, args.samples, args.lengths[0])), flush=True)
        return
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(f"group: prompt {args.prompt} + {args.samples} samples of L tokens; 25.3M Qwen2-shaped model, fp32")
    print(f"{'L':>6} {'packed P':>9} {'path':>7} {'seconds':>9} {'peak GiB':>9}")
    results: dict[tuple[str, int], dict] = {}
    for length in args.lengths:
        for path in ("dense", "packed"):
            r = measure(path, args.prompt, args.samples, length, args.timeout)
            results[path, length] = r
            packed = args.prompt - 1 + args.samples * (length + 1)
            status = "oom" if r.get("oom") else "timeout" if r.get("timeout") else None
            figures = f"{status:>9} {'':>9}" if status else f"{r['seconds']:>9.2f} {r['peak_gib']:>9.3f}"
            print(f"{length:>6} {packed:>9} {path:>7} {figures}", flush=True)
    both = [n for n in args.lengths if "seconds" in results["dense", n] and "seconds" in results["packed", n]]
    ran = [results["packed", n]["packed"] for n in args.lengths if "seconds" in results["packed", n]]
    new = [
        results["packed", n]["peak_gib"] / results["packed", n]["packed"]
        for n in args.lengths
        if "seconds" in results["packed", n]
    ]
    if len(new) > 1:
        print(
            f"packed path: peak GiB per 1k packed tokens {' '.join(f'{1024 * x:.3f}' for x in new)} (flat = linear in P)"
        )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if both:
        at = max(both)
        old, cur = results["dense", at], results["packed", at]
        mem, speed = old["peak_gib"] / cur["peak_gib"], old["seconds"] / cur["seconds"]
        print(f"ratios at L = {at} (the longest both ran)")
    else:
        mem = speed = float("nan")
    print(
        f"long_context: mem_ratio_at_max={mem:.2f} time_ratio_at_max={speed:.2f} max_len_new={max(ran, default=0)}"
    )


if __name__ == "__main__":
    main()
