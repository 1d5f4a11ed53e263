"""Offload tiers under TP=2 (2 gloo processes): each rank keeps its share of every entry in
its own host store and disk directory, the engine one index. Hits come back from host memory
and disk with one process's greedy tokens; a restart finds every rank's disk entries; an entry
corrupt on one rank only is a miss on all of them (the ranks agree on the failures), and the
output does not change."""

from __future__ import annotations

import json
import logging

import pytest
from offload_cases import SMALL, generate, rounds
from tiny_models import random_model, tiny_config

from kdaserve import LLM
from kdaserve.cache.spec import specs_for
from kdaserve.config import ConfigError
from kdaserve.distributed.layout import rank_model_config
from kdaserve.model.loader import save_model
from kdaserve.model.registry import load_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi_linear")
    save_model(random_model(tiny_config(num_attention_heads=2)), out)
    model = str(out)
    cfg = load_config(model)
    prompts = rounds(cfg.vocab_size)
    ref = LLM(model, enable_prefix_caching=False, block_size=4, num_threads=1)
    expected = [generate(ref, r)[0] for r in prompts]
    # a rank's snapshot: its heads' states (the budget is per rank, as the planner sizes it)
    snap = specs_for(rank_model_config(cfg, 2), 4, "float32")[1].bytes_per_slot
    return model, prompts, expected, snap


def _llm(model: str, snap: int, directory, tiers: str = "host,disk") -> LLM:
    return LLM(model, tensor_parallel_size=2, num_threads=1, state_snapshot_budget=4 * snap,
               offload=tiers, offload_dir=str(directory), **SMALL)


def _stats(llm: LLM, name: str) -> dict:
    from kdaserve.engine.tier_transfer import offload_stats

    return offload_stats(llm.engine.cache.offload, llm.engine.executor.transfer_stats())[name]


def _rank_dirs(directory) -> dict[int, object]:
    out = {}
    for ident in directory.glob("*/identity.json"):
        out[json.loads(ident.read_text())["layout"]["rank"]] = ident.parent
    return out


def test_tp2_offload_hits_restart_and_one_rank_corrupt(setup, tmp_path, caplog):
    model, prompts, expected, snap = setup
    llm = _llm(model, snap, tmp_path)
    try:
        assert generate(llm, prompts[0])[0] == expected[0]
        got, cached = generate(llm, prompts[1])
        assert got == expected[1]
        assert all(c >= 24 for c in cached)            # every root came back from a tier
        host = _stats(llm, "host")
        assert host["hits"] >= 3 and host["loaded_entries"] > 0 and host["stored_bytes"] > 0
        llm.close()                                    # the device cache goes to the tiers
    finally:
        llm.shutdown()
    dirs = _rank_dirs(tmp_path)
    assert set(dirs) == {0, 1}                         # a directory per rank
    n0 = sum(1 for p in dirs[0].rglob("*") if p.is_file())
    assert n0 > 1 and n0 == sum(1 for p in dirs[1].rglob("*") if p.is_file())

    again = _llm(model, snap, tmp_path, "disk")        # a restart on the same directory
    try:
        got, cached = generate(again, prompts[1][:1])
        assert got == expected[1][:1] and cached[0] >= 24
    finally:
        again.shutdown()

    # rank 1's copy of every entry loses a byte; rank 0's stays good: all ranks miss
    for path in dirs[1].rglob("*"):
        if path.is_file() and path.name != "identity.json":
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x5A
            path.write_bytes(bytes(data))
    broken = _llm(model, snap, tmp_path, "disk")
    try:
        with caplog.at_level(logging.WARNING, logger="kdaserve"):
            got, _ = generate(broken, prompts[1])
        assert got == expected[1]
        assert _stats(broken, "disk")["load_failures"] >= 1
    finally:
        broken.shutdown()


def test_offload_with_data_parallel_is_refused(setup, tmp_path):
    model, *_ = setup
    with pytest.raises(ConfigError, match="data-parallel"):
        LLM(model, data_parallel_size=2, expert_parallel_size=2, offload="host")
