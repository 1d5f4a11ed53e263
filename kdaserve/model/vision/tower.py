"""The vision half of a multimodal checkpoint: which VisionConfig a ModelConfig implies, and the
encoder + projector pair a model class attaches as `vision_tower` / `mm_projector`."""

from __future__ import annotations

import torch
from torch import nn

from kdaserve.model.vision.config import vision_config_of
from kdaserve.model.vision.moonvit import MoonViT
from kdaserve.model.vision.projector import MMProjector
from kdaserve.model_config import ModelConfig


def build_vision(cfg: ModelConfig) -> tuple[MoonViT, MMProjector] | None:
    vcfg = vision_config_of(cfg)
    if vcfg is None:
        return None
    return MoonViT(vcfg), MMProjector(vcfg)


def encode(tower: MoonViT, projector: MMProjector, pixels: torch.Tensor,
           grids: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Images packed as pixels [N, 3, p, p] with their patch grids -> one [tokens, H_text]
    tensor per image (tokens = gh·gw / 4)."""
    feats = projector(tower(pixels, grids))
    k = tower.cfg.merge_size
    return list(feats.split([gh * gw // k for gh, gw in grids]))


def has_vision(model: nn.Module) -> bool:
    return getattr(model, "vision_tower", None) is not None
