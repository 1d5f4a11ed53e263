"""Random weights for tests and benchmarks of any registered model: scaled so activations stay
O(1) through the depth, with MXFP4 experts quantized from random fp32 weights."""

from __future__ import annotations

import math

import torch
from torch import nn

from kdaserve.model.moe import SparseMoE
from kdaserve.ops.mxfp4 import quantize_mxfp4


@torch.no_grad()
def init_random(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=g).log())
        elif name.endswith("dt_bias"):
            p.normal_(0, 0.5, generator=g)
        elif p.dim() >= 2:
            p.normal_(0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
            if name.endswith("embed_tokens.weight"):
                p.mul_(math.sqrt(p.shape[-1]))
        else:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    for _, b in model.named_buffers():
        if b.is_floating_point():
            b.normal_(0, 0.1, generator=g)
    for moe in model.modules():
        if isinstance(moe, SparseMoE) and moe.quantized:
            for stack in ("experts_w13", "experts_w2"):
                shape = getattr(moe, f"{stack}_packed").shape
                w = torch.randn(*shape[:2], shape[2] * 2, generator=g) / math.sqrt(shape[2] * 2)
                packed, scale = quantize_mxfp4(w)
                getattr(moe, f"{stack}_packed").copy_(packed)
                getattr(moe, f"{stack}_scale").copy_(scale)
    return model
