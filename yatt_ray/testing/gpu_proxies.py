"""What a GPU step would cost, counted on the CPU: kernel launches per layer, host syncs per step, the log-probs'
peak memory (`release/bench_gpu_ready.py` prints them; tests bound them).

- Kernel-launching ops: every op that reaches a backend (below autograd, so the backward's ops too), except
  those that only make a view or an uninitialised buffer (no kernel runs on a GPU for them). An operator is
  counted once however its backend carries it out: the library's own operators (`yatt_ray::rms_norm`,
  `yatt_ray::varlen_attention` and their backwards) are one fused kernel each on CUDA and a few kernels on
  the CPU, as torch's own fused operators are.
- Host syncs: ops that make the host wait for a GPU's result: `.item()` (and `if tensor`, `float(tensor)`:
  `_local_scalar_dense`), `nonzero` (and `torch.where(mask)`), boolean-mask indexing (`x[mask]`, `x[mask] = v`),
  `masked_select`, `unique`, and copies from a GPU to the host (`_to_copy` / `copy_` to the CPU), counted when
  they read a value computed on the device. On the CPU every tensor is a host tensor, so "on the device" is
  followed from seeds (the weights, their gradient buffers, the optimizer's state): an op with an input on the
  device puts its outputs there. The host-side packing's own index work is not counted (on a GPU it stays on
  the host); values uploaded to the device and read back without touching a weight are missed, and a
  `.tolist()` / `.numpy()` of a device value is seen only on a GPU: a floor for those. Host-to-device copies
  are not seen either (a CPU's `.to("cpu")` dispatches nothing); a blocking one waits for the GPU, which is why
  the trainer's go pinned and non-blocking (`train.micro_batches.to_device`).
- The log-probs' peak is measured with fake tensors (`FakeTensorMode`: shapes and dtypes, no data) and torch's
  `MemTracker`, at a GPU's chunk size: the peak of one forward + backward less what any form of the loss holds
  (the hidden states, the output weight and their gradients).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

# no kernel runs for these: uninitialised buffers, and `_unsafe_view` (a view that autograd records as a copy)
NO_KERNEL = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "set_", "_unsafe_view"
}  # fmt: skip
HOST_READS = ("tolist", "numpy", "cpu")  # a device value read on the host (a GPU's copy back, then its wait)
SYNCS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
}


class OpCounter(TorchDispatchMode):
    """Counts the kernel-launching ops and the host syncs dispatched while active (`ops`, `syncs`: op name ->
    count); `on_device`: the seed tensors that live on the device (see the module docstring)."""

    def __init__(self, on_device: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.device = WeakIdKeyDictionary({t: True for t in on_device})
        self._methods: dict[str, object] = {}

    def __enter__(self):
        # on a CPU these read a host tensor's memory without dispatching an op: watched here instead
        for name in HOST_READS:
            real = self._methods[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._watched(name, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._methods.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)

    def _watched(self, name: str, real):
        def read(tensor, *args, **kwargs):
            if tensor in self.device:
                self.syncs[name] += 1
            return real(tensor, *args, **kwargs)

        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        returns = func._schema.returns
        view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        if not view and name not in NO_KERNEL:
            self.ops[name] += 1
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(t in self.device for t in inputs)
        to_host = name in ("_to_copy", "copy_") and str(kwargs.get("device", "")) == "cpu"
        if on_device and (name in SYNCS or to_host or _boolean_mask(name, args)):
            self.syncs[name] += 1
        out = func(*args, **kwargs)
        if on_device and not to_host:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device[t] = True
        return out


def _boolean_mask(name: str, args) -> bool:
    """`x[mask]` / `x[mask] = v`: on a GPU the mask's true positions are counted on the host first (a sync; the
    CPU's kernel takes the mask directly, so no `nonzero` is dispatched here)."""
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_") or len(args) < 2:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def device_state(policy) -> list[torch.Tensor]:
    """The tensors a trainer keeps on its device: weights, gradient buffers, optimizer state."""
    params = list(policy.model.parameters())
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    return params + grads + policy.optimizer.tensors()


