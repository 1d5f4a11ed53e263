"""Rotary position embedding (rotate-half form) for MLA configs with `mla_use_nope: false`."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, ..., R] rotated by position [T]; R must be even."""
    r = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, r, 2, device=x.device, dtype=torch.float32) / r))
    ang = positions.to(torch.float32)[:, None] * inv[None]              # [T, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x.float()[..., : r // 2], x.float()[..., r // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
