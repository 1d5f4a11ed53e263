"""The offload tiers' bookkeeping: what every tier holds, and the cache operations that move
entries between the device pools and the tiers (host memory in front of disk).

Plain Python over keys, ids and sizes: the cache manager calls it when the device pools evict
(store) and when a prefix hit reaches into a tier (load); it queues the operations, which the
scheduler hands to the runner in the step's `SchedulerOutput`.

Tiers are inclusive copies: a store goes to every tier that does not hold the entry yet (host
and disk), a load leaves the tier's copy in place (the loaded block becomes a device block
again, and the next device eviction finds the tier already holding it: no second write), and a
load reads from the fastest tier that has the entry.

A block is worth storing only if it leads to a snapshot (on the device or in a tier): a hit
must end at a KDA state. `downstream` counts, per block hash, the distinct tier snapshots whose
prefix contains it, like `SnapshotPool.downstream` does for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kdaserve.cache.ops import (
    BLOCK,
    SNAPSHOT,
    CacheOp,
    DropEntry,
    KeepState,
    LoadBlock,
    LoadState,
    OpFailure,
    StoreBlock,
    StoreSnapshot,
)
from kdaserve.cache.tiers import Tier, TierEntry

HEADER_BYTES = 96                  # an entry's fixed header (checksums, key, sizes), roughly
CHAIN_BYTES = 16                   # per block hash of a snapshot's chain


@dataclass
class TierCounters:
    """What the bookkeeping knows per tier (bytes actually moved are counted by the runner)."""

    queries: int = 0               # prefix lookups that could reach this tier
    hits: int = 0                  # lookups whose hit used at least one of its entries
    hit_tokens: int = 0            # tokens of those hits
    load_failures: int = 0         # corrupt, truncated or missing entries found on load
    store_failures: int = 0        # writes that failed (disk full, unwritable)
    scan_dropped: int = 0          # unreadable entries the startup scan removed


class Offload:
    def __init__(self, tiers: list[Tier], block_bytes: int, snapshot_bytes: int) -> None:
        self.tiers = tiers                         # fastest first
        self.by_name = {t.name: t for t in tiers}
        self.block_bytes = block_bytes
        self.snapshot_bytes = snapshot_bytes
        self.downstream: dict[bytes, int] = {}
        self.counters = {t.name: TierCounters() for t in tiers}
        self.device_leads: Callable[[bytes], bool] = lambda h: False
        self.on_orphans: Callable[[list[bytes]], None] = lambda hs: None
        self._copies: dict[bytes, int] = {}        # snapshot key -> tiers holding it
        self._ops: list[CacheOp] = []
        self._protect: set[tuple[str, bytes]] = set()
        self.step = 0

    # ---- per step ---------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self._protect = set()

    def take_ops(self) -> list[CacheOp]:
        ops, self._ops = self._ops, []
        return ops

    def leads(self, block_hash: bytes) -> bool:
        return block_hash in self.downstream or self.device_leads(block_hash)

    # ---- lookups ----------------------------------------------------------------------------
    def find(self, kind: str, key: bytes) -> Tier | None:
        """The fastest tier holding the entry."""
        for t in self.tiers:
            if t.get(kind, key) is not None:
                return t
        return None

    def holds(self, kind: str, key: bytes) -> bool:
        return any(t.get(kind, key) is not None for t in self.tiers)

    # ---- stores (device -> tiers), on eviction from the device pools ------------------------
    def store_block(self, block_id: int, key: bytes) -> None:
        if not self.leads(key):
            return                                 # can never produce a hit: let it go
        entry = lambda t: TierEntry(BLOCK, key, t.cost(self.block_bytes, HEADER_BYTES),  # noqa: E731
                                    last_use=self.step)
        tiers = self._admit(BLOCK, key, entry)
        if tiers:
            self._ops.append(StoreBlock(block_id, key, tiers))

    def store_snapshot(self, snapshot_id: int, key: bytes, position: int,
                       chain: Iterable[bytes], hits: int, block_cached: Callable[[bytes], bool]
                       ) -> None:
        chain = tuple(chain)
        # a snapshot whose prefix blocks are gone everywhere can never be reached
        if not all(block_cached(h) or self.holds(BLOCK, h) for h in chain):
            return
        header = HEADER_BYTES + CHAIN_BYTES * len(chain)
        entry = lambda t: TierEntry(SNAPSHOT, key, t.cost(self.snapshot_bytes, header),  # noqa: E731
                                    position, chain, hits, self.step)
        tiers = self._admit(SNAPSHOT, key, entry)
        if tiers:
            self._ops.append(StoreSnapshot(snapshot_id, key, position, chain, tiers))

    def _admit(self, kind: str, key: bytes, make: Callable[[Tier], TierEntry]) -> tuple[str, ...]:
        into = []
        for t in self.tiers:
            held = t.get(kind, key)
            if held is not None:
                t.touch(held, self.step)
                continue
            entry = make(t)
            victims = t.admit(entry, self.leads, self._protect)
            if victims is None:
                continue
            for v in victims:
                self._ops.append(DropEntry(t.name, v.kind, v.key))
                self._forgotten(v)
            self._added(entry)
            into.append(t.name)
        return tuple(into)

    # ---- loads (tier -> device), for a prefix hit -------------------------------------------
    def load_block(self, key: bytes, block_id: int, request_id: str) -> str:
        t = self._use(BLOCK, key)
        self._ops.append(LoadBlock(t.name, key, block_id, request_id))
        return t.name

    def load_state(self, key: bytes, slot: int, request_id: str) -> str:
        t = self._use(SNAPSHOT, key)
        t.get(SNAPSHOT, key).hits += 1
        self._ops.append(LoadState(t.name, key, slot, request_id))
        return t.name

    def keep_state(self, slot: int, snapshot_id: int, request_id: str) -> None:
        self._ops.append(KeepState(slot, snapshot_id, request_id))

    def protect(self, kind: str, key: bytes) -> None:
        """Keep an entry this step (a hit found it; its load is about to be queued)."""
        self._protect.add((kind, key))

    def _use(self, kind: str, key: bytes) -> Tier:
        t = self.find(kind, key)
        assert t is not None, "load of an entry no tier holds"
        t.touch(t.get(kind, key), self.step)
        self._protect.add((kind, key))
        return t

    # ---- failures reported by the runner ----------------------------------------------------
    def settle(self, failures: Iterable[OpFailure]) -> None:
        """Entries that failed to store or load leave their tier (a corrupt entry is a miss
        from now on; the data is recomputed)."""
        for f in failures:
            c = self.counters.get(f.tier)
            if c is None:
                continue
            if f.request_id is None:
                c.store_failures += 1
            else:
                c.load_failures += 1
            gone = self.by_name[f.tier].remove(f.kind, f.key)
            if gone is not None:
                self._ops.append(DropEntry(f.tier, f.kind, f.key))
                self._forgotten(gone)

    # ---- restart ----------------------------------------------------------------------------
    def seed(self, tier: Tier, entries: Iterable[TierEntry]) -> list[TierEntry]:
        """Entries found in a persistent tier at startup (oldest first). Returns those that do
        not fit the budget any more (the caller deletes them)."""
        dropped: list[TierEntry] = []
        for e in entries:
            victims = tier.admit(e, self.leads, self._protect)
            if victims is None:
                dropped.append(e)
                continue
            for v in victims:
                self._forgotten(v)
            dropped += victims
            self._added(e)
        return dropped

    # ---- the downstream map -----------------------------------------------------------------
    def _added(self, e: TierEntry) -> None:
        if e.kind != SNAPSHOT:
            return
        n = self._copies.get(e.key, 0)
        self._copies[e.key] = n + 1
        if n == 0:
            for h in e.chain:
                self.downstream[h] = self.downstream.get(h, 0) + 1

    def _forgotten(self, e: TierEntry) -> None:
        if e.kind != SNAPSHOT:
            return
        n = self._copies[e.key] - 1
        if n:
            self._copies[e.key] = n
            return
        del self._copies[e.key]
        orphans = []
        for h in e.chain:
            k = self.downstream[h] - 1
            if k:
                self.downstream[h] = k
            else:
                del self.downstream[h]
                orphans.append(h)
        self.demote([h for h in orphans if not self.device_leads(h)])
        self.on_orphans(orphans)

    def demote(self, hashes: Iterable[bytes]) -> None:
        """Blocks that lead to no snapshot any more go to the front of every tier's queue."""
        for h in hashes:
            if not self.leads(h):
                for t in self.tiers:
                    t.demote(h)
