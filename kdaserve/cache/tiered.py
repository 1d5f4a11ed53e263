"""The offload half of the cache manager's facade: the hooks that turn device evictions into
stores, the operations handed to the step, failures coming back, flushing the device cache to
the tiers, and placing a prefix hit whose blocks or snapshot sit in a tier.

A mixin of `CacheManager` (manager.py), split out to keep each file to one concern; it uses the
manager's pools and per-request holdings. Plain Python: see offload.py for the tiers' side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdaserve.cache.block_pool import Block, BlockPool
from kdaserve.cache.offload import Offload
from kdaserve.cache.ops import BLOCK, SNAPSHOT, CacheOp, OpFailure
from kdaserve.cache.prefix_cache import PrefixHit, Snapshot, SnapshotPool

if TYPE_CHECKING:
    from kdaserve.cache.manager import _Holding


class TieredCache:
    block_pool: BlockPool
    snapshots: SnapshotPool
    offload: Offload | None
    step: int
    _protect: set[int]
    _promoted: dict[str, Snapshot]       # this step: tier snapshots brought back

    # provided by CacheManager
    def _demote(self, orphan_hashes: list[bytes]) -> None: ...

    def _demote_device(self, orphan_hashes: list[bytes]) -> None: ...

    def _wire(self, off: Offload) -> None:
        cached = lambda h: self.block_pool.lookup(h) is not None  # noqa: E731
        self.block_pool.on_evict = lambda b: off.store_block(b.block_id, b.block_hash)
        self.snapshots.on_evict = lambda s: off.store_snapshot(
            s.snapshot_id, s.prefix_hash, s.position, s.chain, s.hits, cached)
        off.device_leads = self.snapshots.leads_to_snapshot
        off.on_orphans = self._demote_device

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
                self._demote(self.snapshots.drop(snap))
        return failed

    def flush(self, drop_device: bool = False) -> list[CacheOp]:
        """Store every device entry worth keeping in the tiers (at shutdown, so the disk tier
        holds what the device held). `drop_device` also forgets the device copies of entries no
        request holds, so the next hit is served from a tier (benchmarks, tests)."""
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
                if snap.snapshot_id not in self._protect:
                    self._demote(self.snapshots.drop(snap))
            for block in list(self.block_pool.cached.values()):
                if block.ref_cnt == 0:
                    self.block_pool.forget(block)
        return off.take_ops()

    def _hit_blocks(self, hit: PrefixHit | None) -> list[Block | None] | None:
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

    def _place_hit(self, request_id: str, held: _Holding, hit: PrefixHit,
                   hit_blocks: list[Block | None], fresh: list[Block]) -> list[Block]:
        """The hit's blocks in order (tier ones in fresh blocks, with their loads), and a tier
        snapshot loaded into the slot. Returns the fresh blocks left over."""
        rest = iter(fresh)
        used = set()
        for h, block in zip(hit.block_hashes, hit_blocks):
            if block is None:
                assert self.offload is not None
                block = next(rest)
                used.add(self.offload.load_block(h, block.block_id, request_id))
            held.blocks.append(block)
            held.block_ids.append(block.block_id)
        if hit.tier_snapshot:
            assert self.offload is not None and held.slot is not None
            used.add(self.offload.load_state(hit.block_hashes[-1], held.slot, request_id))
            self._promote(request_id, held.slot, hit)
        for name in used:
            self.offload.counters[name].hits += 1
            self.offload.counters[name].hit_tokens += hit.num_tokens
        held.hashes = list(hit.block_hashes)
        # loaded blocks become findable on the device only once their step ran (commit): a
        # load that fails verification must never be found there
        held.num_cached_blocks = min(hit.tier_blocks, default=len(hit_blocks))
        return list(rest)

    def _promote(self, request_id: str, slot: int, hit: PrefixHit) -> None:
        """Bring a tier snapshot back into the device pool (copied from the slot it was just
        loaded into), so the next hit on this prefix restores it from the device."""
        snap, orphans = self.snapshots.reserve(hit.block_hashes[-1], hit.num_tokens,
                                               hit.block_hashes, self.step, self._protect)
        self._demote(orphans)
        if snap is not None:
            assert self.offload is not None
            self._protect.add(snap.snapshot_id)
            self._promoted[request_id] = snap
            self.offload.keep_state(slot, snap.snapshot_id, request_id)
