"""`MegatronPolicy`: the per-worker trainer (log-probs, a training step, HF export, offload).

One instance lives in every training worker. Tensor-parallel ranks of one data-parallel group must call every
method with the same arguments (the group's controller broadcasts the batch); most methods are collectives.

Gradient convention (shared with `MegatronCritic`, see `trainer_base`): `loss_fn` already divides by the GLOBAL
normaliser (e.g. the response tokens of the whole step, over every micro-batch and every data-parallel rank).
Gradients are therefore accumulated over micro-batches and SUMMED over data-parallel ranks, never averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from yatt_ray.train.hf_convert import StateDict, megatron_to_hf
from yatt_ray.train.logprobs import token_logprobs_and_entropy
from yatt_ray.train.model import build_gpt_model, forward_packed, load_hf_weights
from yatt_ray.train.packing import pack_shared_prefix
from yatt_ray.train.trainer_base import MegatronTrainerBase, write_hf_dir

LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]


class MegatronPolicy(MegatronTrainerBase):
    """A Llama policy as a Megatron GPTModel under Megatron DDP, with plain AdamW and an optional reference.

    Args:
        model_dir: Hugging Face Llama directory (config.json, *.safetensors, tokenizer files).
        tp_size: tensor-parallel size; the world size must be a multiple of it (DP = world / tp).
        lr, weight_decay, betas: AdamW settings (no weight decay on 1-D params: the RMSNorm weights).
        grad_clip: max global grad norm (<= 0 turns clipping off; the norm is still reported).
        seed: torch and Megatron RNG seed.
        with_reference: also build a frozen copy of the initial weights for reference log-probs.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tp_size: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        seed: int = 0,
        with_reference: bool = False,
    ):
        super().__init__(model_dir, tp_size, lr, weight_decay, betas, grad_clip, seed)
        self.reference = self._build_model().eval().requires_grad_(False) if with_reference else None

    def _build_model(self) -> torch.nn.Module:
        model = build_gpt_model(self.shape)
        load_hf_weights(model, self.model_dir, self.shape)
        return model

    def _frozen_modules(self) -> list[torch.nn.Module]:
        return [] if self.reference is None else [self.reference]

    # ---- forward ------------------------------------------------------------------------------------------

    def _forward(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int):
        """input_ids, attention_mask [B, T] -> (logp, entropy) [B, T-1]; column t predicts token t+1.

        Runs on the shared-prefix packing of `group_size` consecutive rows (`packing`): a group's prompt once.
        """
        packed = pack_shared_prefix(input_ids, attention_mask, group_size).to(self.device)
        self.forward_tokens += packed.tokens
        logits = forward_packed(model, packed)  # [G, L, V/tp]
        logp, entropy = token_logprobs_and_entropy(logits, packed.targets, self.tp_group)
        return packed.unpack(logp), packed.unpack(entropy)

    @torch.no_grad()
    def log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        micro_batch_size: int | None = None,
        reference: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        group_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(input_ids[:, t+1] | input_ids[:, :t+1]) and entropy, each [B, T-1] float32 (CPU).

        attention_mask [B, T]: 1 = real token; left or right padding. Columns whose next token is padding are 0.
        Micro-batches: `micro_batch_size` rows each, or at most `max_tokens_per_micro_batch` (rows x longest
        real length) when that is given; rows come back in their original order either way. `group_size`
        consecutive rows (a prompt's samples) are packed together, their common prefix computed once.
        `reference=True` uses the frozen reference model (built with `with_reference=True`). Call `onload()`
        first if the weights were offloaded.
        """
        if reference and self.reference is None:
            raise RuntimeError("reference log-probs need MegatronPolicy(..., with_reference=True)")
        model = self.reference if reference else self.model
        assert model is not None
        logp, entropy = self._map_rows(
            model,
            input_ids,
            attention_mask,
            micro_batch_size,
            max_tokens_per_micro_batch,
            lambda ids, mask: self._forward(model, ids, mask, group_size),
            group_size,
        )
        return logp, entropy

    # ---- training -----------------------------------------------------------------------------------------

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        loss_fn: LossFn,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        group_size: int = 1,
    ) -> dict:
        """One optimizer step over `batch` (rows split into micro-batches; gradients accumulate).

        batch: at least input_ids [B, T] and attention_mask [B, T]; every tensor with B rows is sliced per
        micro-batch (and moved to the model's device), other values are passed whole.
        loss_fn(logp [b, T-1], entropy [b, T-1], micro_batch) -> (loss scalar, metrics {name: float or 0-d
        tensor}), normalised by the global normaliser. Micro-batches as in `log_probs`.
        Returns {"grad_norm", "lr", **metrics}; metrics are summed over micro-batches and data-parallel
        ranks (so a metric normalised like the loss adds up to its whole-step value).
        """

        def micro_loss(micro: dict) -> tuple[torch.Tensor, dict]:
            logp, entropy = self._forward(self.model, micro["input_ids"], micro["attention_mask"], group_size)
            return loss_fn(logp, entropy, micro)

        return self._train_step(batch, micro_batch_size, max_tokens_per_micro_batch, micro_loss, group_size)

    # ---- export -------------------------------------------------------------------------------------------

    def hf_state_dict(self) -> StateDict | None:
        """Full HF-named weights gathered over the TP group (every TP rank must call); None off TP rank 0."""
        shards = self._gather_tp_shards()
        return None if shards is None else megatron_to_hf(shards, self.shape)

    def iter_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Gather now (collective, every TP rank), then yield [(hf_name, tensor)] lists of <= ~bucket_bytes.

        A tensor larger than bucket_bytes gets a bucket of its own. Non-zero TP ranks get an empty iterator.
        """
        sd = self.hf_state_dict()
        return iter(()) if sd is None else _buckets(sd, bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """Write config + model.safetensors + tokenizer files (collective); the writer is TP 0 of DP 0.

        Returns the directory on the writing rank, None elsewhere.
        """
        sd = self.hf_state_dict()
        if sd is None or not self._is_writer():
            return None
        return write_hf_dir(self.model_dir, out_dir, sd)


def _buckets(sd: StateDict, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
