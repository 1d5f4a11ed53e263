from __future__ import annotations

import pytest

from kdaserve.cache.block_pool import BlockPool
from kdaserve.cache.manager import CacheManager
from kdaserve.cache.planner import plan_cache
from kdaserve.cache.spec import KDAStateSpec, LatentKVSpec
from kdaserve.cache.state_pool import StatePool


def test_lru_free_order_and_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1] and pool.free_order() == [2, 3]
    pool.touch([a[0]])
    pool.free(list(reversed(a)))           # tail first
    assert pool.free_order() == [2, 3, 1]  # block 0 still referenced
    pool.free([a[0]])
    assert pool.free_order() == [2, 3, 1, 0]
    with pytest.raises(RuntimeError):
        pool.free([a[0]])


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h")
    pool.free([b])
    assert pool.lookup(b"h") is b
    pool.touch([b])                       # a hit pulls it out of the free queue
    assert pool.num_free == 1 and b.ref_cnt == 1
    pool.free([b])
    pool.allocate(2)                      # reuse evicts the hash
    assert pool.lookup(b"h") is None


def test_manager_all_or_nothing():
    m = CacheManager(num_blocks=3, block_size=4, num_slots=1)
    assert m.allocate("a", 8) and m.block_ids("a") == [0, 1] and m.slot("a") == 0
    assert not m.allocate("b", 1)         # no slot left
    assert not m.allocate("a", 13)        # needs 2 more blocks, 1 free: unchanged
    assert m.block_ids("a") == [0, 1]
    m.free("a")
    assert m.all_free()


def test_state_pool_double_free():
    p = StatePool(2)
    s = p.allocate()
    p.free(s)
    with pytest.raises(RuntimeError):
        p.free(s)


def test_planner_splits_budget():
    lat = LatentKVSpec(num_layers=2, block_size=16, latent_dim=80, dtype_bytes=4)
    st = KDAStateSpec(num_layers=6, num_heads=4, head_dim=64, conv_width=3, conv_dim=768,
                      dtype_bytes=4)
    plan = plan_cache(lat, st, 64 << 20, max_num_seqs=8)
    assert plan.num_state_slots == 8
    assert plan.num_blocks == ((64 << 20) - 8 * st.bytes_per_slot) // lat.bytes_per_block
    assert "tokens of MLA cache" in plan.describe()
    with pytest.raises(ValueError, match="too small"):
        plan_cache(lat, st, 1 << 20, max_num_seqs=8)
