"""MLA page ids: reference counts and an LRU free queue (no tensors here)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Free blocks wait in LRU order; a freed block keeps its hash (and its cached content)
    until it is handed out again, so a later request can still hit it."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        # told before a cached block's content is given up (reused or forgotten), while it is
        # still intact: the offload tier stores it from there
        self.on_evict: Callable[[Block], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_order(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[Block]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self.forget(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def forget(self, block: Block) -> None:
        """Drop a block's hash: its content is no longer findable (evicted)."""
        if self.on_evict is not None:
            self.on_evict(block)
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def free(self, blocks: list[Block]) -> None:
        """Release one reference each; blocks are given in eviction order (first = first out)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def demote(self, block: Block) -> None:
        """Move a free block to the front of the queue (first to be reused), keeping its hash."""
        if block.ref_cnt == 0 and block.block_id in self._free:
            self._free.move_to_end(block.block_id, last=False)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)
