"""`MegatronCritic`: the PPO value model, a Llama trunk (Megatron `GPTModel`) with a scalar value head.

Alignment (the same columns as `MegatronPolicy.log_probs`): for input_ids [B, T], values [B, T-1] with
values[:, t] = V(state after tokens 0..t) = head(final-norm hidden state at token t), the state from which token
t+1 is generated. Columns whose next token is padding are 0; left and right padding give the same values (the
rows are packed first, see `packing.py`). The hidden state of the last token (nothing generated from it) is
dropped, exactly as the policy drops its logits.

Value head: `ValueHead`, a full Linear(hidden -> 1, with bias) REPLICATED on every tensor-parallel rank. It
takes the place of GPTModel's vocab-parallel `output_layer`: GPTModel.forward applies the decoder's final RMSNorm,
calls `output_layer(hidden [s, b, h], weight=..., runtime_gather_output=...)` and returns its first output
transposed to [b, s, ...], so the model's ordinary forward returns values [b, s, 1] and no Megatron internals
are called by hand. Why replicated is exact: without sequence parallelism the final-norm hidden states are the
same full tensor on every TP rank, so every rank computes the same values (TP=1 and TP=2 agree), and the
gradient w.r.t. the hidden states is the full one on every rank, which is what the row-parallel layers
before it expect (their all-reduce's backward is the identity). Its gradient is the same on every TP rank, and
the grad norm counts it once (it has no `tensor_model_parallel` flag, so it counts on TP rank 0 only).
(GPTModel first builds its [V/tp, h] output layer, which is then dropped: a transient allocation.)

Initialisation, from `model_dir`:
- a policy / plain Llama directory (no `score.weight`): trunk = its weights (any `lm_head` is ignored);
  head weight ~ N(0, head_init_std^2) with default head_init_std = 1/(hidden+1) (initial values near 0, yet
  the trunk gets gradients from the first step; 0 gives a zero head), bias 0. Drawn from a CPU generator
  seeded with `seed`, so every TP and DP rank starts from the same head.
- a saved critic (has `score.weight`): trunk and head as saved.

On-disk format (`save`): a Hugging Face `LlamaForTokenClassification` directory with one label:
config.json (the source config with architectures=["LlamaForTokenClassification"], one label),
model.safetensors = the trunk under HF names (`model.embed_tokens.weight`, `model.layers.*`, `model.norm.weight`)
+ `score.weight` [1, hidden] + `score.bias` [1], and the tokenizer files. So
`transformers.AutoModelForTokenClassification.from_pretrained(dir)(ids).logits[..., 0]` gives the same values
(before the column shift above; in eval mode, where its classifier dropout is off), and
`MegatronCritic(dir)` loads it back exactly.

Gradient convention: as `MegatronPolicy` (see `trainer_base`): loss_fn returns its share of the GLOBAL
normaliser; gradients accumulate over micro-batches and SUM over data-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from yatt_ray.errors import ConfigError
from yatt_ray.train.hf_convert import StateDict, hf_to_megatron, megatron_to_hf
from yatt_ray.train.model import (
    build_gpt_model,
    forward_packed,
    load_megatron_shard,
    model_rows,
    read_hf_state_dict,
)
from yatt_ray.train.packing import pack_shared_prefix
from yatt_ray.train.trainer_base import MegatronTrainerBase, write_hf_dir

ValueLossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]

HEAD_WEIGHT, HEAD_BIAS = "score.weight", "score.bias"  # HF LlamaForTokenClassification names
_MG_HEAD_WEIGHT, _MG_HEAD_BIAS = "output_layer.weight", "output_layer.bias"
TOKEN_CLASSIFIERS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
CRITIC_CONFIG = {
    "architectures": ["LlamaForTokenClassification"],
    "id2label": {"0": "LABEL_0"},
    "label2id": {"LABEL_0": 0},
}


class ValueHead(torch.nn.Module):
    """Linear(hidden -> 1) with bias, a drop-in for GPTModel's `output_layer` (same call, same return form).

    forward(hidden [s, b, h], weight=None, runtime_gather_output=None) -> (values [s, b, 1], None); the
    `weight` GPTModel passes for tied embeddings is ignored.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight, self.bias), None


