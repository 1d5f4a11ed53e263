"""Turn a memory budget into MLA pages and KDA state slots, and say what that buys: how many
tokens fit and how many requests of the longest allowed length run at once.

A request's cache is its MLA latents (linear in its length, only on MLA layers) plus one KDA
state slot (constant), so at long context the budget is almost all pages: on the 48B model a
1M-token request needs about 1M × 7 layers × 576 values of latents and one ~41 MiB slot.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.cache.spec import KDAStateSpec, LatentKVSpec
from kdaserve.config import CacheConfig

# Left for a step's activations on top of what is in use at planning time (one prefill chunk's
# MoE and logits working set at --max-num-batched-tokens 2048 stays well below this).
_ACTIVATION_RESERVE = 2 << 30


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    block_size: int
    num_state_slots: int
    num_snapshots: int
    block_bytes: int
    slot_bytes: int
    max_model_len: int | None = None    # the longest request allowed, to report what fits
    kv_cache_dtype: str = "auto"        # "fp8": e4m3 latents with per-token scales

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks * self.block_bytes
                + (self.num_state_slots + self.num_snapshots) * self.slot_bytes)

    def request_bytes(self, num_tokens: int) -> int:
        """Cache one request of num_tokens tokens holds: its blocks and its state slot."""
        return -(-num_tokens // self.block_size) * self.block_bytes + self.slot_bytes

    def requests_at(self, num_tokens: int) -> int:
        """How many requests of num_tokens tokens fit in the cache at once."""
        blocks = max(1, -(-num_tokens // self.block_size))
        return min(self.num_blocks // blocks, self.num_state_slots)

    def describe(self) -> str:
        text = (f"{self.num_tokens} tokens of MLA cache ({self.num_blocks} blocks of "
                f"{self.block_size}), {self.num_state_slots} state slots, "
                f"{self.num_snapshots} state snapshots ({self.total_bytes / 2**20:.1f} MiB)")
        if self.max_model_len:
            n = self.requests_at(self.max_model_len)
            if n:
                text += (f"; {n} request{'s' if n > 1 else ''} of max_model_len "
                         f"{self.max_model_len} tokens fit at once")
            else:
                short = self.request_bytes(self.max_model_len) - self.num_blocks * self.block_bytes
                text += (f"; a request of max_model_len {self.max_model_len} tokens does not fit "
                         f"(needs {short / 2**20:.1f} MiB more cache memory)")
        return text


def fraction_budget(total_bytes: int, fraction: float, reserved_bytes: int) -> int:
    """Cache budget on an accelerator: `fraction` of its memory, less what is already taken
    (weights, activations, the runtime), e.g. 0.9 of an 80 GiB GPU minus 20 GiB of weights."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    budget = int(total_bytes * fraction) - reserved_bytes
    if budget <= 0:
        raise ValueError(
            f"{fraction:.0%} of {total_bytes / 2**30:.1f} GiB leaves nothing for the cache after "
            f"{reserved_bytes / 2**30:.1f} GiB in use; raise the fraction")
    return budget


def cache_budget(cache: CacheConfig, device_memory: tuple[int, int] | None) -> int:
    """The cache's byte budget: `gpu_memory_utilization` of an accelerator's memory less what is
    in use once the weights are loaded (vLLM's flag), else `cache_memory_bytes`.
    `device_memory` is the accelerator's (free, total) bytes, None on CPU; the engine asks the
    device for it (engine/device_memory.py), as cache/ imports no torch."""
    if cache.gpu_memory_utilization is None or device_memory is None:
        return cache.cache_memory_bytes
    free, total = device_memory
    # what the weights, the runtime and other processes hold, and room for activations
    in_use = total - free + _ACTIVATION_RESERVE
    return fraction_budget(total, cache.gpu_memory_utilization, in_use)


def plan_cache(latent: LatentKVSpec, state: KDAStateSpec, memory_bytes: int, max_num_seqs: int,
               *, num_blocks: int | None = None, num_state_slots: int | None = None,
               snapshot_bytes: int = 0, max_model_len: int | None = None) -> CachePlan:
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
            "(--gpu-memory-utilization on CUDA) or lower --max-num-seqs"
        )
    return CachePlan(num_blocks, latent.block_size, slots, snapshots, latent.bytes_per_block,
                     state.bytes_per_slot, max_model_len, "fp8" if latent.fp8 else "auto")
