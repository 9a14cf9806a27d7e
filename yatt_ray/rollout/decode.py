"""Sampling with each prompt prefilled once and finished rows dropped: the HF engine's loop for text models.

`transformers.generate` runs the n copies of a prompt through prefill (n times the prompt's work) and keeps
every row in the batch until the longest is done (a finished row still costs a full decode step). At RL shapes
(n samples of a prompt, lengths with a long tail) that is most of a rollout's work: for two-digit sums
(prompts of ~8 tokens, completions of 3.5 tokens on average and at most 16), 32 prompts x 8 samples run
256 x (8 + 16) token positions through the model for 256 x 3.5 sampled tokens. `sample_groups` instead runs

  1. prefill: the P distinct prompts, left-padded into [P, W] (attention mask; positions from 0 at each
     prompt's first real token), once, with the logits of the last position only;
  2. fork: the KV cache and the last logits repeated n times (row r belongs to prompt r // n);
  3. decode: each step samples a token for every live row and records its raw log-prob; rows that produced a
     stop token or reached `max_new_tokens` leave the batch (their cache rows are dropped) and one forward
     runs over the others' new tokens,

so the model runs sum_p |p| + sum_r (|completion_r| - 1) token positions: 256 + 640 for the example above,
against generate's 6,144. Sampling follows HF's order and warpers (logits / temperature, top-k, top-p, then a
multinomial draw from the softmax); temperature 0 is argmax. Log-probs are `log_softmax` (float32) of the raw
logits at the sampled token, as `HFEngine` documents. Randomness comes from the global torch generator, which
the caller swaps (`PrivateRng.active`); the draws differ from `generate`'s (fewer rows draw each step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from yatt_ray.rollout.base import Completion, FinishReason, InFlightWeights, SamplingSpec

OnGroup = Callable[[int, list[Completion]], None]  # (prompt index within the call, its n completions)


def warpers(spec: SamplingSpec) -> LogitsProcessorList:
    """HF's sampling warpers for `spec` (temperature, then top-k, then top-p; absent when off)."""
    out = LogitsProcessorList()
    if spec.greedy:
        return out
    if spec.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(spec.temperature)))
    if spec.top_k != -1:
        out.append(TopKLogitsWarper(spec.top_k))
    if spec.top_p < 1.0:
        out.append(TopPLogitsWarper(float(spec.top_p)))
    return out


