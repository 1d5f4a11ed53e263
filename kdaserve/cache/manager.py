"""The facade the scheduler calls: block tables (MLA pages) and state slots (KDA) per request.

Plain Python over ids and counts; the runner owns the tensors these ids index. With offload
tiers, evictions from the device pools become store operations and prefix hits that reach into
a tier become load operations (see offload.py for the tiers, device_offload.py for the
component that links them to the device pools); `take_ops` hands them to the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdaserve.cache.block_pool import Block, BlockPool
from kdaserve.cache.device_offload import DeviceOffload
from kdaserve.cache.holds import PrefixHolds
from kdaserve.cache.offload import Offload
from kdaserve.cache.ops import BLOCK, SNAPSHOT, CacheOp, OpFailure
from kdaserve.cache.planner import CachePlan
from kdaserve.cache.prefix_cache import (
    CacheStats,
    PrefixHit,
    Snapshot,
    SnapshotPool,
    block_hashes,
    find_prefix_hit,
    placement,
)
from kdaserve.cache.state_pool import StatePool
from kdaserve.config import CacheConfig


@dataclass
class _Holding:
    blocks: list[Block] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # of `blocks`, read every step
    slot: int | None = None
    hashes: list[bytes] = field(default_factory=list)   # chained hashes of its full blocks
    num_cached_blocks: int = 0                          # blocks registered in the pool's map
    branch: int | None = None                           # snapshot position (policy 3)
    decode_snapshot: Snapshot | None = None             # its policy-4 snapshot


class CacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, *,
                 enable_prefix_caching: bool = False, num_snapshots: int = 0,
                 snapshot_bytes: int = 0, mla_bytes_per_token: int = 0,
                 snapshot_interval: int = 512, offload: Offload | None = None) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.state_pool = StatePool(num_slots)
        self.prefix_caching = enable_prefix_caching
        self.snapshots = SnapshotPool(num_snapshots if enable_prefix_caching else 0,
                                      snapshot_bytes, mla_bytes_per_token)
        self.snapshot_interval = snapshot_interval
        self._held: dict[str, _Holding] = {}
        self.stats = CacheStats()
        self.step = 0
        self._protect: set[int] = set()
        self.offload = offload if enable_prefix_caching else None
        self.tiers = DeviceOffload(self.block_pool, self.snapshots, self.offload)
        self.prefix_holds = PrefixHolds(self.block_pool)     # disaggregation's hit query (holds.py)

    @classmethod
    def from_plan(cls, plan: CachePlan, cache: CacheConfig,
                  offload: Offload | None = None) -> CacheManager:
        """The manager of a planned cache: the engine's, and `kdaserve plan --simulate`'s."""
        return cls(plan.num_blocks, plan.block_size, plan.num_state_slots,
                   enable_prefix_caching=cache.enable_prefix_caching,
                   num_snapshots=plan.num_snapshots, snapshot_bytes=plan.slot_bytes,
                   mla_bytes_per_token=plan.block_bytes // plan.block_size,
                   snapshot_interval=cache.state_snapshot_interval, offload=offload)

    def begin_step(self) -> None:
        self.step += 1
        self._protect = set()
        self.tiers.begin_step(self.step)

    # ---- cache operations -----------------------------------------------------------------
    def take_ops(self) -> list[CacheOp]:
        """The operations decided since the last call, in the order they must run."""
        return self.tiers.take_ops()

    def settle(self, failures: list[OpFailure]) -> set[str]:
        """The runner could not carry out these operations: the entries leave their tiers.
        Returns the requests whose loads failed (the scheduler recomputes them)."""
        return self.tiers.settle(failures)

    def flush(self, drop_device: bool = False) -> list[CacheOp]:
        """Store every device entry worth keeping in the tiers (at shutdown, so the disk tier
        holds what the device held). `drop_device` also forgets the device copies of entries no
        request holds, so the next hit is served from a tier (benchmarks, tests)."""
        return self.tiers.flush(drop_device, self._protect)

    # ---- queries --------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return list(self._held[request_id].block_ids)

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def slot(self, request_id: str) -> int:
        slot = self._held[request_id].slot
        assert slot is not None
        return slot

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
        return (not self._held and not self.prefix_holds
                and self.block_pool.num_free == self.block_pool.num_blocks
                and self.state_pool.num_free == self.state_pool.num_slots)

    # ---- changes --------------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make the request hold room for `num_tokens` tokens in total and a state slot, reusing
        the blocks of `hit` (a fresh request's prefix hit; blocks and a snapshot found only in
        an offload tier get fresh device blocks / the slot, and load operations). All or
        nothing: on False nothing changed."""
        held = self._held.get(request_id)
        if (held is not None and held.slot is not None
                and num_tokens <= len(held.blocks) * self.block_size):
            return True          # most decode steps: the room is held already
        need_slot = held is None or held.slot is None
        hit = hit if held is None else None
        hit_blocks = self.tiers.hit_blocks(hit)
        if hit_blocks is None:
            return False
        device_hit = [b for b in hit_blocks if b is not None]
        have = len(held.blocks) if held is not None else len(device_hit)
        need_blocks = max(0, -(-num_tokens // self.block_size) - have)
        free_after_touch = self.block_pool.num_free - sum(1 for b in device_hit if b.ref_cnt == 0)
        if need_blocks > free_after_touch or (need_slot and not self.state_pool.num_free):
            return False
        if held is None:
            held = self._held[request_id] = _Holding()
            if hit is not None:
                self._take_hit(held, hit, device_hit)
        if need_slot:
            held.slot = self.state_pool.allocate()
        fresh = self.block_pool.allocate(need_blocks) if need_blocks else []
        if hit is not None and hit.block_hashes:
            placed, fresh = self.tiers.place_hit(request_id, held.slot, hit, hit_blocks, fresh,
                                                 self.step, self._protect)
            held.blocks.extend(placed)
            held.block_ids.extend(b.block_id for b in placed)
            held.hashes = list(hit.block_hashes)
            # loaded blocks become findable on the device only once their step ran (commit): a
            # load that fails verification must never be found there
            held.num_cached_blocks = min(hit.tier_blocks, default=len(hit_blocks))
        held.blocks.extend(fresh)
        held.block_ids.extend(b.block_id for b in fresh)
        return True

    def _take_hit(self, held: _Holding, hit: PrefixHit, device_hit: list[Block]) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += hit.num_query_tokens
        self.stats.hits += bool(hit.num_tokens)
        self.stats.hit_tokens += hit.num_tokens
        if device_hit:
            self.block_pool.touch(device_hit)
        if hit.snapshot is not None:
            hit.snapshot.hits += 1
            hit.snapshot.last_use = self.step
            self._protect.add(hit.snapshot.snapshot_id)
        if hit.cached_mla_tokens > hit.num_tokens:
            held.branch = hit.cached_mla_tokens
        if self.offload is not None:
            for c in self.offload.counters.values():
                c.queries += 1
            # entries about to be loaded must survive the tier evictions that this step's
            # device evictions (stores) may cause
            for i in hit.tier_blocks:
                self.offload.protect(BLOCK, hit.block_hashes[i])
            if hit.tier_snapshot:
                self.offload.protect(SNAPSHOT, hit.block_hashes[-1])

    # ---- prefix caching -------------------------------------------------------------------
    def find_hit(self, tokens: list[int], extra_keys: tuple = (),
                 cache_salt: str | None = None) -> PrefixHit | None:
        """The hybrid prefix hit of this prompt (prefix_cache.find_prefix_hit); None without
        prefix caching."""
        if not self.prefix_caching:
            return None
        hashes = block_hashes(tokens, self.block_size, extra_keys, cache_salt)
        return find_prefix_hit(tokens, hashes, self.block_size, self.block_pool, self.snapshots,
                               self.offload, self.step)

    def hold(self, key: str, tokens: list[int], extra_keys: tuple, cache_salt: str | None,
             deadline: float) -> int:
        """Pin the device blocks of this prompt's prefix hit under `key` until `deadline`;
        returns how many leading tokens they hold (PrefixHolds.pin)."""
        self.prefix_holds.release(key)
        return self.prefix_holds.pin(key, self.find_hit(tokens, extra_keys, cache_salt),
                                     self.block_size, deadline)

    def held_hit(self, key: str, tokens: list[int], extra_keys: tuple = (),
                 cache_salt: str | None = None) -> PrefixHit | None:
        """The hold under `key` as a prefix hit of this prompt (see PrefixHolds.hit)."""
        return self.prefix_holds.hit(key, tokens, self.block_size, extra_keys, cache_salt)

    def release_hold(self, key: str) -> None:
        self.prefix_holds.release(key)

    def plan_snapshots(self, request_id: str, tokens: list[int], num_prompt: int, start: int,
                       end: int, extra_keys: tuple = (), cache_salt: str | None = None,
                       certain: int | None = None) -> list[tuple[int, int]]:
        """(position, snapshot id) pairs to take while computing tokens [start, end).

        Tokens past `certain` are speculative drafts: hashes over them are used for this plan
        but not remembered (a rejected draft's block must never be committed under them)."""
        if not self.prefix_caching or not self.snapshots.capacity:
            return []
        held = self._held[request_id]
        bs = self.block_size
        positions = placement((start, end), num_prompt, bs, self.snapshot_interval, held.branch)
        decode_p = end // bs * bs
        decode = start >= num_prompt and start < decode_p <= end
        if decode:
            positions.append(decode_p)
        if not positions:
            return []
        certain = end if certain is None else certain
        hashes = block_hashes(tokens[:end], bs, extra_keys, cache_salt, list(held.hashes))
        held.hashes = hashes[: max(len(held.hashes), certain // bs)]
        out = []
        for p in positions:
            chain = hashes[: p // bs]
            snap, orphans = self.snapshots.reserve(chain[-1], p, chain, self.step, self._protect)
            self.tiers.demote(orphans)
            if snap is None:
                continue
            self._protect.add(snap.snapshot_id)
            self.stats.snapshots_taken += 1
            if decode and p == decode_p:
                self._replace_decode_snapshot(held, snap)
            out.append((p, snap.snapshot_id))
        return out

    def commit(self, request_id: str, tokens: list[int], num_computed: int,
               extra_keys: tuple = (), cache_salt: str | None = None) -> None:
        """After a step: blocks now fully written become findable by their hash."""
        if not self.prefix_caching or request_id not in self._held:
            return
        held = self._held[request_id]
        full = num_computed // self.block_size
        if full <= held.num_cached_blocks:
            return
        held.hashes = block_hashes(tokens[: full * self.block_size], self.block_size,
                                   extra_keys, cache_salt, held.hashes)
        for i in range(held.num_cached_blocks, full):
            self.block_pool.cache_block(held.blocks[i], held.hashes[i])
        held.num_cached_blocks = full

    def drop_snapshots(self, snapshot_ids: list[int]) -> None:
        """Forget reserved snapshots that were never written (their position was a rejected
        draft)."""
        for sid in snapshot_ids:
            snap = self.snapshots.by_id.get(sid)
            if snap is not None:
                self.tiers.demote(self.snapshots.drop(snap))
                self.stats.snapshots_taken -= 1

    def _replace_decode_snapshot(self, held: _Holding, snap: Snapshot) -> None:
        """Policy 4 keeps one decode-time snapshot per request: the latest."""
        old = held.decode_snapshot
        live = old is not None and self.snapshots.by_hash.get(old.prefix_hash) is old
        if live and old.snapshot_id not in self._protect and old.hits == 0:
            self.tiers.demote(self.snapshots.drop(old))
        held.decode_snapshot = snap

    def free(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        # Tail first into the LRU queue (least likely shared); blocks that lead to no snapshot
        # can never produce a hit, so they go to the front, to be reused first.
        tail_first = list(reversed(held.blocks))
        self.block_pool.free(tail_first)
        for b in tail_first:
            if b.block_hash is None or not self.tiers.leads(b.block_hash):
                self.block_pool.demote(b)
        if held.slot is not None:
            self.state_pool.free(held.slot)
