"""The trainer side of a LLaVA-architecture policy: a vision encoder beside Megatron's GPTModel decoder.

Route. The vision tower (Hugging Face's CLIP vision model) and LLaVA's MLP projector run as plain torch modules
outside Megatron, replicated on every rank and frozen by default (`set_trainable`); the Llama language model is
the library's Megatron `GPTModel` (converted by the existing `hf_convert` functions), fed through GPTModel's
`decoder_input=` argument. Megatron-core 0.16.1 has its own `CLIPViTModel` and `LLaVAModel`, but the first
needs more CPU workarounds than `cpu_shims` holds and the second is marked work in progress; the tower is a
small part of a VLM's compute, so it gains little from tensor parallelism.

One step of the data flow (B rows, T tokens, I images of C channels and H x W pixels, P = tokens per image,
D = the language model's hidden size):

    ids = expand_image_tokens(prompt_ids, image_token_id, P)   # one `<image>` -> P copies; same ids for
                                                               # the rollout engine and the trainer
    feats = encoder(pixel_values)                              # [I, C, H, W] -> [I, P, D]
    emb = decoder_input(gpt, input_ids, feats, image_token_id) # [T, B, D]: word embeddings, image rows
                                                               # replaced by feats in order
    logits = forward_with_decoder_input(gpt, input_ids, position_ids, mask, emb)   # [B, T, V/tp]

Packed rows (`packing.pack_shared_prefix`): `packed_image_index` maps every image-token position of the
packed rows to the image token of the unpacked rows it stands for, so `feats.reshape(-1, D)[index]` are the
features in packed order (`forward_packed_with_images`); with `share_images=True` (a prompt's samples hold its
images) the index points at each packed row's leading row only, whose images alone need the encoder.

Weights. `split_llava_state_dict` separates a LLaVA state dict into the language model under
`LlamaForCausalLM` names (for `hf_to_megatron` / `megatron_to_hf`) and the vision weights (names unchanged);
`join_llava_state_dict` is its inverse. Two name layouts exist in transformers 5.19 and both are handled:
- "checkpoint": what `save_pretrained` writes (and what llava-hf hub checkpoints hold):
  `language_model.model.*`, `language_model.lm_head.weight`, `vision_tower.*`
  (hub checkpoints: `vision_tower.vision_model.*`), `multi_modal_projector.*`;
- "module": the names of `LlavaForConditionalGeneration.state_dict()` in memory:
  `model.language_model.*`, `lm_head.weight`, `model.vision_tower.*`, `model.multi_modal_projector.*`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from yatt_ray.errors import ConfigError, DataError
from yatt_ray.model_dir import llava_config, tokens_per_image
from yatt_ray.model_shape import LlamaShape
from yatt_ray.train.hf_convert import StateDict
from yatt_ray.train.packing import PAD_SEGMENT, SharedPrefixRows

TRAIN_VISION_MODES = ("none", "projector", "all")
Layout = Literal["checkpoint", "module"]
LAYOUTS: tuple[Layout, ...] = ("checkpoint", "module")

# Language-model prefixes per layout: (decoder body, LM head); Llama's own names are "model." and "lm_head.".
_LM_PREFIXES: dict[str, tuple[str, str]] = {
    "checkpoint": ("language_model.model.", "language_model.lm_head."),
    "module": ("model.language_model.", "lm_head."),
}
_VISION_PREFIXES: dict[str, tuple[str, ...]] = {
    "checkpoint": ("vision_tower.", "multi_modal_projector."),
    "module": ("model.vision_tower.", "model.multi_modal_projector."),
}


# ---------------------------------------------------------------------------------------------- config
def text_shape(config: Any) -> LlamaShape:
    """The `LlamaShape` of a LLaVA model's language model (its `text_config`, with transformers' defaults for
    the keys a checkpoint leaves out; `model_type` "llama" when the dict has none)."""
    return LlamaShape.from_hf_config(llava_config(config).to_dict(), source="a LLaVA config")


# ---------------------------------------------------------------------------------------------- state dicts
def llava_layout(names) -> Layout:
    """ "module" if any name starts with `model.language_model.` / `model.vision_tower.` /
    `model.multi_modal_projector.`, else "checkpoint"."""
    module = ("model.language_model.", *_VISION_PREFIXES["module"])
    return "module" if any(n.startswith(module) for n in names) else "checkpoint"


def split_llava_state_dict(hf_sd: StateDict) -> tuple[StateDict, StateDict]:
    """(language model under LlamaForCausalLM names, vision weights under their own names) of a LLaVA state
    dict in either layout (see the module docstring). Tensors are shared, not copied.

    Language model: `<body prefix>X` -> `model.X`, `<head prefix>X` -> `lm_head.X`. Vision: every
    `vision_tower.*` / `multi_modal_projector.*` key (with `model.` in the module layout), unchanged.
    Raises ConfigError on a key of neither part, or on a mix of layouts.
    """
    layout = llava_layout(hf_sd)
    body, head = _LM_PREFIXES[layout]
    vision_prefixes = _VISION_PREFIXES[layout]
    lm: StateDict = {}
    vision: StateDict = {}
    unknown = []
    for name, tensor in hf_sd.items():
        if name.startswith(body):
            lm["model." + name[len(body) :]] = tensor
        elif name.startswith(head):
            lm["lm_head." + name[len(head) :]] = tensor
        elif name.startswith(vision_prefixes):
            vision[name] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ConfigError(
            f"{len(unknown)} key(s) of the LLaVA state dict belong to neither the language model nor the vision "
            f"part in the {layout!r} layout (prefixes {body!r}, {head!r}, {vision_prefixes}), e.g. "
            f"{unknown[:3]}: the checkpoint mixes layouts or is not a LlavaForConditionalGeneration"
        )
    return lm, vision


def join_llava_state_dict(lm_sd: StateDict, vision_sd: StateDict, layout: Layout | None = None) -> StateDict:
    """Inverse of `split_llava_state_dict`: Llama names -> the LLaVA names of `layout`, plus the vision weights
    as they are. `layout` None: the layout of `vision_sd`'s names ("checkpoint" when it is empty)."""
    layout = layout or llava_layout(vision_sd)
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r} is not one of {LAYOUTS}")
    body, head = _LM_PREFIXES[layout]
    out: StateDict = {}
    for name, tensor in lm_sd.items():
        if name.startswith("model."):
            out[body + name[len("model.") :]] = tensor
        elif name.startswith("lm_head."):
            out[head + name[len("lm_head.") :]] = tensor
        else:
            raise ConfigError(f"{name!r} is not a LlamaForCausalLM name (model.* or lm_head.*)")
    wrong = [n for n in vision_sd if not n.startswith(_VISION_PREFIXES[layout])]
    if wrong:
        raise ConfigError(
            f"vision keys {wrong[:3]} are not in the {layout!r} layout {_VISION_PREFIXES[layout]}"
        )
    return out | vision_sd


