"""Prompt logprobs (echo with logprobs): the engine's, through chunked prefill and batched with
other requests, equal a full forward's log-softmax at each prompt position; requests that do not
ask get no prompt logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model, tiny_config

from kdaserve import LLM, SamplingParams
from kdaserve.model.loader import save_model

PROMPT = torch.randint(3, 60, (45,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_lp")
    save_model(random_model(tiny_config(), seed=2), path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    model = random_model(tiny_config(), seed=2)
    with torch.inference_mode():
        return model.forward_dense(torch.tensor([PROMPT]))[0].float().log_softmax(-1)


@pytest.mark.parametrize("chunk", [2048, 16])
def test_prompt_logprobs_match_a_full_forward(model_dir, reference, chunk):
    llm = LLM(str(model_dir), max_num_batched_tokens=chunk)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    asks = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    # beside a request that does not ask, so the step's batch mixes both
    plain, echoed = llm.generate([{"prompt_token_ids": PROMPT[:30]},
                                  {"prompt_token_ids": PROMPT}], [greedy, asks], use_tqdm=False)
    assert plain.prompt_logprobs is None
    lps = echoed.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for i in range(1, len(PROMPT)):
        want = reference[i - 1]
        assert lps[i][PROMPT[i]] == pytest.approx(want[PROMPT[i]].item(), abs=1e-4)
        top = want.topk(3)
        assert set(top.indices.tolist()) <= set(lps[i])
        assert len(lps[i]) <= 4
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lps[i][t] == pytest.approx(v, abs=1e-4)
    # the completion is what it is without prompt logprobs
    alone = llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)[0]
    assert echoed.outputs[0].token_ids == alone.outputs[0].token_ids


def test_only_requests_that_ask_get_prompt_logits(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    rows: list[int] = []
    forward = llm.engine.runner.model.forward

    def spy(ids, fb, **kw):
        rows.append(len(fb.logits_indices))
        return forward(ids, fb, **kw)

    llm.engine.runner.model.forward = spy
    llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert max(rows) == 1                       # logits only where sampled
    rows.clear()
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert sum(rows) == len(PROMPT) - 1 + 1    # every prompt position once, and the sample
    assert max(rows) <= 16                      # a chunk at a time
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_skip_prefix_hits_and_a_one_token_prompt(model_dir, reference):
    llm = LLM(str(model_dir))
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": PROMPT}, greedy, use_tqdm=False)     # cached now
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.prompt_logprobs[-1][PROMPT[-1]] == pytest.approx(
        reference[-2][PROMPT[-1]].item(), abs=1e-4)
    one = llm.generate({"prompt_token_ids": PROMPT[:1]},
                       SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]


def _spy_scoring(monkeypatch) -> list[int]:
    """Prompt rows scored per step."""
    from kdaserve.engine import runner

    rows: list[int] = []
    real = runner.score

    def spy(logits, prompt_rows):
        rows.append(sum(len(r.at) for r in prompt_rows))
        return real(logits, prompt_rows)
    monkeypatch.setattr(runner, "score", spy)
    return rows


def test_n_sequences_score_their_prompt_once(model_dir, reference, monkeypatch):
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    rows = _spy_scoring(monkeypatch)
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=3,
                                      prompt_logprobs=1), use_tqdm=False)[0]
    assert sum(rows) == len(PROMPT) - 1          # once, not once per sequence
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 3 for o in out.outputs)
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for i in range(1, len(PROMPT)):
        assert lps[i][PROMPT[i]] == pytest.approx(reference[i - 1][PROMPT[i]].item(), abs=1e-4)


def test_prompt_scoring_is_capped_per_step_and_others_go_on(model_dir, monkeypatch):
    from kdaserve.engine import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "TOKENS_PER_STEP", 8)
    rows = _spy_scoring(monkeypatch)
    llm = LLM(str(model_dir), max_num_batched_tokens=64)
    echo = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng = llm.engine
    eng.add_request("echo", PROMPT, echo)
    eng.add_request("plain", PROMPT[:20], plain)
    finished: list[str] = []
    while eng.has_unfinished():
        finished += [d.request_id for d in eng.step() if d.finished]
    assert max(rows) <= 8 and sum(rows) == len(PROMPT) - 1
    assert finished == ["plain", "echo"]         # the short one did not wait for the scoring


def test_requests_of_one_prompt_score_it_once(model_dir, reference, monkeypatch):
    """A completions call with a list of prompts is a request per prompt: those asking for
    the logprobs of a prompt another live request is scoring take its entries (and start
    from its cached blocks) instead of scoring it again; a different prompt or top-k scores
    its own."""
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    rows = _spy_scoring(monkeypatch)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    other = PROMPT[:30]
    outs = llm.generate([{"prompt_token_ids": p} for p in (PROMPT, PROMPT, other, PROMPT)]
                        + [{"prompt_token_ids": PROMPT}],
                        [sp, sp, sp, sp, SamplingParams(temperature=0.0, max_tokens=2,
                                                        prompt_logprobs=3)], use_tqdm=False)
    # PROMPT once at k=1, once at k=3, `other` once
    assert sum(rows) == 2 * (len(PROMPT) - 1) + len(other) - 1
    first = outs[0]
    for o in (outs[1], outs[3]):
        assert o.prompt_logprobs == first.prompt_logprobs
        assert o.outputs[0].token_ids == first.outputs[0].token_ids
        assert o.num_cached_tokens > 0                 # from the leader's blocks
    for i in range(1, len(PROMPT)):
        assert first.prompt_logprobs[i][PROMPT[i]] == pytest.approx(
            reference[i - 1][PROMPT[i]].item(), abs=1e-4)
        assert len(outs[4].prompt_logprobs[i]) >= 3
    assert outs[2].prompt_logprobs[1:] == first.prompt_logprobs[1:30]


def test_followers_of_an_aborted_leader_score_the_prompt_themselves(model_dir, reference):
    llm = LLM(str(model_dir), max_num_batched_tokens=16)
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    eng.add_request("lead", PROMPT, sp)
    eng.add_request("f1", PROMPT, sp)
    eng.add_request("f2", PROMPT, sp)
    eng.step()                                         # the leader's first chunk
    eng.abort("lead")
    got = {}
    while eng.has_unfinished():
        for d in eng.step():
            if d.prompt_logprobs is not None:
                got[d.request_id] = d.prompt_logprobs
    assert set(got) == {"f1", "f2"}
    for lps in got.values():
        assert len(lps) == len(PROMPT) and lps[0] is None
        for i in range(1, len(PROMPT)):
            assert lps[i][PROMPT[i]] == pytest.approx(reference[i - 1][PROMPT[i]].item(),
                                                      abs=1e-4)
    assert len(eng.tracker.scores) == 0                       # nothing kept for anyone
