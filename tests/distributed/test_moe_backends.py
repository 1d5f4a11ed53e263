"""Every MoE backend equals `reference` on random routings, on routings that leave experts
idle, and on one where a single expert receives every token; tp_sharded and ep_all2all on 2
gloo ranks (one spawn for both)."""

from __future__ import annotations

import json

import pytest
import torch

from kdaserve.bench.moe import compare_on_ranks, moe_config, random_moe, routings
from kdaserve.distributed.launch import run_ranks
from kdaserve.distributed.parallel_state import ParallelContext
from kdaserve.model.moe_backends import BACKENDS, choose
from kdaserve.model.registry import hf_config

TOKENS = [1, 5, 40]


@pytest.mark.parametrize("T", TOKENS)
def test_grouped_equals_reference(T):
    cfg = moe_config(experts=8, top_k=3, hidden=32, inter=16)
    moe = random_moe(cfg)
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(1))
    for name, (w, ids) in routings(T, 8, 3, seed=T).items():
        want = BACKENDS["reference"](moe, x, w, ids)
        got = BACKENDS["grouped"](moe, x, w, ids)
        assert (got - want).abs().max() < 1e-5, name
    moe.transpose_expert_storage()           # the compiled kernel's layout, where available
    for name, (w, ids) in routings(T, 8, 3, seed=T).items():
        got = BACKENDS["grouped"](moe, x, w, ids)
        assert (got - BACKENDS["reference"](moe, x, w, ids)).abs().max() < 1e-5, name


def test_routings_cover_the_edge_cases():
    r = routings(16, 8, 3)
    assert (r["one_expert_all"][1] == 0).any(1).all()           # every token picks expert 0
    assert r["idle_experts"][1].max() < 4                       # experts 4..7 get nothing


def test_parallel_backends_equal_reference(tmp_path):
    cfg = moe_config(experts=8, top_k=3, hidden=32, inter=16)
    out = tmp_path / "res.json"
    run_ranks(compare_on_ranks, 2, (hf_config(cfg), ["tp_sharded", "ep_all2all"], TOKENS, 1,
                                    str(out)), tp=2, ep=2, timeout_s=240)
    res = json.loads(out.read_text())
    for backend in ("tp_sharded", "ep_all2all"):
        for T in TOKENS:
            assert res[backend][str(T)]["max_abs_err"] < 1e-5, (backend, T)


def test_auto_choice_by_topology():
    assert choose("auto", 1, 1)[0] == "grouped"
    assert choose("auto", 2, 1)[0] == "tp_sharded"
    assert choose("auto", 2, 2)[0] == "ep_all2all"
    assert choose("auto", 1, 4)[0] == "ep_all2all"
    assert choose("reference", 1, 1) == ("reference", "asked for")
    assert ParallelContext(1, 2, 2, 1).ep_rank == 0
