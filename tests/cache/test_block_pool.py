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


class _EagerPool:
    """The queue as one OrderedDict of every block (BlockPool makes a block's record when it
    is first handed out): the order BlockPool must keep."""

    def __init__(self, n: int) -> None:
        self.free = dict.fromkeys(range(n))
        self.refs = [0] * n

    def allocate(self, n: int) -> list[int]:
        out = list(self.free)[:n]
        for i in out:
            del self.free[i]
            self.refs[i] = 1
        return out

    def release(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.free[i] = None

    def demote(self, i: int) -> None:
        if self.refs[i] == 0 and i in self.free:
            del self.free[i]
            self.free = {i: None, **self.free}

    def touch(self, i: int) -> None:
        if self.refs[i] == 0:
            del self.free[i]
        self.refs[i] += 1


def test_free_order_equals_one_queue_of_every_block():
    """Random allocations, frees, demotions and hits: the same ids handed out and the same
    free order as one LRU queue holding every block from the start."""
    import random

    rng = random.Random(5)
    pool, ref = BlockPool(12), _EagerPool(12)
    seen: dict[int, object] = {}                 # every block record handed out so far
    held: list[object] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.35 and pool.num_free:
            n = rng.randint(1, pool.num_free)
            got = pool.allocate(n)
            assert [b.block_id for b in got] == ref.allocate(n)
            for b in got:
                assert seen.setdefault(b.block_id, b) is b        # one record per id
            held += got
        elif op < 0.65 and held:
            out = rng.sample(held, rng.randint(1, len(held)))
            for b in out:
                held.remove(b)
            pool.free(out)
            ref.release([b.block_id for b in out])
        elif op < 0.85 and seen:
            b = rng.choice(list(seen.values()))
            pool.demote(b)
            ref.demote(b.block_id)
        elif seen:
            b = rng.choice(list(seen.values()))
            if b.ref_cnt == 0 and b.block_id not in pool.free_order():
                continue
            pool.touch([b])
            ref.touch(b.block_id)
            held.append(b)
        assert pool.free_order() == list(ref.free) and pool.num_free == len(ref.free)
    assert pool.num_blocks == 12