# ---------------------------------------------------------------------------------------------- encoder
class VisionEncoder(torch.nn.Module):
    """LLaVA's vision tower + projector: pixel_values [I, C, H, W] -> image features [I, P, D].

    features = projector(select(tower(pixels).hidden_states)), exactly as transformers'
    `LlavaModel.get_image_features`: hidden_states[k] is the tower's input to encoder layer k (k = 0: the
    embeddings after `pre_layrnorm`; k = L: the last layer's output); `vision_feature_layer` picks one k (or
    a list, concatenated along the channels); strategy "default" drops the CLS token (P = patches), "full"
    keeps it (P = patches + 1); projector = linear_2(act(linear_1(x))), D = the text hidden size.

    Submodules `vision_tower` (transformers' `AutoModel` of the vision config, e.g. `CLIPVisionModel`) and
    `multi_modal_projector` (`LlavaMultiModalProjector`) hold the weights. While the tower has no trainable
    parameter it runs without autograd (no activations kept); results are the same.
    """

    def __init__(self, config: Any) -> None:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__()
        cfg = llava_config(config)
        self.config = cfg
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(cfg)
        self.feature_layer: int | list[int] = cfg.vision_feature_layer
        self.select_strategy: str = cfg.vision_feature_select_strategy
        self.image_token_id: int = int(cfg.image_token_id)
        self.tokens_per_image: int = tokens_per_image(cfg)
        self.num_layers: int = int(cfg.vision_config.num_hidden_layers)

    @classmethod
    def from_hf(cls, config: Any, vision_sd: StateDict) -> VisionEncoder:
        """Build from a LLaVA config and its vision weights (any layout, e.g. `split_llava_state_dict`'s
        second part); every weight must be present (ConfigError naming the missing / unexpected ones)."""
        encoder = cls(config)
        load_exactly(encoder, {_encoder_name(n): t for n, t in vision_sd.items()}, "LLaVA")
        return encoder

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> VisionEncoder:
        """Build from a LLaVA Hugging Face directory (config.json + *.safetensors)."""
        from yatt_ray.train.model import read_hf_state_dict

        _, vision = split_llava_state_dict(read_hf_state_dict(model_dir))
        return cls.from_hf(model_dir, vision)

    def feature_indices(self) -> list[int]:
        """The hidden-state indices (0..L) that `vision_feature_layer` selects."""
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        return [k % (self.num_layers + 1) for k in layers]

    def unused_tower_parameters(self) -> list[str]:
        """Tower parameters that never reach the features (so never get a gradient): CLIP's `post_layernorm`
        (it normalises the pooled CLS output only) and the encoder layers after the deepest selected one."""
        deepest = max(self.feature_indices())
        unused = []
        for name, _ in self.vision_tower.named_parameters():
            parts = name.split(".")
            deeper = parts[:2] == ["encoder", "layers"] and int(parts[2]) >= deepest
            if parts[0] == "post_layernorm" or deeper:
                unused.append(name)
        return unused

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [I, C, H, W] -> features [I, P, D] (see the class docstring)."""
        tower_grad = any(p.requires_grad for p in self.vision_tower.parameters())
        dtype = next(self.vision_tower.parameters()).dtype
        with torch.set_grad_enabled(torch.is_grad_enabled() and (tower_grad or pixel_values.requires_grad)):
            out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True, return_dict=True)
        pool = [out.hidden_states[k] for k in self.feature_indices()]
        if self.select_strategy == "default":
            pool = [h[:, 1:] for h in pool]
        return self.multi_modal_projector(torch.cat(pool, dim=-1))

    def hf_state_dict(self, layout: Layout = "checkpoint") -> StateDict:
        """The encoder's weights under LLaVA names of `layout` ("checkpoint": `vision_tower.*`,
        `multi_modal_projector.*`; "module": with `model.` in front), detached (for export and weight sync)."""
        prefix = "model." if layout == "module" else ""
        return {prefix + n: t.detach() for n, t in self.state_dict().items()}


def load_exactly(module: torch.nn.Module, sd: StateDict, kind: str) -> None:
    """`module.load_state_dict(sd)`, raising ConfigError naming the missing / unexpected weights (the first
    five of each) unless `sd` sets every parameter and holds nothing else."""
    result = module.load_state_dict(sd, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(
            f"the vision weights do not fit the {kind} config: missing={result.missing_keys[:5]}, "
            f"unexpected={result.unexpected_keys[:5]}; the checkpoint and config.json disagree"
        )


def _encoder_name(name: str) -> str:
    """A LLaVA vision weight name (any layout) -> the `VisionEncoder` name (`vision_tower.*`,
    `multi_modal_projector.*`)."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.vision_model."):  # llava-hf hub layout
        name = "vision_tower." + name[len("vision_tower.vision_model.") :]
    return name