def logprob_peak_mib(tokens: int, hidden: int, vocab: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """MiB the log-probs and entropy of `tokens` positions add at their peak (forward + backward, GPU chunking),
    beyond the hidden states [tokens, hidden], the output weight [vocab, hidden] and their gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    import yatt_ray.train.logprobs as lp

    cpu_chunk, lp.CHUNK_ELEMENTS = lp.CHUNK_ELEMENTS, lp.CUDA_CHUNK_ELEMENTS  # the GPU's chunks
    try:
        with FakeTensorMode():
            h = torch.empty(tokens, hidden, dtype=dtype, requires_grad=True)
            w = torch.empty(vocab, hidden, dtype=dtype, requires_grad=True)
            targets = torch.zeros(tokens, dtype=torch.long)
            tracker = MemTracker()
            with tracker:
                logp, entropy = lp.head_logprobs_and_entropy(h, w, targets)
                (logp.sum() + entropy.sum()).backward()
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        lp.CHUNK_ELEMENTS = cpu_chunk
    total = sum(v["Total"] for v in peak.values())
    held = 2 * (h.numel() + w.numel()) * h.element_size()  # inputs and their gradients
    return (total - held) / 2**20


def qwen2_dir(out: Path, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> Path:
    """A random Qwen2 (tied embeddings, q/k/v biases) of this shape written to `out` (config.json + weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def grpo_micro_batch(tokens: int, vocab: int, group: int = 8, prompt: int = 256, seed: int = 0) -> dict:
    """A GRPO micro-batch of about `tokens` real tokens in the trainer's layout (`batch.pack`: prompts left-padded,
    responses right-padded): groups of `group` samples sharing a `prompt`-token prompt, response lengths
    long-tailed (most short, a few near the longest), per-token advantages and a row index, as the controller
    hands `RolloutBatch.tensors()` to the trainer."""
    from yatt_ray.batch import pack

    g = torch.Generator().manual_seed(seed)
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    longest = max(64, tokens // (2 * group))
    while sum(map(len, prompts)) + sum(map(len, responses)) < tokens:
        head = torch.randint(2, vocab, (prompt,), generator=g).tolist()
        for _ in range(group):
            length = int(longest * min(1.0, 0.1 + torch.rand(1, generator=g).item() ** 3))
            prompts.append(head)
            responses.append(torch.randint(2, vocab, (length,), generator=g).tolist())
    rollout = pack(prompts, responses, [[0.0] * len(r) for r in responses], pad_id=0, group_size=group)
    tensors = rollout.tensors()
    mask = tensors["response_mask"]
    tensors["advantages"] = torch.randn(len(prompts), 1, generator=g).expand_as(mask) * mask
    tensors["row"] = torch.arange(len(prompts))
    return {"batch": tensors, "prompt_width": rollout.prompt_width, "group": group}


def grpo_loss(micro: dict):
    """The library's GRPO loss (`step.policy_loss_fn`, default algorithm settings, on-policy: the old log-probs
    are this forward's, recorded for the step's metrics) over `micro`'s whole batch."""
    from yatt_ray.config import AlgoConfig
    from yatt_ray.step import policy_loss_fn

    mask = micro["batch"]["response_mask"]
    return policy_loss_fn(
        AlgoConfig(), micro["prompt_width"], float(mask.sum()), float(len(mask)), kl_coef=0.0,
        norm_len=mask.shape[1], record_old_logp=torch.zeros(mask.shape),  # as the controller: on the device
    )  # fmt: skip


def gpu_kernels():
    """The kernel choice whose code path is a GPU's: Megatron's own linear layers (not the CPU's oneDNN route,
    `cpu_shims.OneDnnLinear`), grouped-query attention in the kernel, no whole masked rows."""
    from yatt_ray.train.kernels import KernelChoice

    return KernelChoice(linear="mkl", threads=torch.get_num_threads(), gqa="native", dense_rows=0, rates={})


def micro_batch_counts(policy, micro: dict) -> OpCounter:
    """The ops of one micro-batch's forward and backward through the trainer's own forward and GRPO loss, on
    the GPU's code path (`gpu_kernels`)."""
    from yatt_ray.train.kernels import kernels_in_effect

    counter = OpCounter()
    batch = micro["batch"]
    policy.model.train()
    with kernels_in_effect(gpu_kernels()), counter:
        logp, entropy = policy._forward(
            policy.model, batch["input_ids"], batch["attention_mask"], micro["group"]
        )
        on_device = {k: v.to(policy.device) for k, v in batch.items()}
        loss, _ = grpo_loss(micro)(logp, entropy, on_device)
        loss.backward()
    policy.model.zero_grad_buffer()
    return counter


def step_syncs(policy, micro: dict, micro_batch_size: int) -> OpCounter:
    """The host syncs (and ops) of one whole `train_step` over `micro`'s batch (micro-batches, grad sync,
    clipping, the optimizer, the metrics) with the library's GRPO loss."""
    from yatt_ray.train.kernels import kernels_in_effect

    counter = OpCounter(device_state(policy))
    with kernels_in_effect(gpu_kernels()), counter:
        policy.train_step(
            micro["batch"], grpo_loss(micro), micro_batch_size=micro_batch_size, group_size=micro["group"]
        )
    return counter


def fits_7b(tmp: Path) -> tuple[bool, dict]:
    """Whether GRPO with Qwen2.5-7B-Instruct on 8 x H100 80 GB (examples/configs/grpo_qwen7b_gsm8k.yaml: 8k-token
    micro-batches, a reference model, vLLM engines) passes the placement plan and its memory check, and the
    estimate (GiB per GPU by role)."""
    from yatt_ray.testing.recipes import plan_recipe

    try:
        return True, plan_recipe(Path("examples/configs/grpo_qwen7b_gsm8k.yaml"), tmp)
    except Exception as e:  # the plan or the memory check refused it
        return False, {"error": json.dumps(str(e))}
