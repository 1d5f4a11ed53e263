"""mm_projector: merged patch features [M, k, D] -> text embeddings [M, H_text].

`patchmerger` (K2.5): LayerNorm over each patch's D, concat the k patches, Linear, GELU, Linear
(`mm_projector.pre_norm`, `mm_projector.proj.0`, `mm_projector.proj.2`). `patchmergerv2` (K3):
no pre-norm, bias-free linears, then an RMSNorm over the text width (`mm_projector.post_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.model.vision.config import VisionConfig


class MMProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.mm_hidden_size or cfg.hidden_size
        self.width = d * cfg.merge_size
        self.v2 = cfg.projector_type == "patchmergerv2"
        bias = not self.v2 and cfg.linear_bias
        if not self.v2:
            self.pre_norm = nn.LayerNorm(d, eps=cfg.projector_eps)
        self.proj = nn.Sequential(nn.Linear(self.width, self.width, bias=bias), nn.GELU(),
                                  nn.Linear(self.width, cfg.text_hidden_size, bias=bias))
        if self.v2:
            self.post_norm = nn.RMSNorm(cfg.text_hidden_size, eps=cfg.projector_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.v2:
            x = self.pre_norm(x)
        y = self.proj(x.reshape(x.shape[0], self.width))
        return self.post_norm(y) if self.v2 else y
