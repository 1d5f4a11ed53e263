"""Rotary position embedding for MLA configs with `mla_use_nope: false` (the drafts).

Two pairings: rotate-half (dims i and i + R/2 form a pair; the bundled draft) and interleaved
(dims 2i and 2i+1; DeepSeek-style MLA, K3's DSpark). Frequencies are plain (θ^(-2i/R)) or YaRN
(`rope_scaling` / `rope_parameters` with rope_type "yarn"): frequencies below the correction
range are divided by `factor`, those above kept, a linear ramp between; cos/sin are scaled by
mscale(factor, mscale) / mscale(factor, mscale_all_dim), mscale(s, m) = 0.1·m·ln s + 1.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch


def yarn_mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_frequencies(r: int, theta: float, scaling: dict[str, Any] | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2] fp32, cos/sin multiplier)."""
    base = theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    inv = 1.0 / base
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"rope scaling {kind!r} is not supported (only 'yarn')")
    s = float(scaling["factor"])
    orig = float(scaling.get("original_max_position_embeddings", 4096))
    fast, slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def dim_of(rot: float) -> float:
        return r * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), r - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(r // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1.0 - ramp                                     # 1: extrapolate (high frequency)
    inv = inv / s * (1 - keep) + inv * keep
    mult = yarn_mscale(s, float(scaling.get("mscale", 1.0))) / yarn_mscale(
        s, float(scaling.get("mscale_all_dim", 0.0)))
    return inv, mult


def _key(scaling: dict[str, Any] | None) -> tuple | None:
    return None if not scaling else tuple(sorted(scaling.items()))     # scalars: hashable


@functools.lru_cache(maxsize=64)
def _frequencies_on(r: int, theta: float, key: tuple | None, device: torch.device
                    ) -> tuple[torch.Tensor, float]:
    """rope_frequencies on `device`, made and copied there once per shape: a host-to-device
    copy inside a step would break a CUDA graph capture (engine/decode_graphs.py)."""
    scaling = None if key is None else dict(key)
    inv, mult = rope_frequencies(r, theta, scaling)
    return inv.to(device), mult


def softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None = None) -> float:
    """Attention softmax scale: qk^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim ** -0.5
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        m = yarn_mscale(float(scaling["factor"]), float(scaling.get("mscale_all_dim", 0.0)))
        scale *= m * m
    return scale


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float,
               interleaved: bool = False, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """x [T, ..., R] rotated by position [T]; R must be even."""
    r = x.shape[-1]
    inv, mult = _frequencies_on(r, theta, _key(scaling), x.device)
    ang = positions.to(torch.float32)[:, None] * inv[None]               # [T, R/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = (ang.cos() * mult).view(shape), (ang.sin() * mult).view(shape)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2).to(
            x.dtype)
    x1, x2 = xf[..., : r // 2], xf[..., r // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
