"""The trainer side of a Qwen2-VL / Qwen2.5-VL policy: the vision transformer beside Megatron's decoder, M-RoPE.

Route. As for LLaVA (`vision.py`): transformers' vision transformer and patch merger (`visual`) run as a plain
torch module on every rank, frozen by default; the language model is the library's Megatron `GPTModel` of the
Qwen2 family (q/k/v biases), its embeddings fed through `decoder_input=` with the image rows replaced by the
merged features. The merger is the projector of `train_vision=none|projector|all`.

Images. An image of grid (t, h, w) patches (`image_grid_thw`, from Qwen's image processor) enters the tower as
t*h*w rows of `pixel_values` [patches, C * temporal_patch * patch^2] and leaves the merger as t*h*w / m^2
features [tokens, D] (m = spatial_merge_size, 2), one per `<|image_pad|>` token of the prompt, in order.

Multimodal RoPE. Each token has three positions (time, height, width); the decoder's rotary frequencies are
split into `mrope_section` (t, h, w) groups, each rotated by its own position (Megatron's `mrope` embedding and
transformers' are the same map). `mrope_positions` computes them for a row, as transformers'
`get_rope_index` does for still images:

    text token:      (p, p, p), then p += 1
    image (t, h, w): token (i, j, k) of the merged grid gets (p + i, p + j, p + k); then
                     p += max(h, w) / m   (t = 1 for images: time positions stay at p)

so a response token after the prompt continues from p, not from its column: the trainer packs rows with these
positions (`packed_positions`), the same the rollout engine uses.

Weights. On disk (what `save_pretrained` writes, and hub checkpoints hold): `model.*` (the language model
under Qwen2 names), `lm_head.weight`, `visual.*`; in memory (`state_dict()` of transformers 5's class):
`model.language_model.*`, `lm_head.weight`, `model.visual.*`. `split_qwen_vl_state_dict` gives the language
model under `Qwen2ForCausalLM` names (for `hf_to_megatron`) and the vision weights as `visual.*`;
`join_qwen_vl_state_dict` is its inverse.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from yatt_ray.errors import ConfigError, DataError
from yatt_ray.model_dir import qwen_vl_config
from yatt_ray.train.hf_convert import StateDict


# ---------------------------------------------------------------------------------------------- positions
def mrope_positions(
    ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_token_id: int, merge: int
) -> torch.Tensor:
    """M-RoPE positions of one row's real tokens: ids [T] -> long [3, T] (module docstring).

    image_grid_thw [I, 3]: the row's images in order; each image's tokens are one run of
    t*h*w / merge^2 `image_token_id`s. DataError when the runs and the grids disagree."""
    ids = ids.cpu()
    grids = [] if image_grid_thw is None else [tuple(int(x) for x in g) for g in image_grid_thw.tolist()]
    is_image = (ids == image_token_id).tolist()
    out = torch.empty(3, len(ids), dtype=torch.long)
    p, i, image = 0, 0, 0
    while i < len(ids):
        if not is_image[i]:
            out[:, i] = p
            p, i = p + 1, i + 1
            continue
        if image >= len(grids):
            raise DataError(f"the row holds more images than its {len(grids)} image_grid_thw entries")
        t, h, w = grids[image]
        hm, wm = h // merge, w // merge
        n = t * hm * wm
        if ids[i : i + n].ne(image_token_id).any() or (i + n < len(ids) and is_image[i + n]):
            raise DataError(
                f"image {image} (grid {t}x{h}x{w}, merge {merge}) needs a run of exactly {n} image tokens at "
                f"position {i}; the prompt's image tokens and the processor's grids disagree"
            )
        grid = torch.stack(
            torch.meshgrid(torch.arange(t), torch.arange(hm), torch.arange(wm), indexing="ij")
        ).reshape(3, -1)
        out[:, i : i + n] = p + grid
        p, i, image = p + max(hm, wm), i + n, image + 1
    if image != len(grids):
        raise DataError(
            f"the row holds {image} image(s) but {len(grids)} image_grid_thw entries came with it"
        )
    return out


def packed_positions(packed, row_positions: list[torch.Tensor]) -> torch.Tensor:
    """[3, G, L] positions of `packed` (`packing.SharedPrefixRows`) from each original row's [3, T_i]
    `mrope_positions`: packed token m of row i (its real-token index, `packed.position_ids`) takes row i's
    position m; the shared body takes its packed row's first row's."""
    g, length = packed.position_ids.shape
    out = torch.zeros(3, g, length, dtype=torch.long)
    owner = packed.row.cpu()
    index = packed.position_ids.cpu()
    real = owner >= 0
    for r in owner[real].unique().tolist():
        at = owner == r
        out[:, at] = row_positions[r][:, index[at]]
    return out


# ---------------------------------------------------------------------------------------------- weights
def qwen_vl_layout(names) -> str:
    """ "module" (transformers 5's in-memory names: `model.language_model.*`) or "checkpoint" (on disk)."""
    return "module" if any(n.startswith("model.language_model.") for n in names) else "checkpoint"


def split_qwen_vl_state_dict(hf_sd: StateDict) -> tuple[StateDict, StateDict]:
    """A Qwen VL state dict (either layout) -> (language model under `Qwen2ForCausalLM` names, `visual.*`)."""
    lm: StateDict = {}
    vision: StateDict = {}
    for name, t in hf_sd.items():
        if name.startswith(("visual.", "model.visual.")):
            vision[name.removeprefix("model.")] = t
        elif name.startswith("model.language_model."):
            lm["model." + name[len("model.language_model.") :]] = t
        elif name.startswith(("model.", "lm_head.")):
            lm[name] = t
        else:
            raise ConfigError(f"unexpected weight {name!r} in a Qwen VL checkpoint")
    if not vision:
        raise ConfigError("the Qwen VL checkpoint holds no `visual.*` weights (a text-only checkpoint?)")
    return lm, vision


def join_qwen_vl_state_dict(lm_sd: StateDict, vision_sd: StateDict, layout: str = "checkpoint") -> StateDict:
    """Inverse of `split_qwen_vl_state_dict`, in `layout`."""
    out: StateDict = {}
    for name, t in lm_sd.items():
        if layout == "module" and name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        out[name] = t
    for name, t in vision_sd.items():
        out[("model." if layout == "module" else "") + name] = t
    return out


# ---------------------------------------------------------------------------------------------- encoder
class QwenVisionEncoder(torch.nn.Module):
    """transformers' Qwen vision transformer + merger (submodule `visual`): pixel_values [patches, C*tp*p*p],
    image_grid_thw [I, 3] -> features [tokens, D] (tokens = sum of t*h*w / merge^2), images in order.

    While no parameter trains and the pixels need no gradient it runs without autograd."""

    def __init__(self, config: Any) -> None:
        import transformers

        super().__init__()
        cfg = qwen_vl_config(config)
        self.config = cfg
        cls = (
            transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel
            if cfg.model_type == "qwen2_vl"
            else transformers.models.qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel
        )
        self.visual = cls._from_config(cfg.vision_config)
        self.image_token_id: int = int(cfg.image_token_id)
        self.merge: int = int(cfg.vision_config.spatial_merge_size)

    @classmethod
    def from_hf(cls, config: Any, vision_sd: StateDict) -> QwenVisionEncoder:
        """Build from a Qwen VL config and its `visual.*` weights (ConfigError naming missing / extra ones)."""
        from yatt_ray.train.vision import load_exactly

        encoder = cls(config)
        load_exactly(encoder, vision_sd, "Qwen VL")
        return encoder

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> QwenVisionEncoder:
        from yatt_ray.train.model import read_hf_state_dict

        _, vision = split_qwen_vl_state_dict(read_hf_state_dict(model_dir))
        return cls.from_hf(model_dir, vision)

    def tokens(self, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """Tokens per image [I]: t*h*w / merge^2."""
        return image_grid_thw.prod(-1) // self.merge**2

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        params = list(self.visual.parameters())
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params) or pixel_values.requires_grad
        )
        with torch.set_grad_enabled(grad):
            out = self.visual(pixel_values.to(params[0].dtype), grid_thw=image_grid_thw, return_dict=True)
        return out.pooler_output

    def hf_state_dict(self, layout: str = "checkpoint") -> StateDict:
        """`visual.*` weights (with `model.` in front for the "module" layout), detached."""
        prefix = "model." if layout == "module" else ""
        return {prefix + n: t.detach() for n, t in self.state_dict().items()}


def set_trainable(encoder: QwenVisionEncoder, train_vision: str) -> list[str]:
    """`train_vision`: "none" freezes the encoder, "projector" trains the merger (`visual.merger.*`), "all"
    every vision weight. Returns the trainable names; ConfigError on another value."""
    from yatt_ray.train.vision import TRAIN_VISION_MODES

    if train_vision not in TRAIN_VISION_MODES:
        raise ConfigError(
            f"train_vision={train_vision!r} is not one of {TRAIN_VISION_MODES}: 'none' freezes the vision "
            "encoder, 'projector' trains the patch merger only, 'all' trains the whole vision transformer"
        )
    names = []
    for name, p in encoder.named_parameters():
        on = train_vision == "all" or (train_vision == "projector" and name.startswith("visual.merger."))
        p.requires_grad_(on)
        if on:
            names.append(name)
    return names
