"""The rollout phase's draws: over-sampling with abort, and dynamic sampling's group filter.

A controller needs `share` prompt groups a step. Each draw starts `ceil(over_sample x need)` prompts, where
`need` is what it still lacks; the engine stops as soon as `need` groups have all their samples and aborts
the rest (the long tail), which go back to the front of the group's queue unconsumed. Groups are taken in
finish order; those that finished past the need are taken by the next round of the same step (dynamic
sampling), or go back to the queue too. With dynamic sampling
(DAPO's filter) a scored group whose samples all score the same carries no signal for a group baseline (every
advantage is 0), so it is dropped (consumed) and the controller draws again, at most `algo.max_draws` times a
step. A prompt aborted `rollout.max_aborts` times is not aborted again: the engine waits for it before it
aborts the others (that step pays its tail), so no prompt waits in the queue for ever. Where a prompt's
length is fixed (every sample as long), that bounds what over-sampling can save: in steady state a step
keeps waiting for some long prompt; where lengths vary from sample to sample, a restart often finishes early. The pure pieces live here; the collector (`collector.RolloutCollector`) drives the engine, the scorer
and the feed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from yatt_ray.config import DynamicSampling
from yatt_ray.data.feed import FeedRow
from yatt_ray.reward.scorer import Sample
from yatt_ray.rollout.base import Completion


@dataclass
class Group:
    """One prompt's samples through the rollout phase: its row, token ids, completions and rewards."""

    row: FeedRow
    prompt_ids: list[int]
    clipped: bool  # the prompt was longer than data.max_prompt_tokens (kept its last tokens)
    completions: list[Completion]
    samples: list[Sample]
    streamed: bool = False  # already submitted to the GenRM as it finished (partial, disaggregated)
    rewards: list[float] = field(default_factory=list)
    pixels: Any = None  # the prompt's images, [I, 3, H, W] float32 (a vision-language policy), else None


def groups_to_finish(need: int, keep_rate: float = 1.0) -> int:
    """ceil(need / keep_rate): the groups a draw finishes so that about `need` pass the filter; `keep_rate`
    (dynamic sampling: the fraction of groups kept lately, floored at 0.1; 1 without it) makes one draw
    usually enough."""
    return math.ceil(need / max(keep_rate, 0.1) - 1e-9) if need > 0 else 0


def prompts_to_start(target: int, over_sample: float) -> int:
    """ceil(over_sample x target): the prompts a draw starts to finish `target` groups (0 for none)."""
    return math.ceil(over_sample * target - 1e-9) if target > 0 else 0


def is_informative(rewards: list[float], metric: DynamicSampling) -> bool:
    """True when the group's `metric` varies: "reward" (the rewards) or "accuracy" (reward >= 1, correct or
    not). A group where every sample scores the same gets zero advantage from any group baseline."""
    values = rewards if metric == "reward" else [float(r >= 1.0) for r in rewards]
    return max(values) != min(values)


def split_finished(
    order: list[int], count: int, pinned: frozenset[int] = frozenset()
) -> tuple[list[int], list[int]]:
    """(finished, aborted) of the `count` prompts started: the finished ones in finish `order` with the `pinned`
    ones (aborted `rollout.max_aborts` times, kept whatever their finish) first; the rest, in prompt order."""
    finished = [i for i in order if i in pinned] + [i for i in order if i not in pinned]
    done = set(finished)
    return finished, [i for i in range(count) if i not in done]


def top_up(kept: list[Group], dropped: list[Group], share: int) -> list[Group]:
    """The step's groups: the informative ones, then (when the draws ran out) the latest dropped ones up to
    `share`, so every group trains a full batch; dropped groups have zero advantage under a group baseline."""
    missing = max(share - len(kept), 0)
    return kept + (dropped[len(dropped) - missing :] if missing else [])
