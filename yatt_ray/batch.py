"""One group's rollout batch: the padded tensors the trainer consumes, and what each phase of a step adds.

Layout for N samples (a prompt's `group_size` samples adjacent), prompts left-padded to width P and responses
right-padded to width R:

    input_ids       [N, P + R]   <pad>.. prompt | response ..<pad>
    attention_mask  [N, P + R]   1 on real tokens
    response_mask   [N, R]       1 on real response tokens
    rollout_logp    [N, R]       the engine's log-probability of each sampled token (0 on padding)

The policy's per-position outputs `out[:, t]` ([N, P + R - 1]) score token t+1, so their response part is
`out[:, P-1:]` ([N, R]): `RolloutBatch.response(out)`.

Fields filled by later phases (None until then): reward: `rewards` [N] (and `greedy_rewards` [N / group_size]
for ReMax's baseline); log-probs: `old_logp`, `ref_logp`, `values`, `tis_weights` [N, R]; advantages:
`advantages`, `returns` [N, R], and `overlong_penalty` [N] (DAPO's length penalty added to `rewards` for the
estimator, `algo.overlong_buffer` > 0; `rewards` itself stays the task reward).

Image prompts (a vision-language policy) add, from the rollout on, each prompt's images ONCE however many
samples it has: `images` (a `PromptImages`: the pixels of the batch's prompts, prompt after prompt) and the row
field `image_prompt` [N] long, row i's prompt in `images` (a prompt without images has none: a text row, whose
pixels the trainer never encodes). The images' tokens are already in `input_ids` (each image expanded to its
tokens), so the trainer swaps their embeddings for image features. Selecting rows (`rows`) keeps the images of
the prompts they name and renumbers `image_prompt`; `concat` joins and renumbers them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

ROW_FIELDS = (
    "input_ids", "attention_mask", "response_mask", "rollout_logp", "rewards",
    "old_logp", "ref_logp", "values", "tis_weights", "advantages", "returns", "image_prompt", "overlong_penalty",
)  # fmt: skip


@dataclass(frozen=True)
class Pixels:
    """One prompt's images as its model reads them.

    values [P, *S] float32: LLaVA: one row per image (P = I, S = (C, H, W)); Qwen2-VL / 2.5-VL: one row per
           patch of every image in turn (S = (C * temporal_patch * patch^2,)).
    grid   [I, 3] long: Qwen VL's `image_grid_thw` (image k has t*h*w patch rows); None for LLaVA.
    features [tokens, D]: the policy's features of these images (`MegatronPolicy.image_features`), set only
           for a rollout engine that takes features instead of pixels (vLLM); never part of a batch.
    A prompt without images: P = 0 (and I = 0)."""

    values: Tensor
    grid: Tensor | None = None
    features: Tensor | None = None

    @property
    def count(self) -> int:
        """I, the number of images."""
        return len(self.grid) if self.grid is not None else len(self.values)

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.grid is None else self.grid.nbytes)


@dataclass
class PromptImages:
    """The images of G prompts, each prompt's once: its `Pixels` one after the other.

    values [sum P_g, *S]; rows [G] long (P_g: prompt g's pixel rows); counts [G] long (I_g: its images);
    grid [sum I_g, 3] long or None (LLaVA). Every prompt's S is the same (the processor's)."""

    values: Tensor
    rows: Tensor
    counts: Tensor
    grid: Tensor | None = None

    @classmethod
    def of(cls, prompts: list[Pixels]) -> PromptImages:
        """From each prompt's pixels, in order (ValueError when their row shapes S differ)."""
        if not prompts:
            raise ValueError("PromptImages.of: no prompts")
        shapes = {tuple(p.values.shape[1:]) for p in prompts}
        if len(shapes) > 1:
            raise ValueError(
                f"PromptImages.of: the prompts' pixel rows differ in shape {sorted(shapes)}; the image processor "
                "must give every image rows of the model's shape, and a prompt without images [0, *S] of that shape "
                "(as prompts.PromptEncoder does)"
            )
        grids = [p.grid for p in prompts if p.grid is not None]
        return cls(
            values=torch.cat([p.values.float() for p in prompts]),
            rows=torch.tensor([len(p.values) for p in prompts], dtype=torch.long),
            counts=torch.tensor([p.count for p in prompts], dtype=torch.long),
            grid=torch.cat(grids).long() if grids else None,
        )

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def prompt(self, g: int) -> Pixels:
        """Prompt g's pixels."""
        return self.pixels_of([g])[0]

    def select(self, prompts: list[int]) -> PromptImages:
        """The images of `prompts` (indices into this), in that order."""
        return PromptImages.of(self.pixels_of(prompts)) if prompts else self._empty()

    def pixels_of(self, prompts: list[int]) -> list[Pixels]:
        """The `Pixels` of `prompts` (indices into this), in that order (one pass over the offsets)."""
        row_at = [0, *self.rows.cumsum(0).tolist()]
        image_at = [0, *self.counts.cumsum(0).tolist()]
        out = []
        for g in prompts:
            values = self.values[row_at[g] : row_at[g + 1]]
            out.append(
                Pixels(values, None if self.grid is None else self.grid[image_at[g] : image_at[g + 1]])
            )
        return out

    def _empty(self) -> PromptImages:
        none = torch.zeros(0, dtype=torch.long)
        grid = None if self.grid is None else self.grid[:0]
        return PromptImages(self.values[:0], none, none.clone(), grid)

    @classmethod
    def cat(cls, parts: list[PromptImages]) -> PromptImages:
        """The prompts of `parts`, one part after the other."""
        grids = [p.grid for p in parts if p.grid is not None]
        return cls(
            values=torch.cat([p.values for p in parts]),
            rows=torch.cat([p.rows for p in parts]),
            counts=torch.cat([p.counts for p in parts]),
            grid=torch.cat(grids) if grids else None,
        )

    def tensors(self) -> list[Tensor]:
        """values, rows, counts (and grid): what a message between ranks carries (`from_tensors` inverts)."""
        return [self.values, self.rows, self.counts] + ([] if self.grid is None else [self.grid])

    @classmethod
    def from_tensors(cls, tensors: list[Tensor]) -> PromptImages:
        return cls(*tensors)  # type: ignore[arg-type]


