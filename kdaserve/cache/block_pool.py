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
    until it is handed out again, so a later request can still hit it.

    A block's record is made when it is first handed out: the queue is the demoted blocks,
    then the never-used ids in order, then the freed blocks (what one OrderedDict of every
    block held, without ~400k records made up front for a small model's 512 MiB budget,
    ~1 s of CPU at every engine start)."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._next_fresh = 0                       # ids >= this were never handed out
        self._front: OrderedDict[int, Block] = OrderedDict()    # demoted: first out
        self._back: OrderedDict[int, Block] = OrderedDict()     # freed, in order
        self.cached: dict[bytes, Block] = {}
        # told before a cached block's content is given up (reused or forgotten), while it is
        # still intact: the offload tier stores it from there
        self.on_evict: Callable[[Block], None] | None = None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._front) + self._num_blocks - self._next_fresh + len(self._back)

    def free_order(self) -> list[int]:
        return [*self._front, *range(self._next_fresh, self._num_blocks), *self._back]

    def _pop_free(self) -> Block:
        if self._front:
            return self._front.popitem(last=False)[1]
        if self._next_fresh < self._num_blocks:
            self._next_fresh += 1
            return Block(self._next_fresh - 1)
        return self._back.popitem(last=False)[1]

    def allocate(self, n: int) -> list[Block]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self._pop_free()
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
                self._back[block.block_id] = block

    def demote(self, block: Block) -> None:
        """Move a free block to the front of the queue (first to be reused), keeping its hash."""
        if block.ref_cnt == 0:
            queue = self._queue_of(block)
            if queue is not None:
                del queue[block.block_id]
                self._front[block.block_id] = block
                self._front.move_to_end(block.block_id, last=False)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                queue = self._queue_of(block)
                if queue is None:
                    raise KeyError(block.block_id)
                del queue[block.block_id]
            block.ref_cnt += 1

    def _queue_of(self, block: Block) -> OrderedDict[int, Block] | None:
        """The queue a handed-out-before free block waits in (a record exists only for those)."""
        if block.block_id in self._front:
            return self._front
        return self._back if block.block_id in self._back else None

    def cache_block(self, block: Block, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)
