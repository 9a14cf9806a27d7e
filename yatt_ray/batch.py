"""Pack prompts and their sampled responses into the padded tensors the trainer consumes.

Layout for N samples, prompts left-padded to width P and responses right-padded to width R:

    input_ids       [N, P + R]   <pad>.. prompt | response ..<pad>
    attention_mask  [N, P + R]   1 on real tokens
    response_mask   [N, R]       1 on real response tokens
    rollout_logp    [N, R]       the engine's log-probability of each sampled token (0 on padding)

The policy's log-probs `logp[:, t]` score token t+1, so the response part is `logp[:, P-1:]` ([N, R]).
"""

from __future__ import annotations

import torch

from yatt_ray.models.tiny import PAD_ID


def pack(
    prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]], pad_id: int = PAD_ID
):
    """Padded tensors (dict, see module docstring) and the prompt width P."""
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
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "rollout_logp": rollout_logp,
    }
    return batch, width_p
