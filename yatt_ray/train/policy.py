"""`MegatronPolicy`: the per-worker trainer (log-probs, a training step, HF export, offload).

One instance lives in every training worker. Tensor-parallel ranks of one data-parallel group must call every
method with the same arguments (the group's controller broadcasts the batch); most methods are collectives.

Gradient convention (shared with `MegatronCritic`, see `trainer_base`): `loss_fn` already divides by the GLOBAL
normaliser (e.g. the response tokens of the whole step, over every micro-batch and every data-parallel rank).
Gradients are therefore accumulated over micro-batches and SUMMED over data-parallel ranks, never averaged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from yatt_ray.batch import Pixels, PromptImages
from yatt_ray.errors import DataError
from yatt_ray.model_dir import is_vision_model
from yatt_ray.model_shape import LlamaShape
from yatt_ray.train import qwen_vl
from yatt_ray.train.hf_convert import StateDict, hf_to_megatron, megatron_to_hf
from yatt_ray.train.logprobs import head_logprobs_and_entropy
from yatt_ray.train.micro_batches import to_device
from yatt_ray.train.model import (
    build_gpt_model,
    forward_packed,
    hidden_state_output,
    load_hf_weights,
    load_megatron_shard,
    model_rows,
    output_weight,
    read_hf_state_dict,
)
from yatt_ray.train.packing import pack_shared_prefix
from yatt_ray.train.trainer_base import MegatronTrainerBase, write_hf_dir
from yatt_ray.train.vision import (
    VisionEncoder,
    forward_packed_with_images,
    join_llava_state_dict,
    packed_image_index,
    set_trainable,
    split_llava_state_dict,
)

Encoder = VisionEncoder | qwen_vl.QwenVisionEncoder

LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, dict]]


class MegatronPolicy(MegatronTrainerBase):
    """A Llama policy as a Megatron GPTModel under Megatron DDP, with plain AdamW and an optional reference.

    A LLaVA or Qwen2-VL / Qwen2.5-VL directory (`hf_convert.is_vision_model`) gives a vision-language policy:
    the language model in Megatron and the vision encoder (`vision.VisionEncoder`: LLaVA's tower + projector;
    `qwen_vl.QwenVisionEncoder`: Qwen's vision transformer + merger) beside it, replicated on every rank, whose
    image features replace the image tokens' embeddings (`vision.forward_packed_with_images`; Qwen VL with
    M-RoPE positions). Each prompt's images are encoded once per pass, however many samples share them.
    `train_vision`: none (the encoder frozen), projector (the merger for Qwen VL), or all; trained parts have
    their own AdamW (same settings), their gradients summed over data-parallel ranks and clipped with the
    model's (one global norm).

    Args:
        model_dir: Hugging Face Llama directory (config.json, *.safetensors, tokenizer files).
        tp_size: tensor-parallel size; the world size must be a multiple of it (DP = world / tp).
        lr, weight_decay, betas: AdamW settings (no weight decay on 1-D params: the RMSNorm weights).
        grad_clip: max global grad norm (<= 0 turns clipping off; the norm is still reported).
        seed: torch and Megatron RNG seed.
        dtype, distributed_optimizer, recompute_activations: the weights' dtype ("fp32" | "bf16"), ZeRO-1 and
            activation recomputation (see `trainer_base`).
        with_reference: also build a frozen copy of the initial weights for reference log-probs.
        train_vision: for a LLaVA policy, "none" | "projector" | "all" (see above).
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
        with_reference: bool = False,
        train_vision: str = "none",
    ):
        self.vision = is_vision_model(model_dir)
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
        self.reference = self._build_model().eval().requires_grad_(False) if with_reference else None
        self.encoder: Encoder | None = None
        self.reference_encoder: Encoder | None = None
        self.encoder_optimizer: torch.optim.Optimizer | None = None
        self.qwen = self.vision and self.shape.mrope_section is not None
        if self.vision:
            if self.qwen:
                self.encoder = qwen_vl.QwenVisionEncoder.from_hf_dir(self.model_dir).to(self.device)
                trainable = qwen_vl.set_trainable(self.encoder, train_vision)
            else:
                self.encoder = VisionEncoder.from_hf_dir(self.model_dir).to(self.device)
                trainable = set_trainable(self.encoder, train_vision)
            self.reference_encoder = self.encoder
            if trainable:
                params = [p for p in self.encoder.parameters() if p.requires_grad]
                groups = [
                    {"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                    {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
                ]
                self.encoder_optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))  # type: ignore[arg-type]
                if with_reference:  # the reference keeps the initial encoder
                    self.reference_encoder = copy.deepcopy(self.encoder).requires_grad_(False)

    def _build_model(self) -> torch.nn.Module:
        model = build_gpt_model(self.shape, self.dtype, recompute=self.recompute)
        if self.vision:
            load_language_model_weights(model, self.model_dir, self.shape)
        else:
            load_hf_weights(model, self.model_dir, self.shape)
        hidden_state_output(model)  # log-probs from the hidden states and the output weight, no logits
        return model

    def _frozen_modules(self) -> list[torch.nn.Module]:
        modules = [] if self.reference is None else [self.reference]
        for encoder in (self.encoder, self.reference_encoder):
            if encoder is not None and all(encoder is not m for m in modules):
                modules.append(encoder)
        return modules

    def _side_params(self) -> list[torch.nn.Parameter]:
        if self.encoder_optimizer is None:
            return []
        return [p for group in self.encoder_optimizer.param_groups for p in group["params"]]

    def _side_optimizer(self) -> torch.optim.Optimizer | None:
        return self.encoder_optimizer

    # ---- forward ------------------------------------------------------------------------------------------

    def _forward(
        self,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        group_size: int,
        image_prompt: torch.Tensor | None = None,
        images: PromptImages | None = None,
    ):
        """input_ids, attention_mask [B, T] -> (logp, entropy) [B, T-1]; column t predicts token t+1.

        Runs on the shared-prefix packing of `group_size` consecutive rows (`packing`): a group's prompt once.
        A vision policy also takes the rows' prompts' images: `images` (`batch.PromptImages`, each prompt's
        once) and `image_prompt` [B] long, row b's prompt in it.
        """
        packed = pack_shared_prefix(input_ids, attention_mask, group_size)  # built on the CPU
        self.forward_tokens += packed.tokens
        rows = model_rows(model, packed)  # one flat row [1, T] under the packed attention
        on_device = rows.to(self.device)
        if self.encoder is None:
            hidden = forward_packed(model, on_device)  # [G, L, H] ([1, T, H] flat)
        else:
            if images is None or image_prompt is None:
                raise ValueError("a vision-language policy needs `images` and `image_prompt` with the batch")
            encoder = self.reference_encoder if model is self.reference else self.encoder
            assert encoder is not None
            features = self._packed_features(encoder, packed, input_ids, attention_mask, image_prompt, images)
            positions = None
            if isinstance(encoder, qwen_vl.QwenVisionEncoder):
                positions = self._mrope(encoder, packed, input_ids, attention_mask, image_prompt, images)
                positions = (
                    positions if rows is packed else packed.on_flat(positions, rows.input_ids.shape[-1])
                )
            hidden = forward_packed_with_images(model, on_device, features, encoder.image_token_id, positions)
        return packed_logprobs_and_entropy(hidden, output_weight(model), on_device, self.tp_group)

    @torch.no_grad()
    def log_probs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        micro_batch_size: int | None = None,
        reference: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        group_size: int = 1,
        images: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log p(input_ids[:, t+1] | input_ids[:, :t+1]) and entropy, each [B, T-1] float32 (CPU).

        attention_mask [B, T]: 1 = real token; left or right padding. Columns whose next token is padding are 0.
        Micro-batches: `micro_batch_size` rows each, or at most `max_tokens_per_micro_batch` (rows x longest
        real length) when that is given; rows come back in their original order either way. `group_size`
        consecutive rows (a prompt's samples) are packed together, their common prefix computed once.
        `reference=True` uses the frozen reference model (built with `with_reference=True`). Call `onload()`
        first if the weights were offloaded. `images`: a vision policy's {"image_prompt", "images"}
        (`RolloutBatch.image_inputs()`).
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
            lambda ids, mask, **rows: self._forward(model, ids, mask, group_size, **rows),
            group_size,
            extra=images,
        )
        return logp, entropy

    def _packed_features(
        self,
        encoder: Encoder,
        packed,
        input_ids,
        attention_mask,
        image_prompt: torch.Tensor,
        images: PromptImages,
    ) -> torch.Tensor:
        """Image features [N, D] for the N image tokens of `packed`, in its order. A group's samples share their
        prompt's images, so only the rows that lead a packed row are looked at, and each prompt they name is
        encoded once (several slices of one group in a micro-batch share it too)."""
        index = packed_image_index(
            packed, input_ids, attention_mask, encoder.image_token_id, share_images=True
        )
        real = attention_mask.cpu().bool()
        per_row = ((input_ids.cpu() == encoder.image_token_id) & real).sum(1).tolist()  # image tokens a row
        row_start = [0, *torch.tensor(per_row).cumsum(0).tolist()]
        leaders = sorted({int(r) for r in packed.first_row.tolist() if per_row[int(r)]})
        width = int(encoder.config.text_config.hidden_size)
        flat = torch.zeros(row_start[-1], width, device=self.device)
        if not leaders:
            return flat[to_device(index, self.device)]
        prompt_of = image_prompt.cpu().tolist()
        prompts = sorted({prompt_of[r] for r in leaders})
        chosen = images.select(prompts)
        features = _encode(encoder, chosen, self.device)  # [tokens, D], prompt after prompt
        tokens = _prompt_tokens(encoder, chosen)
        at = dict(zip(prompts, [0, *torch.tensor(tokens).cumsum(0).tolist()]))
        spans, picks = [], []
        for r in leaders:
            g = prompt_of[r]
            if per_row[r] != tokens[prompts.index(g)]:
                raise DataError(
                    f"row {r} holds {per_row[r]} image tokens but its prompt's images make "
                    f"{tokens[prompts.index(g)]}; the prompt's ids and pixels disagree"
                )
            spans.append(torch.arange(row_start[r], row_start[r] + per_row[r]))
            picks.append(torch.arange(at[g], at[g] + per_row[r]))
        rows = to_device(torch.cat(spans), self.device)
        flat = flat.index_put((rows,), features[to_device(torch.cat(picks), features.device)].to(flat.dtype))
        return flat[to_device(index, self.device)]

    def _mrope(self, encoder, packed, input_ids, attention_mask, image_prompt, images) -> torch.Tensor:
        """[3, G, L] M-RoPE positions of `packed` (`qwen_vl.packed_positions`) from each row's real tokens and
        its prompt's image grids."""
        real = attention_mask.cpu().bool()
        ids = input_ids.cpu()
        prompt_of = image_prompt.cpu().tolist()
        used = sorted(set(prompt_of))
        grids = {g: p.grid for g, p in zip(used, images.pixels_of(used))}
        rows = [
            qwen_vl.mrope_positions(
                ids[r][real[r]], grids[prompt_of[r]], encoder.image_token_id, encoder.merge
            )
            for r in range(len(ids))
        ]
        return qwen_vl.packed_positions(packed, rows)

    @torch.no_grad()
    def image_features(self, pixels: list[Pixels]) -> list[torch.Tensor]:
        """Each prompt's image features [tokens_g, D] (float32, CPU) from the current encoder, all prompts in
        one encoder call: what a rollout engine that takes features (vLLM) puts at the image tokens. A prompt
        without images gets [0, D]. No collective (the encoder is replicated): the controller calls it alone."""
        if self.encoder is None:
            raise ValueError("image_features: this policy has no vision encoder (a text model)")
        images = PromptImages.of(pixels)
        tokens = _prompt_tokens(self.encoder, images)
        device = next(self.encoder.parameters()).device  # where it is now (host while offloaded for rollout)
        features = _encode(self.encoder, images, device).float().cpu() if sum(tokens) else None
        width = int(self.encoder.config.text_config.hidden_size)
        if features is None:
            return [torch.zeros(0, width) for _ in pixels]
        return list(features.split(tokens))

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

        def micro_loss(micro: dict, host: dict) -> tuple[torch.Tensor, dict]:
            images = {k: host[k] for k in ("image_prompt", "images") if k in host}
            logp, entropy = self._forward(
                self.model, host["input_ids"], host["attention_mask"], group_size, **images
            )
            return loss_fn(logp, entropy, micro)

        return self._train_step(batch, micro_batch_size, max_tokens_per_micro_batch, micro_loss, group_size)

    # ---- export -------------------------------------------------------------------------------------------

    def hf_state_dict(self, trained_only: bool = False) -> StateDict | None:
        """Full HF-named weights gathered over the TP group (every TP rank must call); None off TP rank 0.
        A vision policy's come under its checkpoint names (LLaVA's or Qwen VL's), the encoder's included
        (`trained_only`: only its parts that train, for a weight sync)."""
        shards = self._gather_tp_shards()
        if shards is None:
            return None
        language = megatron_to_hf(shards, self.shape)
        if self.encoder is None:
            return language
        trained = {n for n, p in self.encoder.named_parameters() if p.requires_grad}
        vision = {n: t for n, t in self.encoder.hf_state_dict().items() if not trained_only or n in trained}
        if self.qwen:
            return qwen_vl.join_qwen_vl_state_dict(language, vision)
        return join_llava_state_dict(language, vision)

    def iter_hf_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Gather now (collective, every TP rank), then yield [(hf_name, tensor)] lists of <= ~bucket_bytes
        (what changes in training: a frozen vision encoder is not sent).

        A tensor larger than bucket_bytes gets a bucket of its own. Non-zero TP ranks get an empty iterator.
        """
        sd = self.hf_state_dict(trained_only=True)
        return iter(()) if sd is None else _buckets(sd, bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path | None:
        """Write config + model.safetensors + tokenizer files (collective); the writer is TP 0 of DP 0.

        Returns the directory on the writing rank, None elsewhere.
        """
        sd = self.hf_state_dict()
        if sd is None or not self._is_writer():
            return None
        return write_hf_dir(self.model_dir, out_dir, sd)


def packed_logprobs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, packed, tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) [B, T-1] of the original rows from the last hidden states [G, L, H] of their packed rows
    (`packing.SharedPrefixRows`) and the output weight [V/tp, H]: each position's log-prob of its target, and
    each extra prediction's (a shared body's last token predicting rows 2..n's first own tokens) from the
    hidden state of its position."""
    logp, entropy = head_logprobs_and_entropy(hidden, weight, packed.targets, tp_group)
    extra = None
    if len(packed.extra_at):
        at_extra = hidden.reshape(-1, hidden.shape[-1])[packed.extra_at]  # [E, H]
        extra, _ = head_logprobs_and_entropy(at_extra, weight, packed.extra_targets, tp_group)
    return packed.unpack(logp, extra), packed.unpack(entropy)