class MegatronCritic(MegatronTrainerBase):
    """A Llama value model as a Megatron GPTModel + replicated value head, under Megatron DDP with AdamW.

    Args:
        model_dir: the policy's HF directory (trunk init, new head) or a directory written by `save`.
        tp_size: tensor-parallel size; the world size must be a multiple of it (DP = world / tp).
        lr, weight_decay, betas: AdamW settings (no weight decay on 1-D params: norm weights, head bias).
        grad_clip: max global grad norm (<= 0 turns clipping off; the norm is still reported).
        seed: torch and Megatron RNG seed; also seeds the new head's weights.
        dtype, distributed_optimizer, recompute_activations: the weights' dtype ("fp32" | "bf16"), ZeRO-1 and
            activation recomputation (see `trainer_base`).
        head_init_std: std of a new head's weights; None = 1/(hidden_size+1); 0 = zeros. Unused when
            `model_dir` holds a saved critic.
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
        dtype: str = "fp32",
        distributed_optimizer: bool = False,
        recompute_activations: bool = False,
        head_init_std: float | None = None,
    ):
        self.head_init_std = head_init_std
        super().__init__(
            model_dir,
            tp_size,
            lr,
            weight_decay,
            betas,
            grad_clip,
            seed,
            dtype,
            distributed_optimizer,
            recompute_activations,
        )

    # ---- construction -------------------------------------------------------------------------------------

    @property
    def _trunk_shape(self):
        """The shape for converting the trunk alone: tied embeddings = no LM-head weights on either side."""
        return dataclasses.replace(self.shape, tie_word_embeddings=True)

    def _build_model(self) -> torch.nn.Module:
        from megatron.core import parallel_state as ps

        shape = dataclasses.replace(self.shape, tie_word_embeddings=False)
        model = build_gpt_model(shape, self.dtype, recompute=self.recompute)
        model.output_layer = ValueHead(self.shape.hidden_size).to(
            model.embedding.word_embeddings.weight.device, self.dtype
        )
        hf_sd = read_hf_state_dict(self.model_dir)
        shard = hf_to_megatron(
            hf_sd,
            self._trunk_shape,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
        )
        weight, bias = self._head_weights(hf_sd)
        shard |= {_MG_HEAD_WEIGHT: weight, _MG_HEAD_BIAS: bias}
        load_megatron_shard(model, shard, self.model_dir)
        return model

    def _head_weights(self, hf_sd: StateDict) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.shape.hidden_size
        if HEAD_WEIGHT in hf_sd:
            weight, bias = hf_sd[HEAD_WEIGHT], hf_sd.get(HEAD_BIAS)
            if weight.shape != (1, hidden) or bias is None or bias.shape != (1,):
                raise ConfigError(
                    f"{str(self.model_dir)!r} holds {HEAD_WEIGHT} {tuple(weight.shape)} and {HEAD_BIAS} "
                    f"{None if bias is None else tuple(bias.shape)}; a critic needs [1, {hidden}] and [1] "
                    "(a LlamaForTokenClassification with one label, as MegatronCritic.save writes)."
                )
            return weight.float(), bias.float()
        std = 1.0 / (hidden + 1) if self.head_init_std is None else self.head_init_std
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randn(1, hidden, generator=gen) * std, torch.zeros(1)

    # ---- forward ------------------------------------------------------------------------------------------

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        """input_ids, attention_mask [B, T] -> values [B, T-1] float32; column t = V(state after token t).
        Shared-prefix packing of `group_size` consecutive rows, as in `MegatronPolicy`."""
        packed = pack_shared_prefix(input_ids, attention_mask, group_size)
        self.forward_tokens += packed.tokens
        rows = model_rows(self.model, packed).to(self.device)  # one flat row [1, T] (packed attention)
        values = forward_packed(self.model, rows)  # [1, T, 1] ([G, L, 1] dense)
        return rows.unpack(values[..., 0].float())

    @torch.no_grad()
    def values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        group_size: int = 1,
    ) -> torch.Tensor:
        """V(state after token t) at column t, [B, T-1] float32 (CPU), no grad.

        attention_mask [B, T]: 1 = real token; left or right padding. Columns whose next token is padding are 0.
        Micro-batches: `micro_batch_size` rows each, or at most `max_tokens_per_micro_batch` (rows x longest
        real length) when that is given; rows come back in their original order either way. Call `onload()`
        first if the weights were offloaded.
        """
        (values,) = self._map_rows(
            self.model,
            input_ids,
            attention_mask,
            micro_batch_size,
            max_tokens_per_micro_batch,
            lambda ids, mask: (self._forward(ids, mask, group_size),),
            group_size,
        )
        return values

    # ---- training -----------------------------------------------------------------------------------------

    def train_step(
        self,
        batch: dict[str, torch.Tensor],
        loss_fn: ValueLossFn,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        group_size: int = 1,
    ) -> dict:
        """One optimizer step over `batch` (rows split into micro-batches; gradients accumulate).

        batch: at least input_ids [B, T] and attention_mask [B, T] (plus e.g. returns / old values / masks);
        every tensor with B rows is sliced per micro-batch (and moved to the device), other values are passed
        whole. loss_fn(values [b, T-1] with grad, micro_batch) -> (loss scalar, metrics), the loss divided by
        the GLOBAL normaliser. Returns {"grad_norm", "lr", **metrics}, metrics summed over micro-batches and
        data-parallel ranks.
        """

        def micro_loss(micro: dict, host: dict) -> tuple[torch.Tensor, dict]:
            return loss_fn(self._forward(host["input_ids"], host["attention_mask"], group_size), micro)

        return self._train_step(batch, micro_batch_size, max_tokens_per_micro_batch, micro_loss, group_size)

    # ---- export -------------------------------------------------------------------------------------------

    def hf_state_dict(self) -> StateDict | None:
        """The critic under LlamaForTokenClassification names (collective over TP); None off TP rank 0."""
        shards = self._gather_tp_shards()
        if shards is None:
            return None
        sd = megatron_to_hf(shards, self._trunk_shape)
        sd[HEAD_WEIGHT] = shards[0][_MG_HEAD_WEIGHT].clone()
        sd[HEAD_BIAS] = shards[0][_MG_HEAD_BIAS].clone()
        return sd

    def save(self, out_dir: str | Path) -> Path | None:
        """Write the critic as a HF LlamaForTokenClassification directory (see the module docstring).

        Collective over the TP group; the writer is TP 0 of DP 0, which gets the directory (None elsewhere).
        `MegatronCritic(out_dir, ...)` loads it back with the same weights.
        """
        sd = self.hf_state_dict()
        if sd is None or not self._is_writer():
            return None
        architecture = f"{TOKEN_CLASSIFIERS[self.shape.family]}ForTokenClassification"  # the policy's family
        return write_hf_dir(
            self.model_dir, out_dir, sd, config_update={**CRITIC_CONFIG, "architectures": [architecture]}
        )