def set_trainable(encoder: VisionEncoder, train_vision: str) -> list[str]:
    """Set `requires_grad` on the encoder's parameters; return the trainable names.

    "none": nothing in the encoder (features are constants for the decoder); "projector": the projector only;
    "all": the projector and every tower parameter that reaches the features (not
    `unused_tower_parameters()`). ConfigError (a ValueError) on another value.
    """
    if train_vision not in TRAIN_VISION_MODES:
        raise ConfigError(
            f"train_vision={train_vision!r} is not one of {TRAIN_VISION_MODES}: 'none' freezes the vision "
            "encoder, 'projector' trains the projector only, 'all' trains the tower and the projector"
        )
    unused = set(encoder.unused_tower_parameters())
    trainable = []
    for name, p in encoder.named_parameters():
        if name.startswith("multi_modal_projector."):
            on = train_vision in ("projector", "all")
        else:
            on = train_vision == "all" and name.removeprefix("vision_tower.") not in unused
        p.requires_grad_(on)
        if on:
            trainable.append(name)
    return trainable


# ---------------------------------------------------------------------------------------------- decoder input
def decoder_input(
    gpt_model, input_ids: torch.Tensor, image_features: torch.Tensor | None, image_token_id: int
) -> torch.Tensor:
    """GPTModel's embeddings of `input_ids` [B, T] with the image-token rows replaced: -> [T, B, D].

    emb = gpt_model.embedding(input_ids) ([T, B, D], Megatron is sequence-first, TP-reduced); then, with
    (b_n, t_n) the positions where input_ids == image_token_id in row-major order (row 0 left to right, then
    row 1, ...: the order of transformers' `masked_scatter`), emb[t_n, b_n] = F[n] where F =
    image_features.reshape(-1, D), from [I, P, D] (images in order) or [N, D] (one row per image token, e.g.
    `packed_image_index`'s order). Differentiable w.r.t. the embeddings and the features. DataError when
    the image tokens do not number I * P (or N).
    """
    from yatt_ray.train.model import gpt_module

    emb = gpt_module(gpt_model).embedding(input_ids=input_ids, position_ids=None)  # [T, B, D]
    mask = input_ids == image_token_id
    found = int(mask.sum())
    given = 0 if image_features is None else image_features.numel() // image_features.shape[-1]
    if found != given:
        shape = None if image_features is None else tuple(image_features.shape)
        raise DataError(
            f"the batch holds {found} image tokens (id {image_token_id}) but the image features {shape} give "
            f"{given} rows: pass one image per `<image>` placeholder (expand_image_tokens), in prompt order"
        )
    if image_features is None or found == 0:
        return emb
    rows, cols = mask.nonzero(as_tuple=True)
    features = image_features.reshape(-1, emb.shape[-1]).to(emb.dtype)
    return emb.index_put((cols, rows), features)


