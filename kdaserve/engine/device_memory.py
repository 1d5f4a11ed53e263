"""The cache budget of the device the engine runs on: the one question of the memory planner
(cache/planner.py) that needs torch, asked here so that cache/ stays torch-free."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kdaserve.cache import planner
from kdaserve.config import CacheConfig


def cache_budget(cache: CacheConfig, device: torch.device,
                 mem_info: Callable[[torch.device], tuple[int, int]] | None = None) -> int:
    """The cache's byte budget on `device` (planner.cache_budget). mem_info returns (free,
    total) bytes (torch.cuda.mem_get_info by default); it is only asked on CUDA, and only
    when a memory fraction is set."""
    if cache.gpu_memory_utilization is None or device.type != "cuda":
        return planner.cache_budget(cache, None)
    return planner.cache_budget(cache, (mem_info or torch.cuda.mem_get_info)(device))