def next_tokens(
    logits: torch.Tensor, spec: SamplingSpec, warp: LogitsProcessorList
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step: raw logits [B, V] -> (tokens [B] long, their raw log-probs [B] float32)."""
    raw = logits.float()
    if spec.greedy:
        tokens = raw.argmax(dim=-1)
    else:
        scores = warp(None, raw.clone())  # type: ignore[arg-type]  # the warpers ignore input_ids
        tokens = torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
    logprobs = torch.log_softmax(raw, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


def _prefill(model: torch.nn.Module, rows: Sequence[list[int]], pad_id: int, device: torch.device):
    """One forward over `rows` left-padded into [B, W] -> (its output: logits of the last position and the KV
    cache, attention mask [B, W], the next token's position [B])."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    return out, mask, positions[:, -1] + 1


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    prompts: Sequence[list[int]],
    spec: SamplingSpec,
    stops: Sequence[int],
    pad_id: int,
    on_group: OnGroup | None = None,
    enough: Callable[[], bool] | None = None,
    updates: InFlightWeights | None = None,
    version: Any = None,
) -> tuple[list[list[Completion] | None], Any]:
    """`spec.n` completions of each prompt (see the module docstring) -> (one list per prompt, or None for a
    prompt whose rows were cut short: `enough()`, asked after each prompt completes, ends the loop when true;
    the label of the weights at the end).

    model: a Hugging Face causal LM (forward with attention_mask, position_ids, past_key_values,
    logits_to_keep). `on_group(i, completions)` is called as soon as prompt i's n rows are all finished.

    In-flight weight updates: before each decode forward, when `updates.ready()`, `updates.take()` loads the
    new weights into `model` and the live rows continue under them with their prefix kept: prompt + the
    tokens so far are prefilled again (a fresh KV cache) and the next token is sampled from the new weights'
    logits. Each completion's `versions` holds, per token, the label of the weights that sampled it
    (`version` until the first update); None without `updates`.
    """
    device = next(model.parameters()).device
    n, stop_set = spec.n, torch.tensor(sorted(set(stops)), dtype=torch.long, device=device)
    out, mask, next_position = _prefill(model, prompts, pad_id, device)
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    logits = out.logits[:, -1].repeat_interleave(n, dim=0)  # [P * n, V]
    mask, next_position = mask.repeat_interleave(n, dim=0), next_position.repeat_interleave(n)
    live = torch.arange(len(prompts) * n, device=device)  # row index of each batch entry
    rows = _Rows(len(prompts), n, updates is not None, on_group, enough)
    warp = warpers(spec)
    for step in range(spec.max_new_tokens):
        tokens, logprobs = next_tokens(logits, spec, warp)
        stopped = (
            torch.isin(tokens, stop_set) if len(stop_set) else torch.zeros_like(tokens, dtype=torch.bool)
        )
        done = stopped | (step + 1 == spec.max_new_tokens)
        if rows.record(live, tokens, logprobs, done, stopped, version) or bool(done.all()):
            break
        keep = (~done).nonzero()[:, 0]
        live, tokens = live[keep], tokens[keep]
        if updates is not None and updates.ready():  # new weights: prompt + prefix again, under them
            version = updates.take()
            prefixed = [list(prompts[r // n]) + rows.tokens[r] for r in live.tolist()]
            out, mask, next_position = _prefill(model, prefixed, pad_id, device)
        else:
            dropped = len(keep) < len(done)
            out, mask, next_position = _decode(
                model, cache, tokens, mask, next_position, keep if dropped else None
            )
        cache, logits = out.past_key_values, out.logits[:, -1]
    return rows.groups, version


def _decode(
    model: torch.nn.Module,
    cache: Any,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    next_position: torch.Tensor,
    keep: torch.Tensor | None,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One decode forward over the live rows' new `tokens` [B] on the KV `cache`, after dropping the rows
    outside `keep` (batch entries; None: all stay) from it -> (its output, attention mask, next positions)."""
    if keep is not None:
        cache.batch_select_indices(keep)
        mask, next_position = mask[keep], next_position[keep]
    mask = torch.cat([mask, mask.new_ones(len(tokens), 1)], dim=1)
    out = model(
        input_ids=tokens[:, None],
        attention_mask=mask,
        position_ids=next_position[:, None],
        past_key_values=cache,
        use_cache=True,
    )
    return out, mask, next_position + 1


class _Rows:
    """The rows of one `sample_groups` call (row r: sample r % n of prompt r // n): each row's tokens, raw
    log-probs and weight labels so far, its `Completion` once finished, and each prompt's group once its n rows
    are (`groups`, handed to `on_group`). `labelled`: completions carry their tokens' weight labels."""

    def __init__(
        self,
        prompts: int,
        n: int,
        labelled: bool,
        on_group: OnGroup | None,
        enough: Callable[[], bool] | None,
    ) -> None:
        self.n, self.labelled, self.on_group, self.enough = n, labelled, on_group, enough
        self.tokens: list[list[int]] = [[] for _ in range(prompts * n)]
        self.logprobs: list[list[float]] = [[] for _ in range(prompts * n)]
        self.versions: list[list[Any]] = [[] for _ in range(prompts * n)]
        self.finished: list[Completion | None] = [None] * (prompts * n)
        self.left = [n] * prompts  # rows of each prompt not finished yet
        self.groups: list[list[Completion] | None] = [None] * prompts

    def record(
        self, live: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, done: torch.Tensor,
        stopped: torch.Tensor, version: Any,
    ) -> bool:  # fmt: skip
        """One step's sampled token of each live row (`live`: row indices) under weights `version`; the rows
        `done` finish ("stop" where `stopped`, else "length"). Whether `enough()`, asked after each prompt
        completes, ends the call."""
        ended = False
        for row, tok, lp, is_done, is_stop in zip(
            live.tolist(), tokens.tolist(), logprobs.tolist(), done.tolist(), stopped.tolist()
        ):
            self.tokens[row].append(tok)
            self.logprobs[row].append(lp)
            self.versions[row].append(version)
            if is_done and self._finish(row, "stop" if is_stop else "length"):
                ended = ended or (self.enough is not None and self.enough())
        return ended

    def _finish(self, row: int, reason: FinishReason) -> bool:
        """Row `row`'s completion; whether it completed its prompt's group (handed to `on_group`)."""
        versions = self.versions[row] if self.labelled else None
        self.finished[row] = Completion(self.tokens[row], self.logprobs[row], reason, versions)
        prompt = row // self.n
        self.left[prompt] -= 1
        if self.left[prompt]:
            return False
        group = [c for c in self.finished[prompt * self.n : (prompt + 1) * self.n] if c is not None]
        self.groups[prompt] = group
        if self.on_group is not None:
            self.on_group(prompt, group)
        return True
