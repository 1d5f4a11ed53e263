"""Offload tiers, bookkeeping and storage: which operations eviction and hits emit, in which
order; the tier's eviction policy; checksums, crash leftovers and restart scans. No torch."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from kdaserve.cache.identity import cache_layout, offload_identity
from kdaserve.cache.manager import CacheManager
from kdaserve.cache.offload import Offload
from kdaserve.cache.ops import (
    BLOCK,
    SNAPSHOT,
    DropEntry,
    KeepState,
    LoadBlock,
    LoadState,
    OpFailure,
    StoreBlock,
    StoreSnapshot,
)
from kdaserve.cache.stores import DiskStore, EntryCorrupt, HostStore, OffloadError
from kdaserve.cache.tiers import Tier, TierEntry

BS = 4


def manager(num_blocks: int = 5, num_snapshots: int = 1, cap: int = 1 << 20) -> CacheManager:
    off = Offload([Tier("host", cap, snapshot_bytes=100, mla_bytes_per_token=1)],
                  block_bytes=BS, snapshot_bytes=100)
    return CacheManager(num_blocks, BS, num_slots=2, enable_prefix_caching=True,
                        num_snapshots=num_snapshots, snapshot_bytes=100, mla_bytes_per_token=1,
                        snapshot_interval=1 << 20, offload=off)


def run(m: CacheManager, rid: str, tokens: list[int]) -> tuple[list, object]:
    """One request through one prefill step; returns (ops of that step, its hit)."""
    m.begin_step()
    hit = m.find_hit(tokens)
    assert m.allocate(rid, len(tokens), hit)
    m.plan_snapshots(rid, tokens, len(tokens), hit.num_tokens, len(tokens))
    ops = m.take_ops()
    m.commit(rid, tokens, len(tokens))
    m.free(rid)
    return ops, hit


def test_evictions_store_and_a_hit_loads_back_in_order():
    m = manager()
    a = list(range(100, 113))                      # 3 full blocks, snapshot at 12
    ops, _ = run(m, "a", a)
    assert ops == []                               # nothing evicted yet
    b = list(range(200, 213))
    ops, _ = run(m, "b", b)
    # b needs 4 blocks of 5: a's chain is reused (stored first), and b's snapshot evicts a's
    kinds = [type(o) for o in ops]
    assert StoreSnapshot in kinds and StoreBlock in kinds
    snap = next(o for o in ops if isinstance(o, StoreSnapshot))
    assert snap.position == 12 and snap.tiers == ("host",) and len(snap.chain) == 3
    m.begin_step()
    hit = m.find_hit(a + [1])
    assert hit.num_tokens == 12 and hit.snapshot is None and hit.tier_snapshot
    assert hit.tier_blocks                         # at least one block only in the tier
    assert m.allocate("a2", 14, hit)
    ops = m.take_ops()
    loads = [o for o in ops if isinstance(o, (LoadBlock, LoadState))]
    stores = [o for o in ops if isinstance(o, StoreBlock)]
    assert len([o for o in loads if isinstance(o, LoadBlock)]) == len(hit.tier_blocks)
    assert loads[-1] == LoadState("host", hit.block_hashes[-1], m.slot("a2"), "a2")
    # stores of the blocks a2 took over come before the loads that overwrite them
    assert all(ops.index(s) < ops.index(loads[0]) for s in stores)
    # the snapshot comes back to the device: copied from the slot into the id it evicts,
    # after that id's old content went to the tier
    keep = ops[-1]
    assert keep == KeepState(m.slot("a2"), keep.snapshot_id, "a2")
    victim = next(o for o in ops if isinstance(o, StoreSnapshot))
    assert victim.snapshot_id == keep.snapshot_id and ops.index(victim) < len(ops) - 1
    promoted = m.snapshots.by_id[keep.snapshot_id]
    assert promoted.prefix_hash == hit.block_hashes[-1] and promoted.position == 12
    loaded = {o.block_id for o in loads if isinstance(o, LoadBlock)}
    assert loaded <= set(m.block_ids("a2")[:3])
    # loaded blocks are findable on the device only after their step committed
    assert all(m.block_pool.lookup(hit.block_hashes[i]) is None for i in hit.tier_blocks)
    m.commit("a2", a + [1], 14)
    assert all(m.block_pool.lookup(h) is not None for h in hit.block_hashes)


def test_failed_load_forgets_the_entry_and_the_next_hit_is_shorter():
    m = manager()
    a = list(range(100, 113))
    run(m, "a", a)
    run(m, "b", list(range(200, 213)))
    m.begin_step()
    hit = m.find_hit(a + [1])
    assert m.allocate("a2", 14, hit)
    ops = m.take_ops()
    bad = next(o for o in ops if isinstance(o, LoadState))
    failed = m.settle([OpFailure("host", SNAPSHOT, bad.key, "a2", "load: checksum mismatch")])
    assert failed == {"a2"}
    assert m.take_ops() == [DropEntry("host", SNAPSHOT, bad.key)]   # the store forgets it too
    assert bad.key not in m.snapshots.by_hash      # nor is it promoted to the device
    m.free("a2")
    assert m.offload.counters["host"].load_failures == 1
    m.begin_step()
    assert m.find_hit(a + [1]).num_tokens == 0      # no snapshot anywhere: recomputed


def test_orphan_blocks_are_not_stored_and_flush_drops_device_copies():
    m = manager(num_blocks=8, num_snapshots=2)
    a = list(range(100, 113))
    run(m, "a", a)
    m.begin_step()
    ops = m.flush(drop_device=True)
    assert [type(o) for o in ops] == [StoreSnapshot] + [StoreBlock] * 3
    assert not m.block_pool.cached and not m.snapshots.by_hash
    m.begin_step()
    hit = m.find_hit(a + [1])
    assert hit.num_tokens == 12 and hit.tier_blocks == {0, 1, 2} and hit.tier_snapshot
    # a block that leads to no snapshot is never worth a tier write
    m.offload.store_block(7, b"x" * 16)
    assert m.take_ops() == []


def test_tier_eviction_orphans_first_then_least_valuable_snapshot():
    t = Tier("host", capacity_bytes=400, snapshot_bytes=100, mla_bytes_per_token=1)
    off = Offload([t], block_bytes=50, snapshot_bytes=100)
    leads = off.leads
    for e in (TierEntry(SNAPSHOT, b"s8", 100, 8, (b"a",)),
              TierEntry(SNAPSHOT, b"s64", 100, 64, (b"b",))):
        assert t.admit(e, leads, set()) == []
        off._added(e)
    for key in (b"a", b"b"):
        assert t.admit(TierEntry(BLOCK, key, 50), leads, set()) == []
    assert t.admit(TierEntry(BLOCK, b"o", 50), leads, set()) == []   # an orphan
    victims = t.admit(TierEntry(BLOCK, b"new", 150), leads, set())
    assert [v.key for v in victims] == [b"o", b"s8"]     # orphan, then the cheaper snapshot
    assert t.admit(TierEntry(SNAPSHOT, b"big", 500), leads, set()) is None
    assert t.admit(TierEntry(BLOCK, b"z", 400), leads,
                   {(BLOCK, k) for k in t.blocks} | {(SNAPSHOT, k) for k in t.snapshots}) is None


def test_host_store_checksums():
    s = HostStore()
    s.put(BLOCK, b"k" * 16, memoryview(b"abcdef"))
    assert bytes(s.get(BLOCK, b"k" * 16)) == b"abcdef"
    s.get(BLOCK, b"k" * 16)[0] = ord("X")          # memory corruption
    with pytest.raises(EntryCorrupt):
        s.get(BLOCK, b"k" * 16)
    with pytest.raises(EntryCorrupt):
        s.get(SNAPSHOT, b"k" * 16)


def test_disk_store_round_trip_corruption_and_restart_scan(tmp_path):
    ident = b"i" * 16
    s = DiskStore(tmp_path, ident, {"model": "x"}, min_free_bytes=1)
    key, chain = b"s" * 16, (b"a" * 16, b"s" * 16)
    s.put(SNAPSHOT, key, memoryview(b"state" * 100), position=8, chain=chain)
    s.put(BLOCK, b"a" * 16, memoryview(b"latent" * 10))
    assert bytes(s.get(SNAPSHOT, key)) == b"state" * 100
    # a crash mid-write leaves a temporary file: the next scan removes it
    (s.path(BLOCK, b"a" * 16).parent / ("b" * 32 + ".tmp-1-0")).write_bytes(b"partial")
    again = DiskStore(tmp_path, ident, {"model": "x"}, min_free_bytes=1)
    found = {(e.kind, e.key): e for e in again.scan()}
    assert set(found) == {(SNAPSHOT, key), (BLOCK, b"a" * 16)}
    assert found[(SNAPSHOT, key)].position == 8 and found[(SNAPSHOT, key)].chain == chain
    assert not list(tmp_path.rglob("*.tmp-*"))
    path = s.path(SNAPSHOT, key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF                               # flip a payload byte
    path.write_bytes(bytes(data))
    with pytest.raises(EntryCorrupt, match="checksum"):
        s.get(SNAPSHOT, key)
    path.write_bytes(bytes(data[:-10]))            # truncated
    with pytest.raises(EntryCorrupt):
        s.get(SNAPSHOT, key)
    # another model's store does not read these files (different directory, and the header
    # names the identity)
    other = DiskStore(tmp_path, b"j" * 16, {"model": "y"}, min_free_bytes=1)
    assert other.scan() == []
    moved = other.path(BLOCK, b"a" * 16)
    moved.parent.mkdir(exist_ok=True)
    os.replace(s.path(BLOCK, b"a" * 16), moved)
    with pytest.raises(EntryCorrupt, match="another"):
        other.get(BLOCK, b"a" * 16)


def test_disk_store_unwritable_or_full_is_a_clear_error(tmp_path):
    if os.geteuid() == 0:
        blocked = tmp_path / "file"
        blocked.write_text("not a directory")
    else:
        blocked = tmp_path / "ro"
        blocked.mkdir(mode=0o500)
    with pytest.raises(OffloadError, match="not writable"):
        DiskStore(blocked / "sub", b"i" * 16, {}, min_free_bytes=1)
    with pytest.raises(OffloadError, match="bytes free"):
        DiskStore(tmp_path, b"i" * 16, {}, min_free_bytes=1 << 62)


def test_identity_depends_on_config_weights_and_layout(tmp_path):
    class Cfg:
        mla_layers, mla_latent_dim, kda_layers = (3,), 80, (0, 1, 2)
        kda_num_heads, kda_head_dim, conv_kernel_size, kda_conv_dim = 4, 64, 4, 768

    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + b"0" * 99)
    layout = cache_layout(Cfg, 16, "float32", 16, "cpu")
    base, described = offload_identity(tmp_path, layout)
    assert described["layout"]["block_size"] == 16
    assert offload_identity(tmp_path, cache_layout(Cfg, 32, "float32", 16, "cpu"))[0] != base
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + b"1" * 99)
    assert offload_identity(tmp_path, layout)[0] != base           # same metadata, new weights
    (tmp_path / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + b"0" * 99)
    assert offload_identity(tmp_path, layout)[0] == base
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert offload_identity(tmp_path, layout)[0] != base


def test_restart_seed_trims_to_the_cap_keeping_what_leads_to_snapshots():
    t = Tier("disk", capacity_bytes=300, snapshot_bytes=100, mla_bytes_per_token=1)
    off = Offload([t], block_bytes=50, snapshot_bytes=100)
    found = [TierEntry(SNAPSHOT, b"s", 100, 8, (b"a", b"b")),
             TierEntry(BLOCK, b"a", 50), TierEntry(BLOCK, b"orphan", 50),
             TierEntry(BLOCK, b"b", 50), TierEntry(BLOCK, b"late", 100)]
    dropped = off.seed(t, found)
    assert [e.key for e in dropped] == [b"orphan"]   # not a, b: they lead to the snapshot
    assert set(t.blocks) == {b"a", b"b", b"late"} and set(t.snapshots) == {b"s"}
    assert t.bytes_held == 300
    assert off.take_ops() == []                    # the caller deletes what was dropped


def _fault(path, fault: str, good: bytes) -> None:
    """Puts a damaged entry where a good one was: the disk-tier probes of issue 35."""
    path.unlink(missing_ok=True)
    if fault == "fifo":
        os.mkfifo(path)
    elif fault == "directory":
        path.mkdir()
        (path / "inner").write_bytes(good)
    elif fault == "oversized":                      # a valid entry, then junk
        path.write_bytes(good + b"\0" * 4096)
    elif fault == "sparse":                         # a valid header, then a huge hole
        path.write_bytes(good[:200])
        os.truncate(path, 1 << 40)
    else:
        raise AssertionError(fault)


@pytest.mark.parametrize("fault", ["fifo", "directory", "oversized", "sparse"])
def test_disk_store_damaged_entries_are_misses_and_scans_remove_them(tmp_path, fault):
    ident, sizes = b"i" * 16, {BLOCK: 60, SNAPSHOT: 500}
    s = DiskStore(tmp_path, ident, {}, min_free_bytes=1, payload_bytes=sizes)
    keys = {BLOCK: b"b" * 16, SNAPSHOT: b"s" * 16}
    s.put(SNAPSHOT, keys[SNAPSHOT], memoryview(b"state" * 100), position=8,
          chain=(b"b" * 16,))
    s.put(BLOCK, keys[BLOCK], memoryview(b"latent" * 10))
    for kind, key in keys.items():
        path = s.path(kind, key)
        good = path.read_bytes()
        _fault(path, fault, good)
        # the load is a miss, at once: a FIFO must not wait for a writer
        errors: list[BaseException] = []

        def load(kind=kind, key=key, errors=errors):
            try:
                s.get(kind, key)
            except BaseException as exc:            # noqa: BLE001 - recorded for the assert
                errors.append(exc)
        t = threading.Thread(target=load, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"loading a {fault} blocked"
        assert len(errors) == 1 and isinstance(errors[0], (EntryCorrupt, OSError)), errors
    # a restart's scan removes both (directories included), counts them, and does not raise
    again = DiskStore(tmp_path, ident, {}, min_free_bytes=1, payload_bytes=sizes)
    assert again.scan() == []
    assert again.dropped == 2
    assert not any(os.path.lexists(s.path(k, key)) for k, key in keys.items())
    # dropping a damaged entry never raises either
    _fault(s.path(BLOCK, keys[BLOCK]), fault, b"x" * 300)
    again.drop(BLOCK, keys[BLOCK])
    assert not os.path.lexists(s.path(BLOCK, keys[BLOCK]))


def test_disk_store_scan_checks_block_headers_and_layout_sizes(tmp_path):
    ident = b"i" * 16
    s = DiskStore(tmp_path, ident, {}, min_free_bytes=1)
    s.put(BLOCK, b"a" * 16, memoryview(b"x" * 60))
    s.put(BLOCK, b"b" * 16, memoryview(b"x" * 61))    # another layout's size
    bad = s.path(BLOCK, b"c" * 16)
    bad.parent.mkdir(exist_ok=True)
    bad.write_bytes(b"\0" * 200)                       # no header at all
    junk = s.root / BLOCK / "zz"
    junk.write_bytes(b"a file where a shard directory belongs")
    again = DiskStore(tmp_path, ident, {}, min_free_bytes=1,
                      payload_bytes={BLOCK: 60, SNAPSHOT: 10})
    assert [e.key for e in again.scan()] == [b"a" * 16]
    assert again.dropped == 3 and not bad.exists() and not junk.exists()
    # a file in place of a kind's directory, or of identity.json, does not stop a start
    shutil.rmtree(again.root / SNAPSHOT)
    (again.root / SNAPSHOT).write_bytes(b"junk")
    (again.root / "identity.json").unlink()
    (again.root / "identity.json").mkdir()
    third = DiskStore(tmp_path, ident, {}, min_free_bytes=1)
    assert (third.root / SNAPSHOT).is_dir() and (third.root / "identity.json").is_file()
    assert [e.key for e in third.scan()] == [b"a" * 16]
