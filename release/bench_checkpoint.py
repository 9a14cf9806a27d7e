"""How long a checkpoint holds the training loop: synchronous save vs the async writer's blocking snapshot.

    python release/bench_checkpoint.py                 # demo model + a ~100M-parameter Llama, 3 repeats each
    python release/bench_checkpoint.py --repeats 5 --root /mnt/fast/tmp

The model and optimizer live on the GPU when there is one (`--device`), so the snapshot is a device-to-host
copy into pinned memory; on a CPU-only machine it is a host memcpy.

For each model (a Llama-style `LlamaForCausalLM` with its AdamW state after one step: parameters + 2x for
the moments) it measures, into a temporary local directory:

* sync:      `AsyncCheckpointWriter.save_sync` (serialise + write + checksum + commit, in the caller's thread);
* blocking:  the time `AsyncCheckpointWriter.save` holds the caller (the snapshot to host memory);
* ratio:     blocking / sync (target: under 20%);
* write:     the async save's background write (serialise + write + checksum + commit).

Figures are medians over the repeats. The first async save also allocates its host staging buffers (later
saves reuse them), so it is reported separately as "cold".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from yatt_ray.checkpoint import AsyncCheckpointWriter, CheckpointStore


@dataclass(frozen=True)
class Size:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


def sizes() -> list[Size]:
    from yatt_ray.models.tiny import TinyModelSpec

    tiny = TinyModelSpec()
    return [
        Size(
            "demo (TinyModelSpec)",
            tiny.hidden_size,
            tiny.intermediate_size,
            tiny.num_layers,
            tiny.num_heads,
            tiny.num_kv_heads,
            tiny.vocab_size,
        ),
        Size("~100M (768 x 12 layers)", 768, 2048, 12, 12, 12, 8192),
    ]


def training_state(size: Size, device: str) -> dict[str, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, size.vocab, (1, 16), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "progress": {"step": 1, "epoch": 0, "prompt_offset": 0},
    }


def n_bytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(n_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(n_bytes(v) for v in obj)
    return 0


def bench(size: Size, repeats: int, root: str | None, device: str) -> None:
    state = training_state(size, device)
    params = sum(t.numel() for t in state["model"].values())  # type: ignore[union-attr]
    gib = n_bytes(state) / 2**30
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        writer = AsyncCheckpointWriter(CheckpointStore(tmp, keep_last=2))
        sync, blocking, write = [], [], []
        cold = 0.0
        step = 0
        for i in range(repeats + 1):
            step += 1
            start = time.perf_counter()
            writer.save_sync(step, state)
            sync_s = time.perf_counter() - start
            step += 1
            handle = writer.save(step, state)
            handle.result(timeout=600)
            if i == 0:
                cold = handle.blocking_s  # allocates the staging buffers
                continue
            sync.append(sync_s)
            blocking.append(handle.blocking_s)
            write.append(handle.write_s)
        writer.close()
    s, b, w = (statistics.median(x) for x in (sync, blocking, write))
    print(
        f"{size.name:<26} params {params / 1e6:7.1f}M  state {gib:6.3f} GiB | sync {s:7.3f}s | "
        f"blocking {b:7.3f}s (cold {cold:.3f}s) | ratio {b / s:6.1%} | background write {w:7.3f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="measured repeats per model (after one cold)")
    parser.add_argument(
        "--root", default=None, help="directory for the temporary checkpoints (default: $TMPDIR)"
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the model lives"
    )
    args = parser.parse_args()
    print(
        f"bench_checkpoint: torch {torch.__version__}, model on {args.device}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} (+1 cold)"
    )
    for size in sizes():
        bench(size, args.repeats, args.root, args.device)


if __name__ == "__main__":
    main()
