"""Slots sorted by expert and cut into tiles of one expert each, on the device, sync-free.

A grouped GEMM needs, for each program, an expert and a run of that expert's slots. The number
of tiles depends on the routing (sum over experts of ceil(count / BLOCK_M)); reading it back
would stall the host and break CUDA graph capture, so the tile table is sized by a bound from
shapes alone: at most ceil(N / BLOCK_M) + E tiles (each expert wastes less than one tile), and
never more than N (a tile holds at least one slot). Tiles past the last real one carry expert
-1 and the kernels exit on them.

Legend: T tokens, k experts per token, N = T*k slots, E experts, P tiles (the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotTiles:
    order: torch.Tensor      # [N] int32: slot numbers (t*k + j) sorted by expert, stable
    expert: torch.Tensor     # [P] int32: the tile's expert, -1 for an empty tile
    start: torch.Tensor      # [P] int32: first position in `order` of the tile
    end: torch.Tensor        # [P] int32: one past its last (the expert's end at most)

    @property
    def count(self) -> int:
        """P, the launch grid's tile dimension (a shape, not a value read back)."""
        return self.expert.shape[0]


def tile_bound(n_slots: int, n_experts: int, block_m: int) -> int:
    return min(-(-n_slots // block_m) + n_experts, n_slots)


def slot_tiles(ids: torch.Tensor, n_experts: int, block_m: int) -> SlotTiles:
    """ids [T, k] expert ids -> the tile table for tiles of at most block_m slots."""
    flat = ids.reshape(-1).long()                                            # [N]
    n = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    # (bincount reads its max back to the host on CUDA; a scatter-add does not)
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))                                     # [E]
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m                                # [E]
    tiles_end = tiles.cumsum(0)
    p = torch.arange(tile_bound(n, n_experts, block_m), device=dev)         # [P]
    e = torch.searchsorted(tiles_end, p, right=True)                        # E: past the end
    real = e < n_experts
    ec = e.clamp(max=n_experts - 1)
    start = ends[ec] - counts[ec] + (p - (tiles_end[ec] - tiles[ec])) * block_m
    end = torch.minimum(start + block_m, ends[ec])
    return SlotTiles(order.to(torch.int32), torch.where(real, ec, -1).to(torch.int32),
                     start.to(torch.int32), end.to(torch.int32))
