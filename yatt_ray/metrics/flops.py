"""Model FLOPs of a step and the accelerator's peak: what MFU (model FLOPs utilisation) is made of.

Model FLOPs count the matrix multiplications a Llama-style decoder needs, from its shape alone (PaLM's
appendix B convention; norms, rotary embeddings, softmax and the embedding lookup are left out):

    N      = L (2 h q + 2 h kv + 3 h f) + h V      matmul parameters: q/k/v/o and gate/up/down per layer,
                                                    the LM head (an input embedding is a lookup, not a matmul)
    F_fwd  = 2 N T + 4 L q P                        one forward pass over sequences of T tokens in all
    P      = sum over sequences of t (t + 1) / 2    (query, key) pairs a causal attention scores
    F_train = 3 F_fwd                               forward + backward (twice the forward)

with L layers, h the hidden size, q = heads x head_dim, kv = kv_heads x head_dim, f the MLP width, V the
vocabulary. Per token the attention term is 4 L q c, c the mean number of positions a token attends to
(the "4 x layers x hidden x context" of the usual estimate). A rollout costs one forward pass over each
group's prompt, once however many samples share it, and over every sample's response attending to it (prefill
plus decode with a KV cache; `shared_prompt_work`): the model FLOPs the step needs, so an engine that prefills
a shared prompt once per sample does work it is not credited with and an MFU over 1 cannot arise from the
count. Training costs `3 F_fwd` per pass over the batch.

MFU = achieved model FLOP/s per accelerator / the accelerator's peak. The peak comes from
`cluster.peak_flops` when set, else the table below (dense, no sparsity, by device and dtype), else on the CPU
from a short fp32 matmul timing with the worker's threads (`train.kernel_timing.measure_matmul_flops`: the
physical limit of the box, so the headroom is visible; `worker_perf_model` there picks among the three).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Peak dense FLOP/s per accelerator, by dtype (vendor datasheets; tf32 = fp32 matmuls on tensor cores).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}
# torch.cuda.get_device_name() -> table row; first match wins ("NVIDIA H100 80GB HBM3" is the SXM part)
_DEVICE_PATTERNS = (
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100", "H100 SXM"),
    (r"H200", "H200"),
    (r"A100", "A100"),
    (r"\bL4\b", "L4"),
    (r"V100", "V100"),
)


@dataclass(frozen=True)
class ModelFlops:
    """The sizes that set a decoder's FLOPs (see the module docstring for the formulas)."""

    matmul_params: int  # N
    layers: int  # L
    attn_width: int  # q = heads x head_dim

    @classmethod
    def from_shape(cls, shape) -> ModelFlops:
        """From a `yatt_ray.model_shape.LlamaShape`."""
        from yatt_ray.model_shape import linear_shapes

        per_layer = sum(k_in * n_out for k_in, n_out in linear_shapes(shape))  # q/k/v, output, MLP in and out
        h, L = shape.hidden_size, shape.num_layers
        return cls(
            matmul_params=L * per_layer + h * shape.vocab_size,
            layers=L,
            attn_width=shape.num_heads * shape.head_dim,
        )

    def forward(self, tokens: float, causal_pairs: float) -> float:
        """F_fwd = 2 N T + 4 L q P for T tokens whose sequences hold P causal (query, key) pairs."""
        return 2.0 * self.matmul_params * tokens + 4.0 * self.layers * self.attn_width * causal_pairs


def causal_pairs(lengths: torch.Tensor) -> float:
    """P = sum of t (t + 1) / 2 over the sequence lengths t (the pairs a causal attention scores)."""
    t = lengths.to(torch.float64)
    return float((t * (t + 1) / 2).sum())


def shared_prompt_work(
    prompt_lengths: torch.Tensor, lengths: torch.Tensor, group_size: int
) -> tuple[float, float]:
    """(T, P) of a batch whose `group_size` consecutive rows share one prompt, the prompt counted once a group.

    prompt_lengths, lengths: [N] tokens of each row's prompt and of the whole row (prompt + response). With p a
    group's prompt length and r_i = t_i - p its samples' response lengths:

        T = sum over groups of (p + sum_i r_i)
        P = sum over groups of (p (p + 1) / 2 + sum_i (r_i p + r_i (r_i + 1) / 2))

    (response token j of a sample attends to the p prompt positions and to j response positions).
    """
    if len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} rows are not whole groups of group_size={group_size}")
    p_rows, t = prompt_lengths.to(torch.float64), lengths.to(torch.float64)
    r = t - p_rows
    p = p_rows[::group_size]
    tokens = p.sum() + r.sum()
    pairs = (p * (p + 1) / 2).sum() + (r * p_rows + r * (r + 1) / 2).sum()
    return float(tokens), float(pairs)


@dataclass(frozen=True)
class PerfModel:
    """What a worker knows to turn a step's tokens into MFU: its model's FLOPs and its accelerator's peak
    FLOP/s (None when unknown: achieved FLOP/s are reported without MFU); `peak_source` says where it came from."""

    flops: ModelFlops
    peak_flops: float | None
    peak_source: str


_REGISTERED: list[PerfModel] = []  # this process's model (one worker per process), set by `roles.build_roles`


def register_perf_model(model: PerfModel | None) -> None:
    """Set (or with None clear) this process's PerfModel, which `step.reduce_metrics` reads."""
    _REGISTERED.clear()
    if model is not None:
        _REGISTERED.append(model)


def registered_perf_model() -> PerfModel | None:
    return _REGISTERED[0] if _REGISTERED else None


def table_peak(device_name: str, dtype: str) -> float | None:
    """The table's peak FLOP/s for a CUDA device name ("NVIDIA A100-SXM4-80GB") and dtype key, else None."""
    for pattern, row in _DEVICE_PATTERNS:
        if re.search(pattern, device_name):
            return PEAK_FLOPS[row].get(dtype)
    return None


def cuda_matmul_dtype(dtype: torch.dtype) -> str:
    """The table's dtype key for matmuls in `dtype` on CUDA (fp32 runs on tensor cores as tf32 when allowed)."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
