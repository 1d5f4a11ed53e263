"""The one executor of a step's cache operations (kdaserve/engine/cache_ops.py): what runs
before the forward, what the forward is handed, what settles after verification, and the one
outcome that comes back. On a small HybridCache with recognisable contents, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdaserve.cache.ops import (
    BLOCK,
    FreeRequest,
    LoadBlock,
    RestoreSnapshot,
    SettleDrafts,
    StoreBlock,
    TakeSnapshot,
)
from kdaserve.cache.stores import HostStore
from kdaserve.engine.cache_ops import CacheOpExecutor
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.layout.snapshots import SnapshotAt
from kdaserve.outputs import ScheduledSequence

CFG = SimpleNamespace(kda_num_heads=1, kda_head_dim=2, conv_kernel_size=3, kda_conv_dim=6,
                      mla_latent_dim=4, mla_layers=[1], kda_layers=[0, 2])


def _cache() -> HybridCache:
    c = HybridCache.allocate(CFG, num_blocks=4, block_size=2, num_slots=3, num_snapshots=3)
    for i, t in enumerate(c.snap_states + c.snap_conv + c.mla_pages):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 100 * i)
    return c


class _Kept:
    """States after each (row, position): a value that names them."""

    def __init__(self):
        self.calls = []

    def copy_to(self, rows, upto, states, convs, dest):
        self.calls.append([rows.tolist(), upto.tolist(), dest.tolist()])
        for st in states:
            st[dest] = (1000 + rows * 10 + upto).to(st.dtype).view(-1, 1, 1, 1)


def _seq(rid, tokens, ctx, slot, drafts=0):
    return ScheduledSequence(rid, tokens, ctx, [0], slot, True, num_draft_tokens=drafts)


def test_before_the_forward_in_order_and_what_is_left():
    cache, freed = _cache(), []
    ex = CacheOpExecutor(cache, {}, on_free=freed.append)
    ops = [FreeRequest("gone"), RestoreSnapshot("a", 2, 1), TakeSnapshot("a", 8, 0),
           TakeSnapshot("b", 4, 1), SettleDrafts("b", 2)]
    step = ex.begin(ops)
    assert freed == ["gone"]
    for st, cv, sst, scv in zip(cache.kda_states, cache.kda_conv, cache.snap_states,
                                cache.snap_conv):
        assert torch.equal(st[1], sst[2]) and torch.equal(cv[1], scv[2])
        assert not st[0].any() and not st[2].any()        # nothing else written
    # the forward takes a's snapshot; b verifies drafts, so its snapshot waits
    assert step.takes_for({"a": 0, "b": 1}) == [SnapshotAt(0, 8, 0)]
    assert set(step.settles) == {"b"} and step.outcome.failures == []
    with pytest.raises(TypeError, match="not a cache operation"):
        ex.begin([("a", 8, 0)])


def test_settle_rolls_back_and_takes_only_accepted_positions():
    cache = _cache()
    ex = CacheOpExecutor(cache, {})
    ops = [TakeSnapshot("v", 11, 0), TakeSnapshot("v", 13, 1), SettleDrafts("v", 2),
           SettleDrafts("w", 1)]
    step = ex.begin(ops)
    # v: context 10, last token + 3 drafts, 2 tokens stand; w: all 3 stand (no rollback)
    seqs = [_seq("v", [1, 2, 3, 4], 10, 2, 3), _seq("w", [5, 6, 7], 20, 1, 2),
            _seq("p", [8, 9], 0, 0)]
    kept = _Kept()
    ex.settle(step, seqs, [2, 3, 2], kept)
    # the slot of v gets the state after its 2nd token (row 0, upto 1); position 11 (1 token
    # of the step in) stood: snapshot 0 from (row 0, upto 0); position 13 did not: dropped
    assert kept.calls == [[[0], [1], [2]], [[0], [0], [0]]]
    assert step.outcome.dropped_snapshots == [1]
    assert float(cache.kda_states[0][2].flatten()[0]) == 1001.0       # slot 2 <- (0, 1)
    assert float(cache.snap_states[0][0].flatten()[0]) == 1000.0      # snapshot 0 <- (0, 0)
    assert not cache.kda_states[0][1].any()                          # w: nothing to roll


def test_a_verify_row_needs_its_settle_operation():
    ex = CacheOpExecutor(_cache(), {})
    step = ex.begin([])
    with pytest.raises(ValueError, match="SettleDrafts"):
        ex.settle(step, [_seq("v", [1, 2], 10, 2, 1)], [1], _Kept())


def test_a_failed_load_leaves_its_request_out():
    cache = _cache()
    store = HostStore("host")
    ex = CacheOpExecutor(cache, {"host": store})
    key = b"k" * 16
    ops = [StoreBlock(1, key, ("host",)), LoadBlock("host", b"x" * 16, 2, "a"),
           RestoreSnapshot("a", 1, 0), TakeSnapshot("a", 4, 2), TakeSnapshot("b", 4, 1)]
    before = [s.clone() for s in cache.kda_states]
    step = ex.begin(ops)
    assert store.get(BLOCK, key).tobytes() == cache.mla_pages[0][1].numpy().tobytes()
    assert [f.request_id for f in step.outcome.failures] == ["a"] and step.lost == {"a"}
    assert all(torch.equal(a, b) for a, b in zip(before, cache.kda_states))  # no restore
    assert step.outcome.dropped_snapshots == [2]      # a's snapshot is never written
    assert step.takes_for({"b": 0}) == [SnapshotAt(0, 4, 1)]


def test_outside_a_step_only_tier_operations():
    ex = CacheOpExecutor(_cache(), {"host": HostStore("host")})
    assert ex.run([StoreBlock(0, b"k" * 16, ("host",))]).failures == []
    with pytest.raises(ValueError, match="within a step"):
        ex.run([TakeSnapshot("a", 4, 0)])
