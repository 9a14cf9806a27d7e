"""Reward functions for fault drills (named by dotted path `drill_rewards:...` from release/ scripts)."""

from __future__ import annotations

POISON = "7"  # answers ending in this digit are the ones the faulty reward cannot score


def exact_match_but_fails_on_seven(response: str, ground_truth: str, data_source: str = "") -> float:
    """Exact match, except that it raises on every sample whose ground truth ends in 7 (a user's bug; one
    answer in ten in the demo task)."""
    if ground_truth.strip().endswith(POISON):
        raise ValueError(f"cannot parse the answer for ground truth {ground_truth!r}")
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
