"""The facade the scheduler calls: block tables (MLA pages) and state slots (KDA) per request.

Plain Python over ids and counts; the runner owns the tensors these ids index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.cache.block_pool import Block, BlockPool
from kdaserve.cache.state_pool import StatePool


@dataclass
class CacheStats:
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


@dataclass
class _Holding:
    blocks: list[Block] = field(default_factory=list)
    slot: int | None = None


class CacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.state_pool = StatePool(num_slots)
        self._held: dict[str, _Holding] = {}
        self.stats = CacheStats()

    # ---- queries --------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._held[request_id].blocks]

    def slot(self, request_id: str) -> int:
        slot = self._held[request_id].slot
        assert slot is not None
        return slot

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self._held[request_id].blocks) if request_id in self._held else 0
        return max(0, -(-num_tokens // self.block_size) - have)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    @property
    def num_free_slots(self) -> int:
        return self.state_pool.num_free

    @property
    def usage(self) -> float:
        total = self.block_pool.num_blocks
        return 1.0 - self.block_pool.num_free / total if total else 0.0

    def all_free(self) -> bool:
        return (not self._held and self.block_pool.num_free == self.block_pool.num_blocks
                and self.state_pool.num_free == self.state_pool.num_slots)

    # ---- changes --------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request hold room for `num_tokens` tokens in total and a state slot.
        All or nothing: on False nothing changed."""
        held = self._held.get(request_id)
        need_slot = held is None or held.slot is None
        need_blocks = self.blocks_needed(request_id, num_tokens)
        if need_blocks > self.block_pool.num_free or (need_slot and not self.state_pool.num_free):
            return False
        if held is None:
            held = self._held[request_id] = _Holding()
        if need_slot:
            held.slot = self.state_pool.allocate()
        if need_blocks:
            held.blocks.extend(self.block_pool.allocate(need_blocks))
        return True

    def free(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        # The tail goes first into the free queue: it is the least likely to be shared.
        self.block_pool.free(list(reversed(held.blocks)))
        if held.slot is not None:
            self.state_pool.free(held.slot)
