"""The device pools' side of the offload tiers: device evictions become stores, the operations
are handed to the step, failures coming back drop entries, the device cache is flushed to the
tiers, a prefix hit whose blocks or snapshot sit in a tier gets loads into device blocks and
its slot, and blocks that lead to no snapshot any more (device or tier) are demoted to be
reused first.

A component the cache manager (manager.py) holds: it sees the device pools and the tiers
(offload.py), never a request's holding; the manager applies what it returns. Plain Python.
"""

from __future__ import annotations

from kdaserve.cache.block_pool import Block, BlockPool
from kdaserve.cache.offload import Offload
from kdaserve.cache.ops import BLOCK, SNAPSHOT, CacheOp, OpFailure
from kdaserve.cache.prefix_cache import PrefixHit, Snapshot, SnapshotPool


class DeviceOffload:
    def __init__(self, block_pool: BlockPool, snapshots: SnapshotPool,
                 offload: Offload | None) -> None:
        self.block_pool = block_pool
        self.snapshots = snapshots
        self.offload = offload
        self._promoted: dict[str, Snapshot] = {}     # this step: tier snapshots brought back
        if offload is not None:
            self._wire(offload)

    def _wire(self, off: Offload) -> None:
        cached = lambda h: self.block_pool.lookup(h) is not None  # noqa: E731
        self.block_pool.on_evict = lambda b: off.store_block(b.block_id, b.block_hash)
        self.snapshots.on_evict = lambda s: off.store_snapshot(
            s.snapshot_id, s.prefix_hash, s.position, s.chain, s.hits, cached)
        off.device_leads = self.snapshots.leads_to_snapshot
        off.on_orphans = self.demote_device

    # ---- which blocks go first ------------------------------------------------------------
    def leads(self, block_hash: bytes) -> bool:
        """The block leads to a snapshot somewhere (device or tier): it can still give a hit."""
        if self.offload is not None:
            return self.offload.leads(block_hash)
        return self.snapshots.leads_to_snapshot(block_hash)

    def demote(self, orphan_hashes: list[bytes]) -> None:
        """Device snapshots were dropped: blocks that lead to none any more go first."""
        self.demote_device(orphan_hashes)
        if self.offload is not None:
            self.offload.demote(orphan_hashes)

    def demote_device(self, orphan_hashes: list[bytes]) -> None:
        for h in orphan_hashes:
            block = self.block_pool.lookup(h)
            if block is not None and not self.leads(h):
                self.block_pool.demote(block)

    def begin_step(self, step: int) -> None:
        self._promoted = {}
        if self.offload is not None:
            self.offload.begin_step(step)

    # ---- cache operations -----------------------------------------------------------------
    def take_ops(self) -> list[CacheOp]:
        """The operations decided since the last call, in the order they must run."""
        return self.offload.take_ops() if self.offload is not None else []

    def settle(self, failures: list[OpFailure]) -> set[str]:
        """The runner could not carry out these operations: the entries leave their tiers.
        Returns the requests whose loads failed (the scheduler recomputes them)."""
        if self.offload is not None and failures:
            self.offload.settle(failures)
        failed = {f.request_id for f in failures if f.request_id is not None}
        for rid in failed:      # its snapshot never reached the device: never let a hit see it
            snap = self._promoted.pop(rid, None)
            if snap is not None and self.snapshots.by_id.get(snap.snapshot_id) is snap:
                self.demote(self.snapshots.drop(snap))
        return failed

    def flush(self, drop_device: bool, protect: set[int]) -> list[CacheOp]:
        """Store every device entry worth keeping in the tiers; `drop_device` also forgets the
        device copies of entries no request holds (`protect`: snapshots this step uses)."""
        off = self.offload
        if off is None:
            return []
        cached = lambda h: self.block_pool.lookup(h) is not None  # noqa: E731
        for snap in list(self.snapshots.by_hash.values()):
            off.store_snapshot(snap.snapshot_id, snap.prefix_hash, snap.position, snap.chain,
                               snap.hits, cached)
        for h, block in list(self.block_pool.cached.items()):
            off.store_block(block.block_id, h)
        if drop_device:
            for snap in list(self.snapshots.by_hash.values()):
                if snap.snapshot_id not in protect:
                    self.demote(self.snapshots.drop(snap))
            for block in list(self.block_pool.cached.values()):
                if block.ref_cnt == 0:
                    self.block_pool.forget(block)
        return off.take_ops()

    # ---- prefix hits reaching into a tier -------------------------------------------------
    def hit_blocks(self, hit: PrefixHit | None) -> list[Block | None] | None:
        """The hit's device blocks in order (None where only a tier holds it), or None when
        some entry is gone."""
        if hit is None:
            return []
        out: list[Block | None] = []
        for i, h in enumerate(hit.block_hashes):
            if i in hit.tier_blocks:
                if self.offload is None or not self.offload.holds(BLOCK, h):
                    return None
                out.append(None)
            else:
                block = self.block_pool.lookup(h)
                if block is None:
                    return None
                out.append(block)
        if hit.tier_snapshot and (self.offload is None or not self.offload.holds(
                SNAPSHOT, hit.block_hashes[-1])):
            return None
        return out

    def place_hit(self, request_id: str, slot: int | None, hit: PrefixHit,
                  hit_blocks: list[Block | None], fresh: list[Block], step: int,
                  protect: set[int]) -> tuple[list[Block], list[Block]]:
        """The hit's blocks in order (tier ones in fresh blocks, with their loads), and a tier
        snapshot loaded into `slot`. Returns those blocks and the fresh blocks left over."""
        rest = iter(fresh)
        placed = []
        used = set()
        for h, block in zip(hit.block_hashes, hit_blocks):
            if block is None:
                assert self.offload is not None
                block = next(rest)
                used.add(self.offload.load_block(h, block.block_id, request_id))
            placed.append(block)
        if hit.tier_snapshot:
            assert self.offload is not None and slot is not None
            used.add(self.offload.load_state(hit.block_hashes[-1], slot, request_id))
            self._promote(request_id, slot, hit, step, protect)
        for name in used:
            self.offload.counters[name].hits += 1
            self.offload.counters[name].hit_tokens += hit.num_tokens
        return placed, list(rest)

    def _promote(self, request_id: str, slot: int, hit: PrefixHit, step: int,
                 protect: set[int]) -> None:
        """Bring a tier snapshot back into the device pool (copied from the slot it was just
        loaded into), so the next hit on this prefix restores it from the device."""
        snap, orphans = self.snapshots.reserve(hit.block_hashes[-1], hit.num_tokens,
                                               hit.block_hashes, step, protect)
        self.demote(orphans)
        if snap is not None:
            assert self.offload is not None
            protect.add(snap.snapshot_id)
            self._promoted[request_id] = snap
            self.offload.keep_state(slot, snap.snapshot_id, request_id)