def load_language_model_weights(model, model_dir: str | Path, shape: LlamaShape) -> None:
    """Copy this TP rank's shard of a vision-language directory's language model (LLaVA's Llama, or Qwen VL's
    Qwen2) into a GPTModel from `build_gpt_model(LlamaShape.from_hf_dir(model_dir))` (the counterpart of
    `model.load_hf_weights`)."""
    from megatron.core import parallel_state as ps

    split = qwen_vl.split_qwen_vl_state_dict if shape.mrope_section is not None else split_llava_state_dict
    lm, _ = split(read_hf_state_dict(model_dir))
    shard = hf_to_megatron(
        lm,
        shape,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
    )
    load_megatron_shard(model, shard, model_dir)


def _encode(encoder: Encoder, images: PromptImages, device) -> torch.Tensor:
    """Features [tokens, D] of every image of `images`, in order."""
    values = to_device(images.values, device)
    if isinstance(encoder, qwen_vl.QwenVisionEncoder):
        assert images.grid is not None, "Qwen VL images come with their image_grid_thw"
        return encoder(values, to_device(images.grid, device))
    features = encoder(values)  # [I, P, D]
    return features.reshape(-1, features.shape[-1])


def _prompt_tokens(encoder: Encoder, images: PromptImages) -> list[int]:
    """Image tokens of each prompt of `images`."""
    if isinstance(encoder, qwen_vl.QwenVisionEncoder):
        assert images.grid is not None
        per_image = encoder.tokens(images.grid).tolist()
        ends = images.counts.cumsum(0).tolist()
        return [sum(per_image[a:b]) for a, b in zip([0, *ends[:-1]], ends)]
    return (images.counts * encoder.tokens_per_image).tolist()


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
