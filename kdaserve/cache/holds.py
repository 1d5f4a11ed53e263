"""Prefix holds: blocks a decode instance promised a prefill instance it already holds.

Disaggregation's hit query (kdaserve/disagg/handoff.py): before a prefill instance computes a
prompt, the decode instance that will continue it is asked how many leading tokens of the
prompt it holds (its own prefix-cache hit, in its own block size). Its answer is a token
count, and the prefill instance sends only the tokens after it. Between the answer and the
import, the decode instance must not lose those blocks (another request's allocation would
reuse a free one): a hold takes a reference on each, like a request that shares them, until
the import takes them over or the hold expires (the import never came). A hold releases its
references exactly once.

Plain Python over ids (no tensors), like the block pool it references.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdaserve.cache.block_pool import Block, BlockPool
from kdaserve.cache.prefix_cache import PrefixHit, block_hashes


@dataclass
class Hold:
    blocks: list[Block]
    hashes: list[bytes]          # chained hashes of `blocks` (the import checks its prompt)
    deadline: float              # time.monotonic() after which nobody will take it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class PrefixHolds:
    """Holds by key (the transfer id)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._holds: dict[str, Hold] = {}
        self.expired = 0

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, key: str, hold: Hold) -> None:
        self.release(key)
        self.pool.touch(hold.blocks)
        self._holds[key] = hold

    def pin(self, key: str, hit: PrefixHit | None, block_size: int, deadline: float) -> int:
        """Hold the device blocks of `hit` (the hybrid one: MLA-cached up to a KDA snapshot)
        under `key` until `deadline`, cut before its first block that only an offload tier
        holds (a hold pins device blocks only); returns how many leading tokens they hold
        (whole blocks; 0: none)."""
        if hit is None or not hit.num_tokens:
            return 0
        n = min(hit.tier_blocks, default=len(hit.block_hashes))
        blocks = [self.pool.lookup(h) for h in hit.block_hashes[:n]]
        if not n or any(b is None for b in blocks):
            return 0
        self.add(key, Hold(blocks, list(hit.block_hashes[:n]), deadline))
        return n * block_size

    def get(self, key: str) -> Hold | None:
        return self._holds.get(key)

    def hit(self, key: str, tokens: list[int], block_size: int, extra_keys: tuple = (),
            cache_salt: str | None = None) -> PrefixHit | None:
        """The hold under `key` as a prefix hit of this prompt (its blocks stay pinned until
        `release`); None without one, or when its blocks are not this prompt's (the hold is
        dropped then: an import never shares blocks it did not verify)."""
        hold = self._holds.get(key)
        if hold is None:
            return None
        k = hold.num_blocks * block_size
        if k >= len(tokens) or block_hashes(tokens[:k], block_size, extra_keys,
                                            cache_salt) != hold.hashes:
            self.release(key)
            return None
        return PrefixHit(k, list(hold.hashes), None, k, len(tokens))

    def release(self, key: str) -> None:
        hold = self._holds.pop(key, None)
        if hold is not None:
            # tail first into the LRU queue, as a request's blocks go (cache/manager.py free)
            self.pool.free(list(reversed(hold.blocks)))

    def expire(self, now: float) -> None:
        for key in [k for k, h in self._holds.items() if h.deadline < now]:
            self.release(key)
            self.expired += 1
