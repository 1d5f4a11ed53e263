"""The engine's cache tensors as the model sees them: MLA pages, live KDA slots and their conv
windows, KDA snapshots. Owned and sized by the runner; written by the layers and by the
executor of cache operations (kdaserve/engine/cache_ops.py), which reads and writes entries
through the views below."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.ops import fp8_latents


@dataclass
class HybridCache:
    """mla_pages[i]: [num_blocks, block_size, kv_lora_rank + rope_dim] for the i-th MLA layer.
    kda_states[i]: [num_slots, H, K, V] fp32; kda_conv[i]: [num_slots, conv_kernel - 1, 3*H*K].
    """

    mla_pages: list[torch.Tensor]
    kda_states: list[torch.Tensor]
    kda_conv: list[torch.Tensor]
    block_size: int
    snap_states: list[torch.Tensor] = field(default_factory=list)  # [num_snapshots, H, K, V]
    snap_conv: list[torch.Tensor] = field(default_factory=list)    # [num_snapshots, K-1, 3HK]
    # One layer's worth of live states, reused by every KDA layer in turn: gathering the slots
    # into fresh memory each layer costs page faults that dominate a decode step on CPU.
    state_scratch: torch.Tensor | None = None                        # [num_slots, H, K, V]

    @classmethod
    def allocate(cls, cfg, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 num_snapshots: int = 0, kv_cache_dtype: str = "auto") -> HybridCache:
        """Zeroed cache tensors for a ModelConfig `cfg`. kv_cache_dtype "fp8": MLA pages of
        uint8 rows, each token's e4m3 latent and its scale (kdaserve/ops/fp8_latents.py)."""
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        km1 = cfg.conv_kernel_size - 1
        fp8 = kv_cache_dtype == "fp8"
        width = fp8_latents.packed_width(cfg.mla_latent_dim) if fp8 else cfg.mla_latent_dim
        return cls(
            mla_pages=[torch.zeros(num_blocks, block_size, width,
                                   dtype=torch.uint8 if fp8 else dtype, device=device)
                       for _ in cfg.mla_layers],
            kda_states=[torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=device)
                        for _ in cfg.kda_layers],
            kda_conv=[torch.zeros(num_slots, cfg.conv_kernel_size - 1, cfg.kda_conv_dim,
                                  dtype=dtype, device=device) for _ in cfg.kda_layers],
            block_size=block_size,
            snap_states=[torch.zeros(num_snapshots, h, d, d, dtype=torch.float32, device=device)
                         for _ in cfg.kda_layers] if num_snapshots else [],
            snap_conv=[torch.zeros(num_snapshots, km1, cfg.kda_conv_dim, dtype=dtype,
                                   device=device) for _ in cfg.kda_layers] if num_snapshots else [],
            state_scratch=torch.empty(num_slots, h, d, d, dtype=torch.float32, device=device)
            if cfg.kda_layers else None,
        )

    def restore(self, slots: torch.Tensor, snapshot_ids: torch.Tensor) -> None:
        """Load snapshots into live state slots (prefix-cache hits), every KDA layer."""
        for st, cv, sst, scv in zip(self.kda_states, self.kda_conv, self.snap_states,
                                    self.snap_conv):
            st.index_copy_(0, slots, sst.index_select(0, snapshot_ids))
            cv.index_copy_(0, slots, scv.index_select(0, snapshot_ids))

    def save_slots(self, slots: torch.Tensor, snapshot_ids: torch.Tensor) -> None:
        """Snapshots of live slots as they stand (a decode row's final state at a block
        boundary, after a replayed graph), every KDA layer: `restore`'s inverse."""
        for st, cv, sst, scv in zip(self.kda_states, self.kda_conv, self.snap_states,
                                    self.snap_conv):
            sst.index_copy_(0, snapshot_ids, st.index_select(0, slots))
            scv.index_copy_(0, snapshot_ids, cv.index_select(0, slots))

    # Views of one cache entry, in the fixed order the offload tiers store them in
    # (kdaserve/engine/cache_ops.py): writing into the views writes the cache.
    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One MLA block: [block_size, D] per MLA layer."""
        return [p[block_id] for p in self.mla_pages]

    def snapshot_views(self, snapshot_id: int) -> list[torch.Tensor]:
        """One KDA snapshot: [H, K, V] per KDA layer, then [K-1, 3HK] per KDA layer."""
        return ([s[snapshot_id] for s in self.snap_states]
                + [c[snapshot_id] for c in self.snap_conv])

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """One live KDA slot, laid out like a snapshot (a tier snapshot loads straight in)."""
        return [s[slot] for s in self.kda_states] + [c[slot] for c in self.kda_conv]
