"""Pipeline parallelism (PP=2, 2 gloo processes on CPU) against one process: the same greedy
tokens, logprobs within a tight tolerance and the same speculation outcome (drafts proposed,
accepted and rejected) on a tiny random Kimi Linear and a tiny random K3, with a prefix hit
and n-gram speculation in the same run. In-process: each stage holds only its layers' weights
and caches, and the two stages chained reproduce the whole model's logits exactly (K3: the
bank of block sums passes between them); the step split into micro-batches; bad layouts are
refused at startup; a stage killed mid-run ends the engine with a clear error; grammar-
constrained greedy and seeded sampling (the demo model, its tokenizer) equal one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from k3_models import k3_raw, random_k3
from test_layouts import HIT, PROMPTS
from test_worker_death import ROOT, SCRIPT, _wait_gone
from tiny_models import random_model, tiny_config

from kdaserve.cache.ops import FreeRequest, TakeSnapshot
from kdaserve.config import ConfigError
from kdaserve.engine.cache_ops import StepOps
from kdaserve.model.layout.snapshots import SnapshotAt
from kdaserve.distributed.layout import cache_model_config, stage_layers
from kdaserve.distributed.parallel_state import ParallelContext
from kdaserve.distributed.pipeline import micro_batches
from kdaserve.distributed.pipeline_model import Carry, run_stage, stage_of
from kdaserve.engine.llm import LLM
from kdaserve.model.batch import build_forward_batch
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.loader import load_model, save_model
from kdaserve.model.registry import load_config
from kdaserve.outputs import ScheduledSequence, SchedulerOutput
from kdaserve.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)


def _cycle_bias(model, alpha: float = 3.0):
    """Pull the LM head towards "the token after t in 3..10 is t+1 (10 -> 3)": a random model
    then partly follows the loop in its prompts, so n-gram drafts are both accepted and
    rejected (a plain random model's drafts are almost never accepted)."""
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    with torch.no_grad():
        for v in range(3, 11):
            head[v] += alpha * emb[10 if v == 3 else v - 1]
    return model


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi_linear")
    save_model(_cycle_bias(random_model(tiny_config(num_attention_heads=2))), out)
    return str(out)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    out = tmp_path_factory.mktemp("k3")
    save_model(_cycle_bias(random_k3(load_config(k3_raw()))), out)
    return str(out)


def _generate(path: str, **layout):
    llm = LLM(path, num_threads=1, max_model_len=256, cache_memory=8 << 20,
              speculative_method="ngram", num_speculative_tokens=3,
              speculative_adaptive=False, **layout)
    try:
        outs = llm.generate(PROMPTS, GREEDY) + llm.generate(HIT, GREEDY)
        s = llm.engine.scheduler
        spec = (s.num_draft_tokens, s.num_accepted_tokens)
        computed = llm.engine.executor.num_forward_tokens()
    finally:
        llm.shutdown()
    return outs, spec, computed


@pytest.mark.parametrize("model", ["kimi_linear", "k3"])
def test_pp2_matches_one_process(request, model):
    path = request.getfixturevalue(model)
    one, spec_one, computed_one = _generate(path)
    many, spec, computed = _generate(path, pipeline_parallel_size=2)
    assert one[2].num_cached_tokens >= 32          # the prefix hit happened
    drafted, accepted = spec_one
    assert 0 < accepted < drafted                  # drafts both accepted and rejected
    assert spec == spec_one and computed == computed_one
    for a, b in zip(one, many):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        assert a.num_cached_tokens == b.num_cached_tokens
        for i, (lx, ly) in enumerate(zip(x.logprobs, y.logprobs)):
            for tok, lp in lx.items():
                # relative at large magnitudes: micro-batches change the batch shapes, so
                # float32 sums round differently (a -17 logprob moved by 1.2e-4 in K3); one
                # process decodes in the fused blocks, whose products sum with fused
                # multiply-adds (csrc/vec16.h), the stages in the torch forms, partly through
                # torch's own products: K3's worst moved 5e-5 -> 2.1e-4 of its logprob
                assert abs(lp - ly[tok]) <= 4e-4 * max(1.0, abs(lp)), (i, tok, lp, ly[tok])


def _stage(path: str, rank: int, pp: int = 2):
    ctx = ParallelContext(rank, pp, 1, 1, pp_size=pp)
    return load_model(path, chunk_size=8, progress=False, parallel=ctx), ctx


@pytest.mark.parametrize("model", ["kimi_linear", "k3"])
def test_stages_hold_their_layers_and_chain_to_the_whole_model(request, model):
    path = request.getfixturevalue(model)
    whole = load_model(path, chunk_size=8, progress=False)
    cfg = whole.config
    stages = [_stage(path, r) for r in range(2)]
    for r, (m, ctx) in enumerate(stages):
        layers = stage_layers(cfg.num_hidden_layers, 2, r)
        held = {int(n.split("layers.")[1].split(".")[0]) for n, _ in m.named_parameters()
                if "layers." in n}
        assert held == set(layers)
        assert (m.model.embed_tokens is not None) == (r == 0)
        assert (m.lm_head is not None) == (r == 1) and (m.model.norm is not None) == (r == 1)
        cache = HybridCache.allocate(m.rank_config, 4, 16, 2)
        assert len(cache.kda_states) == sum(i in layers for i in cfg.kda_layers)
        assert len(cache.mla_pages) == sum(i in layers for i in cfg.mla_layers)
        for p in m.state_dict().values():
            assert p.device.type == "cpu"         # nothing left on meta: all loaded
    # the two stages chained, no cache: the same logits as the whole model
    ids = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], dtype=torch.long)
    fb = build_forward_batch([len(ids)], chunk_size=8)
    want, _ = whole(ids, fb)
    carry = None
    for m, ctx in stages:
        carry = run_stage(m, stage_of(m, ctx), ids, fb, carry)
        if isinstance(carry, Carry):       # what the wire carries: fresh tensors
            carry = Carry(*(t.clone() if t is not None else None
                            for t in (carry.hidden, carry.bank_raw, carry.bank_inv_rms)))
            if cfg.attn_res_block_size is not None:
                assert carry.bank_raw is not None and carry.bank_raw.shape[0] >= 1
    assert torch.equal(carry, want)


