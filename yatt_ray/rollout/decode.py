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
    rows_tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    rows_logprobs: list[list[float]] = [[] for _ in range(len(prompts) * n)]
    rows_versions: list[list[Any]] = [[] for _ in range(len(prompts) * n)]
    finished: list[Completion | None] = [None] * (len(prompts) * n)
    left = [n] * len(prompts)
    groups: list[list[Completion] | None] = [None] * len(prompts)
    warp = warpers(spec)
    for step in range(spec.max_new_tokens):
        tokens, logprobs = next_tokens(logits, spec, warp)
        stopped = (
            torch.isin(tokens, stop_set) if len(stop_set) else torch.zeros_like(tokens, dtype=torch.bool)
        )
        done = stopped | (step + 1 == spec.max_new_tokens)
        ended = False
        for row, tok, lp, is_done, is_stop in zip(
            live.tolist(), tokens.tolist(), logprobs.tolist(), done.tolist(), stopped.tolist()
        ):
            rows_tokens[row].append(tok)
            rows_logprobs[row].append(lp)
            rows_versions[row].append(version)
            if not is_done:
                continue
            reason: FinishReason = "stop" if is_stop else "length"
            versions = None if updates is None else rows_versions[row]
            finished[row] = Completion(rows_tokens[row], rows_logprobs[row], reason, versions)
            prompt = row // n
            left[prompt] -= 1
            if left[prompt] == 0:
                groups[prompt] = [c for c in finished[prompt * n : (prompt + 1) * n] if c is not None]
                if on_group is not None:
                    on_group(prompt, groups[prompt])
                ended = ended or (enough is not None and enough())
        if ended or bool(done.all()):
            break
        keep = (~done).nonzero()[:, 0]
        live, tokens = live[keep], tokens[keep]
        if updates is not None and updates.ready():  # new weights: prompt + prefix again, under them
            version = updates.take()
            rows = [list(prompts[r // n]) + rows_tokens[r] for r in live.tolist()]
            out, mask, next_position = _prefill(model, rows, pad_id, device)
        else:
            if len(keep) < len(done):
                cache.batch_select_indices(keep)
                mask, next_position = mask[keep], next_position[keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            next_position = next_position + 1
        cache, logits = out.past_key_values, out.logits[:, -1]
    return groups, version
