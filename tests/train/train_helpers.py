"""Batch and loss builders shared by the in-process and the spawned (multi-rank) tests."""

from __future__ import annotations

import torch


def make_batch(n_rows: int = 4, length: int = 10, seed: int = 0, left_pad: bool = True) -> dict:
    """A padded batch: input_ids [n, T], attention_mask [n, T] (row i has i pads), advantages [n]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (n_rows, length), generator=g)
    mask = torch.ones(n_rows, length, dtype=torch.long)
    for i in range(n_rows):
        pads = i % (length - 3)
        if pads:
            cols = slice(0, pads) if left_pad else slice(length - pads, length)
            mask[i, cols] = 0
            ids[i, cols] = 0
    return {"input_ids": ids, "attention_mask": mask, "advantages": torch.randn(n_rows, generator=g)}


def make_loss_fn(global_tokens: float, entropy_coef: float = 0.01):
    """A policy-gradient-like loss over real next tokens, divided by the GLOBAL token count."""

    def loss_fn(logp, entropy, mb):
        mask = mb["attention_mask"][:, 1:].float()
        per_token = -mb["advantages"][:, None] * logp - entropy_coef * entropy
        loss = (per_token * mask).sum() / global_tokens
        return loss, {"loss": loss.detach(), "tokens": mask.sum()}

    return loss_fn


def make_value_batch(n_rows: int = 4, length: int = 10, seed: int = 0, left_pad: bool = True) -> dict:
    """`make_batch` plus returns [n, T-1]: the regression target of the value at each column."""
    batch = make_batch(n_rows, length, seed, left_pad)
    g = torch.Generator().manual_seed(seed + 100)
    batch["returns"] = torch.randn(n_rows, length - 1, generator=g)
    return batch


def make_value_loss_fn(global_tokens: float):
    """0.5 * (V - return)^2 over columns whose next token is real, divided by the GLOBAL token count."""

    def loss_fn(values, mb):
        mask = mb["attention_mask"][:, 1:].float()
        loss = (0.5 * (values - mb["returns"]).pow(2) * mask).sum() / global_tokens
        return loss, {"loss": loss.detach(), "tokens": mask.sum()}

    return loss_fn


def real_tokens(batch: dict) -> float:
    """The normaliser of both losses: real next tokens in the whole batch."""
    return float(batch["attention_mask"][:, 1:].sum())