def test_stage_split_and_cache_plan():
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(7, 3, s)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    cfg = tiny_config()                    # kda 0, 1, 3; mla 2
    plan_cfg = cache_model_config(cfg, 1, 2)
    # stage 0 holds 2 KDA layers, stage 1 one KDA and one MLA: plan for 2 KDA + 1 MLA
    assert (len(plan_cfg.kda_layers), len(plan_cfg.mla_layers)) == (2, 1)
    assert cache_model_config(cfg, 1, 1) is cfg


def _seq(rid: str, n: int) -> ScheduledSequence:
    return ScheduledSequence(rid, list(range(n)), 0, [0], 0, True)


def test_micro_batches_balance_tokens_and_keep_snapshots():
    ops = [FreeRequest("z"), TakeSnapshot("c", 16, 4), TakeSnapshot("a", 16, 5)]
    out = SchedulerOutput([_seq("a", 10), _seq("b", 3), _seq("c", 6), _seq("d", 2)], ops=ops)
    parts = micro_batches(out, 2)
    # longest first, each to the lighter part: a | c, b, d (10 tokens against 11)
    assert [[s.request_id for s in p.sequences] for p in parts] == [["a"], ["c", "b", "d"]]
    # each part's plan takes its own rows' snapshots from the step's operations
    step = StepOps(takes=[op for op in ops if isinstance(op, TakeSnapshot)])
    rows = [{s.request_id: b for b, s in enumerate(p.sequences)} for p in parts]
    assert step.takes_for(rows[0]) == [SnapshotAt(0, 16, 5)]
    assert step.takes_for(rows[1]) == [SnapshotAt(0, 16, 4)]
    assert all(p.finished == ["z"] for p in parts)
    assert len(micro_batches(SchedulerOutput([_seq("a", 4)]), 4)) == 1
    assert micro_batches(SchedulerOutput([]), 2) == []


@pytest.mark.parametrize("layout, match", [
    ({"pipeline_parallel_size": 5}, "exceeds the model's 4 decoder layers"),
    ({"pipeline_parallel_size": 64}, "needs 64 ranks but this machine has"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "combined layouts are not built"),
    ({"pipeline_parallel_size": 2, "speculative_method": "dspark"}, "n-gram speculation only"),
    ({"pipeline_parallel_size": 2, "offload": "host"}, "offload tiers do not combine"),
])
def test_bad_pp_layout_refused_at_startup(kimi_linear, layout, match, monkeypatch):
    if layout.get("pipeline_parallel_size") != 64:      # the rank count is not the point
        monkeypatch.setattr("kdaserve.distributed.layout.available_ranks", lambda _d: 16)
    with pytest.raises(ConfigError, match=match):
        LLM(kimi_linear, num_threads=1, **layout)


def test_killed_stage_ends_engine_with_error(kimi_linear):
    """The last stage killed while rank 0 waits on it in the pipeline: a clear error, in
    bounded time, and no worker left behind."""
    script = SCRIPT.replace("tensor_parallel_size=2", "pipeline_parallel_size=2")
    assert script != SCRIPT
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, kimi_linear, "kill-worker"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids = json.loads(proc.stdout.readline())
    out, _ = proc.communicate(timeout=120)      # bounded: a hang fails the test here
    assert proc.returncode == 3, out
    assert "ENGINE ERROR: a worker process died" in out and "rank 1 exited with code -9" in out
    _wait_gone(pids, 10)


def test_pp2_grammar_greedy_and_seeded_match_one_process():
    """The last stage samples: grammar masks, drafts checked against the grammar, and seeded
    per-request generators give one process's tokens."""
    from kdaserve.assets import KIMI_LINEAR_DEMO_DIR
    from kdaserve.structured.spec import GuidedDecoding

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "act": {"type": "integer"}},
        "required": ["name", "act"], "additionalProperties": False}
    prompts = ["ROMEO: What say you?", "JULIET: O Romeo, Romeo", "HAMLET: Speak the speech"]
    guided = GuidedDecoding("json", json.dumps(schema))
    got = []
    for layout in ({}, {"pipeline_parallel_size": 2}):
        llm = LLM(str(KIMI_LINEAR_DEMO_DIR), max_model_len=512, cache_memory=64 << 20,
                  num_threads=1,
                  speculative_method="ngram", num_speculative_tokens=4,
                  speculative_adaptive=False, **layout)
        try:
            runs = []
            for temperature in (0.0, 0.8):
                sp = SamplingParams(temperature=temperature, max_tokens=40, guided=guided,
                                    seed=3)
                runs.append([o.outputs[0].token_ids
                             for o in llm.generate(prompts, sp, use_tqdm=False)])
            got.append(runs)
        finally:
            llm.shutdown()
    assert got[1] == got[0]
    assert got[0][0] != got[0][1]                  # the sampled run is not the greedy one
