"""Hybrid prefix cache bookkeeping: chained block hashes, KDA state snapshots, hit search.

An MLA block can be reused on its own, but a KDA state summarises the whole prefix and exists
only where a snapshot was taken. A hit is therefore the longest prefix whose blocks are all
cached AND that ends where a snapshot exists; the request restores that snapshot into its slot
and resumes prefill there.

Placement (where snapshots are taken, during prefill/decode, without an extra forward):
  1. at the end of each prompt's last full block (the next chat turn extends the prompt),
  2. every `interval` tokens of a long prompt (block-aligned),
  3. at branch points: where a new prompt's cached MLA blocks run past its last snapshot, the
     boundary of the last such block (the point where it diverges from a cached prompt), so the
     next request sharing that prefix hits there,
  4. during decode, at the latest block boundary of the output (one per request, replacing its
     previous one), so a follow-up turn that quotes the answer hits past the prompt.
Eviction (snapshot pool full): the snapshot with the least prefill saved per byte held goes
first: value = position * (1 + hits) / (snapshot bytes + position * MLA bytes per token), ties
broken by least recent use. A block chain past its last snapshot cannot produce a hit, so such
"orphan" blocks are evicted before any block that still leads to a snapshot.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from kdaserve.cache.ops import BLOCK, SNAPSHOT

if TYPE_CHECKING:
    from kdaserve.cache.block_pool import BlockPool
    from kdaserve.cache.offload import Offload

ROOT_HASH = b"kdaserve-prefix-root"


@dataclass(frozen=True)
class PlacedKey:
    """An extra key that covers tokens [start, end) (an image's placeholder run): it enters the
    hash of each block it overlaps, so blocks before it stay shareable."""

    key: str
    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.key}@{self.start}:{self.end}"


def hash_block(parent: bytes, tokens: list[int], extra: tuple = ()) -> bytes:
    """Stable 128-bit chained hash of one full block (never Python's hash())."""
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(array("q", tokens).tobytes())
    for key in extra:
        h.update(b"\x00")
        h.update(str(key).encode())
    return h.digest()


def block_hashes(tokens: list[int], block_size: int, extra_keys: tuple = (),
                 cache_salt: str | None = None, start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full block of `tokens`, extending `start` (already computed) in place.

    Request-wide keys (the cache salt, other keys) enter the first block's hash, so every later
    block of a prompt with another salt differs through the chain. A PlacedKey (an image's
    content hash over its placeholder run) enters the blocks it overlaps, and the chain carries
    it on: blocks before the image stay shared with prompts that differ only in it.
    """
    out = start if start is not None else []
    placed = [k for k in extra_keys if isinstance(k, PlacedKey)]
    first_extra = tuple(k for k in extra_keys if not isinstance(k, PlacedKey)) + (
        (f"salt:{cache_salt}",) if cache_salt is not None else ())
    for i in range(len(out), len(tokens) // block_size):
        parent = out[-1] if out else ROOT_HASH
        lo, hi = i * block_size, (i + 1) * block_size
        extra = (first_extra if i == 0 else ()) + tuple(
            k for k in placed if k.start < hi and lo < k.end)
        out.append(hash_block(parent, tokens[lo:hi], extra))
    return out


@dataclass(eq=False)
class Snapshot:
    snapshot_id: int
    prefix_hash: bytes
    position: int
    hits: int = 0
    last_use: int = 0
    ready_step: int = 0
    chain: list[bytes] = field(default_factory=list)   # block hashes of its prefix


class SnapshotPool:
    """Snapshot ids (tensors live in the runner), keyed by the hash of the prefix they end."""

    def __init__(self, num_snapshots: int, snapshot_bytes: int, mla_bytes_per_token: int) -> None:
        self.capacity = num_snapshots
        self.snapshot_bytes = snapshot_bytes
        self.mla_bytes_per_token = mla_bytes_per_token
        self._free = list(range(num_snapshots - 1, -1, -1))
        self.by_hash: dict[bytes, Snapshot] = {}
        self.by_id: dict[int, Snapshot] = {}
        self.downstream: dict[bytes, int] = {}   # block hash -> snapshots at/after it
        self.evictions = 0
        # told before an evicted snapshot's id is reused (the offload tier stores it)
        self.on_evict: Callable[[Snapshot], None] | None = None

    @property
    def num_used(self) -> int:
        return len(self.by_hash)

    @property
    def bytes_held(self) -> int:
        return self.num_used * self.snapshot_bytes

    def value(self, snap: Snapshot) -> float:
        held = self.snapshot_bytes + snap.position * self.mla_bytes_per_token
        return snap.position * (1 + snap.hits) / held

    def lookup(self, prefix_hash: bytes, step: int) -> Snapshot | None:
        snap = self.by_hash.get(prefix_hash)
        return snap if snap is not None and snap.ready_step <= step else None

    def reserve(self, prefix_hash: bytes, position: int, chain: list[bytes], step: int,
                protect: set[int]) -> tuple[Snapshot | None, list[bytes]]:
        """A snapshot id for the state at `position`, evicting the least valuable one if the pool
        is full. Returns (snapshot or None, block hashes that became orphans)."""
        if self.capacity == 0 or prefix_hash in self.by_hash:
            return None, []
        orphans: list[bytes] = []
        if not self._free:
            victims = [s for s in self.by_hash.values() if s.snapshot_id not in protect]
            if not victims:
                return None, []
            victim = min(victims, key=lambda s: (self.value(s), s.last_use))
            if self.on_evict is not None:
                self.on_evict(victim)
            orphans = self.drop(victim)
        snap = Snapshot(self._free.pop(), prefix_hash, position, last_use=step,
                        ready_step=step + 1, chain=list(chain))
        self.by_hash[prefix_hash] = snap
        self.by_id[snap.snapshot_id] = snap
        for h in snap.chain:
            self.downstream[h] = self.downstream.get(h, 0) + 1
        return snap, orphans

    def drop(self, snap: Snapshot) -> list[bytes]:
        """Remove a snapshot; returns the block hashes no snapshot depends on any more."""
        del self.by_hash[snap.prefix_hash]
        del self.by_id[snap.snapshot_id]
        self._free.append(snap.snapshot_id)
        self.evictions += 1
        orphans = []
        for h in snap.chain:
            n = self.downstream[h] - 1
            if n:
                self.downstream[h] = n
            else:
                del self.downstream[h]
                orphans.append(h)
        return orphans

    def leads_to_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self.downstream


@dataclass
class CacheStats:
    """The prefix cache's counters (the /metrics hit rate, the startup report)."""

    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    snapshots_taken: int = 0


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int                 # tokens whose MLA blocks and KDA state are reused
    block_hashes: list[bytes]       # the hit blocks, in order
    snapshot: Snapshot | None       # a device snapshot (restored into the slot)
    cached_mla_tokens: int          # how far the MLA blocks alone are cached (branch signal)
    num_query_tokens: int = 0
    # offload tiers: which hit blocks sit only in a tier (loaded into fresh device blocks),
    # and whether the snapshot does (loaded straight into the slot; `snapshot` is then None)
    tier_blocks: frozenset[int] = frozenset()
    tier_snapshot: bool = False


def find_prefix_hit(tokens: list[int], hashes: list[bytes], block_size: int, pool: BlockPool,
                    snapshots: SnapshotPool, offload: Offload | None, step: int) -> PrefixHit:
    """Longest prefix that is MLA-cached and ends at a ready snapshot (at least one token is
    left to compute, for the logits), looking through the device pools and every offload
    tier: the blocks and the snapshot may each sit anywhere. `hashes`: the prompt's chained
    block hashes."""
    best = cached = 0
    snap = None
    tier_snap = False
    tiered = []
    for i in range((len(tokens) - 1) // block_size):
        h = hashes[i]
        if pool.lookup(h) is None:
            if offload is None or not offload.holds(BLOCK, h):
                break
            tiered.append(i)
        cached = i + 1
        s = snapshots.lookup(h, step)
        if s is not None:
            best, snap, tier_snap = i + 1, s, False
        elif offload is not None and offload.holds(SNAPSHOT, h):
            best, snap, tier_snap = i + 1, None, True
    return PrefixHit(best * block_size, hashes[:best], snap, cached * block_size, len(tokens),
                     frozenset(i for i in tiered if i < best), tier_snap)


def placement(position_range: tuple[int, int], num_prompt: int, block_size: int,
              interval: int, branch: int | None) -> list[int]:
    """Block boundaries p in (start, end] where policies 1-3 want a snapshot this step."""
    start, end = position_range
    wanted = set()
    last_full = num_prompt // block_size * block_size
    if start < last_full <= end:
        wanted.add(last_full)
    step = max(block_size, interval // block_size * block_size)
    first = (start // step + 1) * step
    wanted.update(range(first, min(end, num_prompt) + 1, step))
    if branch is not None and start < branch <= end:
        wanted.add(branch)
    return sorted(p for p in wanted if p > 0)
