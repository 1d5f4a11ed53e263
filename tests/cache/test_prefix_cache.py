"""Placement and eviction policy of the hybrid prefix cache, with exact ids and order."""

from __future__ import annotations

from kdaserve.cache.manager import CacheManager
from kdaserve.cache.prefix_cache import SnapshotPool, block_hashes, hash_block, placement


def test_hashes_are_chained_stable_and_keyed():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2 and a == block_hashes(list(range(10)), 4)
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    assert block_hashes(list(range(10)), 4, ("img:1",))[0] != a[0]
    assert block_hashes(list(range(10)), 4, cache_salt="s")[1] != a[1]   # through the chain
    assert block_hashes([9] + list(range(1, 10)), 4)[1] != a[1]
    grown = block_hashes(list(range(8)), 4)
    assert block_hashes(list(range(12)), 4, start=grown)[:2] == a


def test_placement_policy():
    # prompt of 37 tokens, blocks of 4, interval 16: last full block 36, every 16, branch 12
    assert placement((0, 37), 37, 4, 16, None) == [16, 32, 36]
    assert placement((0, 37), 37, 4, 16, 12) == [12, 16, 32, 36]
    assert placement((16, 37), 37, 4, 16, None) == [32, 36]     # a chunk of the same prompt
    assert placement((36, 37), 37, 4, 16, None) == []


def test_snapshot_eviction_prefers_least_saved_per_byte():
    pool = SnapshotPool(2, snapshot_bytes=1000, mla_bytes_per_token=10)
    s8, _ = pool.reserve(b"h8", 8, [b"b1", b"h8"], step=1, protect=set())
    s64, _ = pool.reserve(b"h64", 64, [b"b1", b"x", b"h64"], step=1, protect=set())
    assert pool.value(s8) < pool.value(s64)
    s32, orphans = pool.reserve(b"h32", 32, [b"b1", b"y", b"h32"], step=2, protect=set())
    assert s32.snapshot_id == s8.snapshot_id and b"h8" not in pool.by_hash
    assert orphans == [b"h8"]           # b1 still leads to other snapshots
    s64.hits = 0
    s32.hits = 5                        # a popular shorter prefix outweighs a longer one
    s16, _ = pool.reserve(b"h16", 16, [b"b1", b"h16"], step=3, protect=set())
    assert b"h64" not in pool.by_hash and b"h32" in pool.by_hash
    assert pool.reserve(b"h99", 99, [b"h99"], step=3, protect={s16.snapshot_id,
                                                               s32.snapshot_id})[0] is None


def test_hit_needs_snapshot_and_orphans_are_reused_first():
    m = CacheManager(num_blocks=6, block_size=4, num_slots=2, enable_prefix_caching=True,
                     num_snapshots=4, snapshot_bytes=100, mla_bytes_per_token=1,
                     snapshot_interval=1 << 20)
    tokens = list(range(100, 114))                # 14 tokens: 3 full blocks
    m.begin_step()
    hit = m.find_hit(tokens)
    assert hit.num_tokens == 0 and hit.cached_mla_tokens == 0
    assert m.allocate("a", 14, hit)
    assert m.plan_snapshots("a", tokens, 14, 0, 14) == [(12, 0)]   # end of last full block
    m.commit("a", tokens, 14)
    m.free("a")
    # blocks 0..2 lead to the snapshot: LRU tail; block 3 (partial, no hash) is reused first
    assert m.block_pool.free_order()[0] == 3
    m.begin_step()
    hit = m.find_hit(tokens[:12] + [1, 2, 3])
    assert hit.num_tokens == 12 and hit.snapshot.snapshot_id == 0
    other = tokens[:8] + [7, 7, 7, 7, 7]           # diverges inside block 2
    hit = m.find_hit(other)
    assert hit.num_tokens == 0 and hit.cached_mla_tokens == 8   # no snapshot at 8: a branch
    assert m.allocate("c", 13, hit)
    assert m.plan_snapshots("c", other, 13, 0, 13) == [(8, 1), (12, 2)]
