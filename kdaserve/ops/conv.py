"""Causal depthwise conv1d over packed variable-length sequences with carried windows.

Legend: T tokens, B sequences, K kernel, C channels.
"""

from __future__ import annotations

import torch


def causal_conv1d_packed(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
    conv_idx: torch.Tensor, window_idx: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T,C] new inputs, window [B,K-1,C] the inputs before them, weight [C,K].

    conv_idx [T,K] / window_idx [B,K-1] index rows of cat(window.view(B*(K-1), C), x) (built once
    per step by `build_forward_batch`). Returns the conv output [T,C] (no activation) and the
    window after this step [B,K-1,C].
    """
    ext = torch.cat([window.reshape(-1, x.shape[-1]).to(x.dtype), x], 0)
    out = torch.einsum("tkc,ck->tc", ext[conv_idx], weight.to(x.dtype))
    return out, ext[window_idx]