def prompt_images(pixels: list[Pixels], repeat: int) -> tuple[PromptImages, Tensor]:
    """Per prompt pixels (G prompts, each with `repeat` consecutive samples) -> (`images`, `image_prompt`
    [G * repeat] long: row i's prompt is i // repeat)."""
    return PromptImages.of(pixels), torch.arange(len(pixels)).repeat_interleave(repeat)


@dataclass
class RolloutBatch:
    """One group's samples through the step (shapes in the module docstring)."""

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_logp: Tensor
    prompt_width: int
    group_size: int
    rewards: Tensor | None = None
    greedy_rewards: Tensor | None = None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    values: Tensor | None = None
    tis_weights: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    overlong_penalty: Tensor | None = None
    image_prompt: Tensor | None = None
    images: PromptImages | None = None
    truncated: int = 0  # responses cut at rollout.max_new_tokens
    prompts_clipped: int = 0  # prompts longer than data.max_prompt_tokens (kept their last tokens)
    counters: dict[str, float] = field(default_factory=dict)  # the controller's GenRM and memory counters

    @property
    def size(self) -> int:
        """N, the number of samples."""
        return int(self.input_ids.shape[0])

    def response(self, per_position: Tensor) -> Tensor:
        """The response part [N, R] of a per-position output [N, P + R - 1] (log-probs, entropies, values)."""
        return per_position[:, self.prompt_width - 1 :]

    def rows(self, index: Tensor) -> RolloutBatch:
        """The samples at `index` (a mini-batch); per-prompt fields (`greedy_rewards`) are dropped, the images
        of the prompts the rows name are kept (`image_prompt` renumbered in ascending prompt order)."""
        picked = {name: getattr(self, name)[index] for name in ROW_FIELDS if getattr(self, name) is not None}
        images = self.images
        if images is not None and self.image_prompt is not None:
            used = picked["image_prompt"].unique()  # sorted
            images = images.select(used.tolist())
            picked["image_prompt"] = torch.searchsorted(used, picked["image_prompt"])
        return dataclasses.replace(self, greedy_rewards=None, images=images, **picked)

    def image_inputs(self) -> dict:
        """What the trainer's passes take besides the tokens: {"image_prompt", "images"} ({} for text)."""
        if self.images is None:
            return {}
        return {"image_prompt": self.image_prompt, "images": self.images}

    def tensors(self) -> dict[str, Tensor]:
        """The per-sample tensors that are set, by name: what the trainer's micro-batches slice."""
        return {name: getattr(self, name) for name in ROW_FIELDS if getattr(self, name) is not None}


