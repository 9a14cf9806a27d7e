"""Move padding out of the way before a Megatron forward, and put per-token results back afterwards.

Megatron's RoPE ignores `position_ids`: token i of the input always gets rotary position i. A left-padded row
would then put its first real token at position (number of pads), unlike the unpadded sequence. So each row is
packed: its real tokens (attention_mask == 1) move to the front in their original order and the padding to
the back. Every real token then sits at position cumsum(mask) - 1, exactly where it sits without padding,
and right-padding only trails the causal attention of real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Rows with real tokens first.

    input_ids [B, L] and real [B, L] (True = real token) are trimmed to L = the longest row (at least 2,
    at most T); order [B, T] maps packed column j to the original column order[:, j].
    """

    input_ids: torch.Tensor
    real: torch.Tensor
    order: torch.Tensor

    @property
    def position_ids(self) -> torch.Tensor:
        """[B, L] positions 0..L-1 (= cumsum(mask) - 1 of the original row for every real token)."""
        b, length = self.input_ids.shape
        return torch.arange(length, device=self.input_ids.device).expand(b, length)

    def attention_mask(self) -> torch.Tensor:
        """[B, 1, L, L] bool, True = masked: causal, and padding keys (a query always sees itself)."""
        length = self.input_ids.shape[1]
        ones = torch.ones(length, length, dtype=torch.bool, device=self.real.device)
        future = torch.triu(ones, diagonal=1)
        pad_key = ~self.real[:, None, None, :] & ~torch.eye(length, dtype=torch.bool, device=self.real.device)
        return future[None, None] | pad_key


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack [B, T] rows (T >= 2) so real tokens come first; see `PackedRows`."""
    real = attention_mask.bool()
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real columns first, order kept
    length = min(max(int(real.sum(dim=1).max()), 2), input_ids.shape[1])
    return PackedRows(
        input_ids=input_ids.gather(1, order)[:, :length],
        real=real.gather(1, order)[:, :length],
        order=order,
    )


def unpack_next_token_values(packed: PackedRows, values: torch.Tensor, total_len: int) -> torch.Tensor:
    """Scatter per-next-token values back to the original layout.

    values [B, L-1]: values[:, j] is about predicting packed token j+1 (from packed tokens 0..j).
    Returns [B, total_len-1] where column t holds the value for predicting original token t+1; columns whose
    next token is padding are 0. Differentiable w.r.t. `values`.
    """
    b, length = packed.input_ids.shape
    target_real = packed.real[:, 1:]  # [B, L-1]
    # The value predicting original token order[j+1] belongs in the column just before it; values whose
    # target is padding go to a spare column (total_len - 1) that is cut off at the end.
    columns = torch.where(target_real, packed.order[:, 1:length] - 1, total_len - 1)
    src = torch.where(target_real, values, torch.zeros_like(values))
    out = torch.zeros(b, total_len, dtype=values.dtype, device=values.device)
    return out.scatter(1, columns, src)[:, : total_len - 1]
