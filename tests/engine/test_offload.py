"""Offload tiers end to end: greedy output stays token-identical to prefix caching off while
hits come back from host memory or disk, across a restart, past corrupt entries, under a tiny
tier cap and with a directory that stops being writable."""

from __future__ import annotations

import logging
import shutil

import pytest
from offload_cases import SMALL, generate, rounds

from kdaserve import LLM
from kdaserve.cache.stores import OffloadError


@pytest.fixture(scope="module")
def setup(hf_checkpoint):
    model = str(hf_checkpoint[0])
    ref = LLM(model, enable_prefix_caching=False, block_size=4)
    prompts = rounds(hf_checkpoint[1].config.vocab_size)
    expected = [generate(ref, r)[0] for r in prompts]
    snap = ref.engine.cache.snapshots.snapshot_bytes
    return model, prompts, expected, snap


def tier(llm: LLM, name: str) -> dict:
    from kdaserve.engine.tier_transfer import offload_stats

    return offload_stats(llm.engine.cache.offload, llm.engine.runner.cache_ops.stats)[name]


def test_host_and_disk_tiers_hit_and_match_caching_off(setup, tmp_path):
    model, prompts, expected, snap = setup
    llm = LLM(model, state_snapshot_budget=4 * snap, offload="host,disk",
              offload_dir=str(tmp_path), **SMALL)
    assert generate(llm, prompts[0])[0] == expected[0]
    got, cached = generate(llm, prompts[1])
    assert got == expected[1]
    assert all(c >= 24 for c in cached)            # every root came back from a tier
    host, disk = tier(llm, "host"), tier(llm, "disk")
    assert host["hits"] >= 3 and host["loaded_entries"] > 0 and host["stored_bytes"] > 0
    assert disk["stored_entries"] == host["stored_entries"]   # inclusive: both got the writes
    assert disk["loaded_entries"] == 0             # host sits in front
    assert llm.engine.cache.block_pool.num_free == llm.engine.cache.block_pool.num_blocks
    check_metrics(llm)


def check_metrics(llm: LLM) -> None:
    """The tier counters travel in the engine's stats snapshot (msgpack) into /metrics."""
    import msgspec

    from kdaserve.engine.engine_process import EngineLoop
    from kdaserve.engine.wire import EngineStatsSnapshot
    from kdaserve.server.metrics import ServerMetrics

    snap = EngineLoop(llm.engine, None, None, None)._stats()
    snap = msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=EngineStatsSnapshot)
    text = ServerMetrics().render(msgspec.structs.asdict(snap)).decode()
    for line in ('kdaserve:offload_hits_total{tier="host"}', 'kdaserve:offload_hit_rate{tier=',
                 'kdaserve:offload_loaded_bytes_total{tier="disk"} 0.0',
                 'kdaserve:offload_load_seconds_total{tier="host"}'):
        assert line in text, line


def test_restart_finds_the_disk_tier_and_corrupt_entries_are_recomputed(setup, tmp_path,
                                                                          caplog):
    model, prompts, expected, snap = setup
    kw = dict(state_snapshot_budget=4 * snap, offload="disk", offload_dir=str(tmp_path), **SMALL)
    first = LLM(model, **kw)
    assert generate(first, prompts[0])[0] == expected[0]
    first.close()                                  # what the device held goes to disk too
    backup = tmp_path.parent / (tmp_path.name + "-copy")
    shutil.copytree(tmp_path, backup)

    again = LLM(model, **kw)                       # a new engine on the same directory
    got, cached = generate(again, prompts[1][:1])
    assert got == expected[1][:1] and cached[0] >= 24   # the very first request hits

    # flip one payload byte in every entry: each load fails its checksum, is logged as a
    # miss and the request is recomputed; the output does not change
    for path in backup.rglob("*"):
        if path.is_file() and path.name != "identity.json":
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x5A
            path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kdaserve"):
        broken = LLM(model, **{**kw, "offload_dir": str(backup)})
        got, cached = generate(broken, prompts[1])
    assert got == expected[1]
    assert tier(broken, "disk")["load_failures"] >= 1
    assert "checksum mismatch" in caplog.text


def test_small_cap_and_unwritable_directory(setup, tmp_path):
    model, prompts, expected, snap = setup
    with pytest.raises(OffloadError, match="not writable"):
        (tmp_path / "file").write_text("x")
        LLM(model, offload="disk", offload_dir=str(tmp_path / "file" / "dir"), **SMALL)
    # a host tier that holds about two snapshots and their blocks: it evicts all the time
    llm = LLM(model, state_snapshot_budget=4 * snap, offload="host",
              offload_bytes=3 * snap, **SMALL)
    assert [generate(llm, r)[0] for r in prompts] == expected
    assert tier(llm, "host")["evictions"] > 0
    assert tier(llm, "host")["bytes"] <= 3 * snap

    # the disk tier's directory stops accepting writes mid-run: logged misses, no crash
    llm = LLM(model, state_snapshot_budget=4 * snap, offload="disk",
              offload_dir=str(tmp_path / "d"), **SMALL)
    root = llm.engine.runner.cache_ops.stores["disk"].root
    for kind in ("block", "snapshot"):
        shutil.rmtree(root / kind)
        (root / kind).write_text("not a directory any more")
    assert [generate(llm, r)[0] for r in prompts] == expected
    assert tier(llm, "disk")["store_failures"] > 0 and tier(llm, "disk")["entries"] == 0
