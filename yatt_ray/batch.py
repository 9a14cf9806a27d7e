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
`advantages`, `returns` [N, R].

Image prompts (a vision-language policy) add, from the rollout on: `pixel_values` [N, I, 3, H, W] float32, row
i's images (its prompt's, repeated for each of the prompt's samples; I the most images of any row, unused
slots zero; I = 0 when no row has one) and `image_count` [N] long, how many of the I are row i's (0 for a row
without images: a text row, whose pixels the trainer never encodes). The images' tokens are already in
`input_ids` (each image expanded to its tokens), so the trainer swaps their embeddings for image features.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

ROW_FIELDS = (
    "input_ids", "attention_mask", "response_mask", "rollout_logp", "rewards",
    "old_logp", "ref_logp", "values", "tis_weights", "advantages", "returns", "pixel_values", "image_count",
)  # fmt: skip
IMAGE_FIELDS = ("pixel_values", "image_count")  # no token width: padding leaves them as they are


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
    pixel_values: Tensor | None = None
    image_count: Tensor | None = None
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
        """The samples at `index` (a mini-batch); per-prompt fields (`greedy_rewards`) are dropped."""
        picked = {name: getattr(self, name)[index] for name in ROW_FIELDS if getattr(self, name) is not None}
        return dataclasses.replace(self, greedy_rewards=None, **picked)

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
        if value.ndim < 2 or name in IMAGE_FIELDS:
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
    slots = max_images(batches)
    padded = [pad_images(pad_to(b, width_p, width_r, pad_id), slots) for b in batches]
    joined = {name: torch.cat([b.tensors()[name] for b in padded]) for name in names[0]}
    return dataclasses.replace(
        batches[0],
        prompt_width=width_p,
        greedy_rewards=None,
        truncated=sum(b.truncated for b in batches),
        prompts_clipped=sum(b.prompts_clipped for b in batches),
        counters=dict(batches[0].counters),
        **joined,  # type: ignore[arg-type]
    )


def max_images(batches: list[RolloutBatch]) -> int:
    """The most image slots I of any of `batches` (0 for text batches)."""
    return max((b.pixel_values.shape[1] for b in batches if b.pixel_values is not None), default=0)


def pad_images(batch: RolloutBatch, slots: int) -> RolloutBatch:
    """`batch` with `pixel_values` widened to `slots` image slots ([N, I, 3, H, W] -> [N, slots, 3, H, W], new
    slots zero; `image_count` unchanged); a text batch, or one with `slots` already, is returned as it is."""
    pixels = batch.pixel_values
    if pixels is None or pixels.shape[1] == slots:
        return batch
    if pixels.shape[1] > slots:
        raise ValueError(f"pad_images: the batch has {pixels.shape[1]} image slots, more than {slots}")
    wide = pixels.new_zeros((pixels.shape[0], slots, *pixels.shape[2:]))
    wide[:, : pixels.shape[1]] = pixels
    return dataclasses.replace(batch, pixel_values=wide)


def stack_images(pixels: list[Tensor], repeat: int) -> tuple[Tensor, Tensor]:
    """Per prompt pixels [I_g, C, H, W] (G prompts; I_g = 0 for a prompt without images) -> (`pixel_values`
    [G * repeat, I, C, H, W], each prompt's repeated for its `repeat` samples, I = max I_g (0 when no prompt
    has an image), unused slots zero; `image_count` [G * repeat] long). Every prompt's pixels have the same
    (C, H, W), its images' or, without images, the model's (`prompts.PromptEncoder` gives it), so batches of
    any mix of prompts join (`concat`, the balance exchange)."""
    if not pixels:
        raise ValueError("stack_images: no prompts")
    shapes = {tuple(p.shape[1:]) for p in pixels}
    if len(shapes) > 1:
        raise ValueError(
            f"stack_images: the prompts' pixels differ in shape [I, C, H, W] {sorted(shapes)}; the image "
            "processor must give every image the model's size, and a prompt without images [0, C, H, W] of "
            "that size (as prompts.PromptEncoder does)"
        )
    out = torch.zeros((len(pixels), max(len(p) for p in pixels), *shapes.pop()), dtype=torch.float32)
    for g, p in enumerate(pixels):
        out[g, : len(p)] = p
    count = torch.tensor([len(p) for p in pixels], dtype=torch.long)
    return out.repeat_interleave(repeat, dim=0), count.repeat_interleave(repeat)
