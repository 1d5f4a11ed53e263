"""Attention data parallel with expert-parallel MoE (DP=2 x EP=2, 2 gloo processes): the MoE
exchange with each rank's own tokens (one rank without any) equals `reference`; placement
keeps a prefix hit on the rank that wrote the prefix; the engine gives the same greedy tokens
and logprobs as one process on a tiny Kimi Linear and a tiny K3, with prefix hits and n-gram
speculation, each rank running its share of the requests."""

from __future__ import annotations

import json

import pytest
import torch

from kdaserve.cache.ops import (
    CacheOutcome,
    DropEntry,
    FreeRequest,
    RestoreSnapshot,
    TakeSnapshot,
)
from kdaserve.bench.moe import moe_config, random_moe, rank_share, routings
from kdaserve.config import ConfigError
from kdaserve.distributed.data_parallel import Placement, merge, rank_share as dp_share
from kdaserve.distributed.launch import run_ranks
from kdaserve.engine.llm import LLM
from kdaserve.model.moe_backends import BACKENDS
from kdaserve.model.registry import hf_config
from kdaserve.request import SamplingParams
from kdaserve.outputs import ModelRunnerOutput, SampledToken, ScheduledSequence, SchedulerOutput

from test_layouts import GREEDY, LOOP, _assert_same, k3, kimi_linear  # noqa: F401 - fixtures


def _own_tokens(ctx, raw: dict, counts: list[int], out_path: str) -> None:
    """Rank r routes counts[r] tokens of its own through ep_all2all (tokens_local)."""
    from kdaserve.model.registry import load_config

    cfg = load_config(raw)
    full = random_moe(cfg)
    moe = rank_share(full, "ep_all2all", ctx)
    assert moe.tokens_local
    T = counts[ctx.rank]
    x = torch.randn(T, cfg.expert_width, generator=torch.Generator().manual_seed(10 + ctx.rank))
    err = 0.0
    for w, ids in routings(T, cfg.num_experts, cfg.num_experts_per_token,
                           seed=ctx.rank).values():
        got = BACKENDS["ep_all2all"](moe, x, w, ids)
        assert got.shape == x.shape
        err = max([err] + ([(got - BACKENDS["reference"](full, x, w, ids)).abs().max().item()]
                           if T else []))
    with open(f"{out_path}.{ctx.rank}", "w") as f:
        json.dump({"err": err}, f)


@pytest.mark.parametrize("counts", [[7, 3], [5, 0]])
def test_ep_all2all_with_each_ranks_own_tokens(tmp_path, counts):
    cfg = moe_config(experts=8, top_k=3, hidden=32, inter=16)
    out = str(tmp_path / "res")
    # routings() has 3 cases per rank; a rank with no tokens joins every exchange empty
    run_ranks(_own_tokens, 2, (hf_config(cfg), counts, out), ep=2, dp=2, timeout_s=240)
    for r in range(2):
        with open(f"{out}.{r}") as f:
            assert json.load(f)["err"] < 1e-5, r


def _seq(rid: str, context: int = 0, blocks=()) -> ScheduledSequence:
    return ScheduledSequence(rid, [1, 2], context, list(blocks), 0, True)


def test_placement_balances_and_follows_prefix_owners():
    p = Placement(2)
    step = SchedulerOutput([_seq("a", blocks=[0, 1]), _seq("b", blocks=[2, 3])],
                           ops=[TakeSnapshot("b", 16, 7)])
    assert p.assign(step) == {"a": 0, "b": 1}
    # a new request is balanced; hits go where their prefix was written, whatever the load
    step = SchedulerOutput([_seq("c", blocks=[4]), _seq("hit-b", 16, [2, 5]),
                            _seq("hit-snap", 16, [9])], ops=[RestoreSnapshot("hit-snap", 7, 0)])
    assert p.assign(step) == {"c": 0, "hit-b": 1, "hit-snap": 1}
    assert p.placed == [2, 3]
    # finished and preempted requests leave; a preempted one is placed again when it returns
    p.assign(SchedulerOutput([], ops=[FreeRequest("a"), FreeRequest("c")], preempted=["hit-b"]))
    assert set(p.rank_of) == {"b", "hit-snap"}
    assert p.assign(SchedulerOutput([_seq("hit-b")])) == {"hit-b": 0}