def forward_with_decoder_input(
    model,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask,
    decoder_input: torch.Tensor,
) -> torch.Tensor:
    """`model` (GPTModel or its DDP wrapper) on given input embeddings: input_ids [B, T] (ignored by the
    embedding, kept for Megatron's bookkeeping), position_ids [B, T] (RoPE positions, as `rope_positions`
    takes them) or [3, B, T], attention_mask what the model's attention takes (`model.attention_input`; None =
    causal over each row), decoder_input [T, B, D] ->
    logits [B, T, V/tp] (vocab-parallel, not gathered)."""
    from yatt_ray.train.model import rope_positions

    positions = rope_positions(position_ids) if position_ids.dim() == 2 else position_ids
    return model(input_ids, positions, attention_mask, decoder_input=decoder_input)


def packed_image_index(
    packed: SharedPrefixRows,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_token_id: int,
    share_images: bool = False,
) -> torch.Tensor:
    """For each image token of the packed rows (row-major order), the index of the image token of the
    unpacked rows (`input_ids` [B, T], `attention_mask` [B, T], row-major, real tokens only) it stands for:
    -> long [N]. With feats [I, P, D] the features of the unpacked rows' images in order,
    `feats.reshape(-1, D)[index]` are the packed rows' image features (for `decoder_input`).

    A token of a shared prefix stands for every row of its group; the first row's is taken, so rows packed
    together must hold the same images in their common prefix (a prompt's samples do). Image tokens after the
    shared body (rows packed together that differ inside their images) point at their own row's image tokens.
    `share_images=True` declares that rows packed together hold the same images (a prompt's samples): every
    index then points at the image tokens of the first row with images of its packed row (the leader), so only
    the leaders' images need encoding; rows of a packed row with different numbers of image tokens raise
    DataError. The last real token of a row has no packed place of its own in `packed.source`: it must not be
    an image token (DataError).
    """
    g, length = packed.input_ids.shape
    unset = torch.iinfo(torch.long).max
    owner = torch.full((g * length,), unset, dtype=torch.long)
    ids, real = input_ids.cpu(), attention_mask.cpu().bool()
    source = packed.source.cpu()
    leaders: dict[int, tuple[int, int, int]] = {}  # packed row -> (leader row, its offset, its image tokens)
    offset = 0
    for i in range(ids.shape[0]):
        cols = torch.nonzero(real[i]).flatten()
        is_image = ids[i, cols] == image_token_id
        count = int(is_image.sum())
        if count == 0:
            continue
        if bool(is_image[-1]):
            raise DataError(
                f"row {i} ends with an image token: its last token has no packed place; a row must hold at "
                "least one token after its images (the prompt's text after `<image>`, or the response)"
            )
        m = torch.nonzero(is_image).flatten()  # real-token indices of the image tokens, all < len - 1
        places = packed.places(source[i, cols[m + 1] - 1])  # packed place of real token m (predicting m + 1)
        target = offset
        if share_images:
            leader, target, leader_count = leaders.setdefault(int(places[0]) // length, (i, offset, count))
            if leader_count != count:
                raise DataError(
                    f"rows {leader} and {i} are packed together with {leader_count} and {count} image tokens: "
                    "share_images=True needs rows with the same images (a prompt's samples); pack with "
                    "group_size=1 or use share_images=False and encode every row's images"
                )
        owner.scatter_reduce_(0, places, target + torch.arange(count), reduce="amin")
        offset += count
    flat_ids = packed.input_ids.cpu().reshape(-1)
    positions = torch.nonzero(
        (flat_ids == image_token_id) & (packed.segment.cpu().reshape(-1) != PAD_SEGMENT)
    )
    index = owner[positions.flatten()]
    if bool((index == unset).any()):
        raise DataError(
            "some image tokens of the packed rows map to no image token of the unpacked rows: `packed` was "
            "not made from these input_ids / attention_mask"
        )
    return index.to(packed.input_ids.device)


def forward_packed_with_images(
    model,
    packed: SharedPrefixRows,
    image_features: torch.Tensor | None,
    image_token_id: int,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """`model.forward_packed` with images: `image_features` [N, D] in packed order (`packed_image_index`) or
    None for text-only rows; `positions` [3, G, L] M-RoPE positions (Qwen VL: `qwen_vl.packed_positions`),
    None = the packed rows' own -> outputs [G, L, ...] (logits [G, L, V/tp] for a policy)."""
    from yatt_ray.train.model import attention_input

    embeddings = decoder_input(model, packed.input_ids, image_features, image_token_id)
    where = packed.position_ids if positions is None else positions.to(packed.input_ids.device)
    return forward_with_decoder_input(
        model, packed.input_ids, where, attention_input(model, packed), embeddings
    )
