"""Turn a memory budget into MLA pages and KDA state slots."""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.cache.spec import KDAStateSpec, LatentKVSpec


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    block_size: int
    num_state_slots: int
    num_snapshots: int
    block_bytes: int
    slot_bytes: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        mib = (self.num_blocks * self.block_bytes
               + (self.num_state_slots + self.num_snapshots) * self.slot_bytes) / 2**20
        return (f"{self.num_tokens} tokens of MLA cache ({self.num_blocks} blocks of "
                f"{self.block_size}), {self.num_state_slots} state slots, "
                f"{self.num_snapshots} state snapshots ({mib:.1f} MiB)")


def plan_cache(latent: LatentKVSpec, state: KDAStateSpec, memory_bytes: int, max_num_seqs: int,
               *, num_blocks: int | None = None, num_state_slots: int | None = None,
               snapshot_bytes: int = 0) -> CachePlan:
    """Slots first (one per running sequence: a request cannot run without one), snapshots
    from their own budget, the rest of the budget to MLA pages."""
    slots = num_state_slots if num_state_slots is not None else max_num_seqs
    slot_bytes = max(state.bytes_per_slot, 1)
    snapshots = snapshot_bytes // slot_bytes if state.num_layers else 0
    left = memory_bytes - slots * state.bytes_per_slot - snapshots * state.bytes_per_slot
    block_bytes = max(latent.bytes_per_block, 1)
    if num_blocks is None:
        if latent.num_layers == 0:
            num_blocks = max(1, left // latent.block_size) if left > 0 else 1
            num_blocks = min(num_blocks, 1 << 20)
        else:
            num_blocks = left // block_bytes
    if num_blocks < 1 or left < 0:
        need = slots * state.bytes_per_slot + block_bytes
        raise ValueError(
            f"cache memory {memory_bytes / 2**20:.1f} MiB is too small: {slots} state slots need "
            f"{slots * state.bytes_per_slot / 2**20:.1f} MiB and one MLA block "
            f"{block_bytes / 2**20:.3f} MiB (need >= {need / 2**20:.1f} MiB); raise --cache-memory "
            "or lower --max-num-seqs"
        )
    return CachePlan(num_blocks, latent.block_size, slots, snapshots, latent.bytes_per_block,
                     state.bytes_per_slot)