def test_rank_share_and_merge():
    out = SchedulerOutput([_seq("a"), _seq("b")], dp_ranks={"a": 0, "b": 1},
                          ops=[FreeRequest("z"), TakeSnapshot("a", 16, 1),
                               TakeSnapshot("b", 16, 2), DropEntry("host", "block", b"k")])
    mine = dp_share(out, 1)
    assert [s.request_id for s in mine.sequences] == ["b"]
    assert mine.ops == [FreeRequest("z"), TakeSnapshot("b", 16, 2),
                        DropEntry("host", "block", b"k")] and mine.finished == ["z"]
    merged = merge([ModelRunnerOutput({"a": [SampledToken(3)]},
                                      cache=CacheOutcome(dropped_snapshots=[1])),
                    ModelRunnerOutput({"b": [SampledToken(4)]}, drafts={"b": [5]},
                                      cache=CacheOutcome(dropped_snapshots=[6]))])
    assert set(merged.sampled) == {"a", "b"} and merged.drafts == {"b": [5]}
    assert merged.cache.dropped_snapshots == [1, 6]


# LOOP is the second request, so that its rank (1) is not where a balanced placement puts the
# later hit (rank 0, the least loaded): a hit placed by load would read another rank's cache.
FIRST = [{"prompt_token_ids": [11, 12, 13, 3, 4, 5, 6, 7, 8]}, {"prompt_token_ids": LOOP}]
LATER = [{"prompt_token_ids": [30, 31, 32, 33, 34]}, {"prompt_token_ids": [40, 41, 42] * 3},
         {"prompt_token_ids": LOOP + [20, 21]}]     # shares 32 tokens (2 blocks) with LOOP


def _generate(path: str, **layout):
    llm = LLM(path, num_threads=1, max_model_len=256, cache_memory=8 << 20,
              speculative_method="ngram", num_speculative_tokens=3,
              speculative_adaptive=False, **layout)
    try:
        # rank 1's request of FIRST ends early: rank 0 decodes on while rank 1 sits out the
        # steps (joining the MoE exchanges with no tokens)
        short = SamplingParams(**{**GREEDY.__dict__, "max_tokens": 3})
        outs = llm.generate(FIRST, [GREEDY, short]) + llm.generate(LATER, GREEDY)
        placed = getattr(llm.engine.executor, "_placement", None)
        placed = placed.placed if placed is not None else None
        computed = llm.engine.executor.num_forward_tokens()
    finally:
        llm.shutdown()
    return outs, placed, computed


@pytest.mark.parametrize("model", ["kimi_linear", "k3"])
def test_dp2_ep2_matches_one_process(request, model):
    path = request.getfixturevalue(model)
    one, _, computed_one = _generate(path)
    many, placed, computed = _generate(path, data_parallel_size=2, expert_parallel_size=2)
    assert one[-1].num_cached_tokens >= 32          # the prefix hit happened
    assert placed == [2, 3]                          # both ranks ran requests
    assert computed == computed_one                  # the ranks' shares add up
    _assert_same(one, many)


@pytest.mark.parametrize("layout, match", [
    ({"data_parallel_size": 2}, "needs expert_parallel_size 2"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "tensor_parallel_size": 2},
     "tensor_parallel_size 1"),
    ({"data_parallel_size": 2, "expert_parallel_size": 2, "moe_backend": "grouped"},
     "runs every expert on one rank"),
])
def test_bad_dp_layout_refused(kimi_linear, layout, match, monkeypatch):  # noqa: F811
    monkeypatch.setattr("kdaserve.distributed.layout.available_ranks", lambda _d: 16)
    with pytest.raises(ConfigError, match=match):
        LLM(kimi_linear, num_threads=1, **layout)
