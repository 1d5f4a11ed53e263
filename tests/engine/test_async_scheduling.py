"""Async scheduling (kdaserve/engine/lookahead.py, async_steps.py): step N+1 is planned and
started before step N's tokens are known. Outputs must equal the synchronous loop's token for
token, greedy and seeded sampling with penalties, through stops, prefix hits on snapshots taken
by decode steps, preemption, aborts and a failed step."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.request import PENDING


def _llm(asyn: bool, **kw) -> LLM:
    kw = {"max_num_seqs": 4, "cache_memory": 64 << 20, "num_threads": 1, "max_model_len": 512,
          "block_size": 16, **kw}
    return LLM(async_scheduling=asyn, **kw)


def _prompts(vocab: int, lens=(5, 23, 40, 17, 9, 33)) -> list[list[int]]:
    return [torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in lens]


def _count_lookahead(llm: LLM) -> dict:
    seen = {"pending_rows": 0}
    runner = llm.engine.runner
    begin = runner.begin

    def counting(out):
        seen["pending_rows"] += sum(PENDING in s.token_ids for s in out.sequences)
        return begin(out)
    runner.begin = counting
    return seen


def _run(llm: LLM, prompts, sp) -> list[tuple[list[int], str]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def test_async_equals_sync_greedy_sampled_stops_and_prefix_hits():
    sync = _llm(False)
    prompts = _prompts(sync.engine.model_config.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    want = _run(sync, prompts, greedy)
    # stop tokens from the greedy outputs: requests end early, mid-flight
    stops = [want[0][0][7], want[3][0][12]]
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=stops)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=30, repetition_penalty=1.3,
                             presence_penalty=0.5, logprobs=2)
    again = [prompts[1] + want[1][0][:30]]          # hits the snapshot a decode step took
    want += _run(sync, prompts, stopped) + _run(sync, prompts, sampled)
    want += _run(sync, again, greedy)

    asyn = _llm(True)
    seen = _count_lookahead(asyn)
    got = _run(asyn, prompts, greedy) + _run(asyn, prompts, stopped)
    got += _run(asyn, prompts, sampled) + _run(asyn, again, greedy)
    assert got == want
    assert any(r == "stop" for _, r in want[6:12])
    assert seen["pending_rows"] > 100          # most decode rows were planned ahead


def test_async_equals_sync_under_preemption_and_n():
    kw = {"num_blocks": 14, "enable_prefix_caching": False}
    sync = _llm(False, **kw)
    prompts = _prompts(sync.engine.model_config.vocab_size, (30, 41, 25, 38))
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    sp_n = SamplingParams(temperature=0.7, seed=5, max_tokens=20, n=3)
    want = _run(sync, prompts, sp)
    want_n = sync.generate([{"prompt_token_ids": prompts[0]}], sp_n, use_tqdm=False)
    asyn = _llm(True, **kw)
    assert _run(asyn, prompts, sp) == want
    assert asyn.engine.scheduler.num_preemptions > 0
    got_n = asyn.generate([{"prompt_token_ids": prompts[0]}], sp_n, use_tqdm=False)
    assert [c.token_ids for c in got_n[0].outputs] == [c.token_ids for c in want_n[0].outputs]


def test_abort_in_flight_leaves_the_others_identical():
    sync = _llm(False)
    prompts = _prompts(sync.engine.model_config.vocab_size, (12, 19, 26))
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    want = _run(sync, prompts, sp)
    asyn = _llm(True)
    eng = asyn.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    steps = 0
    while eng.has_unfinished():
        for d in eng.step():
            got[d.request_id] += d.new_token_ids
        steps += 1
        if steps == 6:
            eng.abort("r1")             # a step of r1 is in flight now
    assert got["r0"] == want[0][0] and got["r2"] == want[2][0]
    assert len(got["r1"]) < 24 and got["r1"] == want[1][0][:len(got["r1"])]
    assert not eng.scheduler.requests


def test_a_failed_step_voids_the_next_and_everything_is_retried(monkeypatch):
    sync = _llm(False)
    prompts = _prompts(sync.engine.model_config.vocab_size, (12, 19, 26))
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    want = _run(sync, prompts, sp)
    asyn = _llm(True)
    runner = asyn.engine.runner
    execute, calls = runner.execute, {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected")
        return execute(out)
    monkeypatch.setattr(runner, "execute", flaky)
    assert _run(asyn, prompts, sp) == want
    assert all(r.num_pending == 0 for r in asyn.engine.scheduler.requests.values())


def test_speculation_keeps_the_synchronous_loop(caplog):
    llm = _llm(True, speculative_method="ngram", num_speculative_tokens=2)
    assert llm.engine._pipeline is None
    assert "steps run synchronously" in caplog.text


@pytest.mark.parametrize("start,tail,want", [
    (2, [7, 8], [1, 2, 7, 8]),             # overwrite, extend
    (1, [5], [1, 5, 3]),                    # never truncates the runner's own tokens
    (1, [PENDING, 9], [1, 2, 9]),          # a pending token keeps the runner's value
])
def test_merge_outputs(start, tail, want):
    from kdaserve.engine.step_message import merge_outputs

    outs = [1, 2, 3]
    merge_outputs(outs, start, tail)
    assert outs == want
    with pytest.raises(ValueError, match="never sampled"):
        merge_outputs(outs, len(outs), [PENDING])
