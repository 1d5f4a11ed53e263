"""Causal depthwise conv1d over packed variable-length sequences with carried windows.

Legend: T tokens, B sequences, K kernel, C channels, Lc longest sequence.
"""

from __future__ import annotations

import torch


def causal_conv1d_packed(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor,
    groups: list[tuple[torch.Tensor, torch.Tensor]], window_idx: torch.Tensor,
    extra_window_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T,C] new inputs, window [B,K-1,C] the inputs before them, weight [C,K].

    `groups` splits the sequences into consecutive runs of similar length (decode rows, prefill
    rows), each padded only to its own longest: (pad_idx [b, K-1+Lc] rows of
    ext = cat(window.view(B*(K-1), C), x, zero row), unpad_idx [t] flat rows of that group's
    [b*Lc] output, in packed order). Each group is convolved without padding and the groups'
    outputs are concatenated, so the groups must cover the tokens in order. window_idx [B,K-1]
    picks the window after this step. The indices come from `build_forward_batch`. Returns the
    conv output [T,C] (no activation), the new window, and the windows at extra_window_idx
    [S,K-1] (snapshots inside the step) when given.
    """
    ext = _extended(x, window)
    c = x.shape[-1]
    k = weight.shape[-1]
    w = weight.to(x.dtype)
    outs = []
    for pad_idx, unpad_idx in groups:
        padded = ext[pad_idx]                                            # [b, K-1+Lc, C]
        lc = padded.shape[1] - k + 1
        # K shifted multiply-adds: a depthwise conv call costs ~100 us even for one decode token
        out = padded[:, :lc] * w[:, 0]
        for j in range(1, k):
            out.addcmul_(padded[:, j:j + lc], w[:, j])
        out = out.reshape(-1, c)
        outs.append(out if unpad_idx is None else out[unpad_idx])
    out = torch.cat(outs, 0) if len(outs) > 1 else outs[0]
    extra = ext[extra_window_idx] if extra_window_idx is not None else None
    return out, ext[window_idx], extra


def _extended(x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The conv input rows every index here points into: cat(window rows, x, a zero row)."""
    c = x.shape[-1]
    return torch.cat([window.reshape(-1, c).to(x.dtype), x, x.new_zeros(1, c)], 0)


def conv_input_rows(x: torch.Tensor, window: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Conv windows at positions inside the step ([S, K-1] rows from `build_forward_batch`,
    e.g. snapshot windows) without running the conv."""
    return _extended(x, window)[idx]