def pack(
    prompts: list[list[int]],
    responses: list[list[int]],
    logprobs: list[list[float]],
    pad_id: int,
    group_size: int = 1,
) -> RolloutBatch:
    """The padded tensors of `prompts[i]` + `responses[i]` (see the module docstring); `pad_id` is the
    tokenizer's (padding is masked out everywhere, so any id in the vocabulary works)."""
    if not (len(prompts) == len(responses) == len(logprobs)):
        raise ValueError(
            f"pack: {len(prompts)} prompts, {len(responses)} responses, {len(logprobs)} logprob lists"
        )
    n = len(prompts)
    width_p = max(len(p) for p in prompts)
    width_r = max(1, max(len(r) for r in responses))
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(n, width_r, dtype=torch.float32)
    rollout_logp = torch.zeros(n, width_r, dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, logprobs)):
        input_ids[i, width_p - len(p) : width_p] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width_p - len(p) : width_p] = 1
        if r:
            input_ids[i, width_p : width_p + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width_p : width_p + len(r)] = 1
            response_mask[i, : len(r)] = 1.0
            rollout_logp[i, : len(r)] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(input_ids, attention_mask, response_mask, rollout_logp, width_p, group_size)


FULL_WIDTH_FIELDS = ("input_ids", "attention_mask")  # [N, P + R]; the other 2-D row fields are [N, R]


def pad_to(batch: RolloutBatch, prompt_width: int, response_width: int, pad_id: int = 0) -> RolloutBatch:
    """`batch` re-padded to widths P' >= P and R' >= R: prompts LEFT-padded (P' - P columns in front),
    responses RIGHT-padded (R' - R columns behind). New columns hold `pad_id` in `input_ids` and 0 in every
    other field, so the masks are unchanged on real tokens and the old row is `new[:, P'-P : P'+R]` ([N, R]
    fields: `new[:, :R]`). [N] fields (`rewards`) and the per-prompt / scalar fields are kept as they are."""
    old_r = batch.input_ids.shape[1] - batch.prompt_width
    left, right = prompt_width - batch.prompt_width, response_width - old_r
    if left < 0 or right < 0:
        raise ValueError(
            f"pad_to: widths ({prompt_width}, {response_width}) are narrower than the batch's "
            f"({batch.prompt_width}, {old_r}); padding only widens"
        )
    if left == right == 0:
        return batch
    padded = {}
    for name, value in batch.tensors().items():
        if value.ndim < 2:
            continue
        before = left if name in FULL_WIDTH_FIELDS else 0
        fill = pad_id if name == "input_ids" else 0
        out = value.new_full((value.shape[0], value.shape[1] + before + right), fill)
        out[:, before : before + value.shape[1]] = value
        padded[name] = out
    return dataclasses.replace(batch, prompt_width=prompt_width, **padded)  # type: ignore[arg-type]


def concat(batches: list[RolloutBatch], pad_id: int = 0) -> RolloutBatch:
    """The samples of `batches` one after the other ([sum N_i, max P_i + max R_i]), each re-padded by `pad_to`
    to the widest prompt and the widest response. Every batch must set the same row fields. `greedy_rewards`
    is dropped (it is per prompt of one batch); `truncated` and `prompts_clipped` are summed; `group_size` and
    `counters` come from the first batch."""
    if not batches:
        raise ValueError("concat: no batches to join")
    names = [sorted(b.tensors()) for b in batches]
    if any(n != names[0] for n in names):
        raise ValueError(f"concat: the batches set different row fields: {names}")
    width_p = max(b.prompt_width for b in batches)
    width_r = max(b.input_ids.shape[1] - b.prompt_width for b in batches)
    padded = [pad_to(b, width_p, width_r, pad_id) for b in batches]
    joined = {name: torch.cat([b.tensors()[name] for b in padded]) for name in names[0]}
    images = None
    if batches[0].images is not None:
        parts = [b.images for b in batches if b.images is not None]
        if len(parts) != len(batches):
            raise ValueError(
                "concat: some batches have images and some do not (a text batch of a vision run?)"
            )
        offsets = torch.tensor([0] + [len(p) for p in parts[:-1]]).cumsum(0)
        joined["image_prompt"] = torch.cat([b.tensors()["image_prompt"] + o for b, o in zip(padded, offsets)])
        images = PromptImages.cat(parts)
    return dataclasses.replace(
        batches[0],
        prompt_width=width_p,
        greedy_rewards=None,
        truncated=sum(b.truncated for b in batches),
        prompts_clipped=sum(b.prompts_clipped for b in batches),
        counters=dict(batches[0].counters),
        images=images,
        **joined,  # type: ignore[arg-type]
    )
