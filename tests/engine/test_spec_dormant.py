"""A dormant drafter costs nothing: with a useless draft, once adaptive speculation put the
drafter to sleep, a run takes exactly the forward rows of plain decoding, and the drafter
captures, projects and drafts no row; a request that ran while it slept is drafted after the
wake from the context captured since. Counted in rows, never timed."""

from __future__ import annotations

import torch

from kdaserve import LLM, SamplingParams
from test_spec_dspark import _random_draft


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (9 + 3 * i,), generator=g).tolist() for i in range(n)]


def _rows(llm) -> tuple[int, int, int, int]:
    runner = llm.engine.runner
    p = runner.proposer
    return (runner.num_forward_tokens, *((p.rows_captured, p.rows_projected, p.rows_drafted)
                                         if p is not None else (0, 0, 0)))


def _generate(llm, prompts, sp) -> list[list[int]]:
    """One request at a time (batch 1 throughout: no batch-size bucket change wakes it)."""
    return [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts]


def test_a_dormant_drafter_takes_the_forward_rows_of_plain_decoding(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    warm, run = _prompts(hf.config.vocab_size, 1, 5), _prompts(hf.config.vocab_size, 3, 6)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    plain = LLM(str(path))
    want_warm = _generate(plain, warm, sp)
    before = _rows(plain)
    want = _generate(plain, run, sp)
    plain_rows = _rows(plain)[0] - before[0]

    llm = LLM(str(path), speculative_method="dspark", num_speculative_tokens=4,
              speculative_model=str(draft))
    policy = llm.engine.scheduler.spec_policy
    policy.sleep_after = 4
    assert _generate(llm, warm, sp) == want_warm
    assert policy.dormant                       # the useless draft put the drafter to sleep
    sched = llm.engine.scheduler
    # the learning before the sleep: every extra forward row is a rejected draft
    assert _rows(llm)[0] - before[0] == sched.num_draft_tokens - sched.num_accepted_tokens
    start, drafts = _rows(llm), sched.num_draft_tokens
    bursts, execute = [], llm.engine.runner.execute
    llm.engine.runner.execute = lambda out: bursts.append(out.num_steps) or execute(out)
    assert _generate(llm, run, sp) == want
    assert policy.dormant and policy.sleeps == 1
    assert max(bursts) > 1        # asleep, a batch that decodes runs multi-step bursts
    end = _rows(llm)
    assert end[0] - start[0] == plain_rows      # the target's rows: exactly plain decoding's
    assert end[1:] == start[1:]                 # nothing captured, projected or drafted
    assert sched.num_draft_tokens == drafts     # nothing probed
    assert llm.engine.stats.spec_dormant_seconds > 0    # /metrics counts the time asleep


def test_a_woken_drafter_drafts_a_request_it_slept_through_from_its_next_tokens(
        hf_checkpoint, tmp_path):
    """The first request runs while the drafter sleeps; a second one's admission wakes it.
    The first one's slots written asleep stay out of the draft's context, those captured
    after the wake come in, and it is drafted again. Greedy output is the plain one."""
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    prompts = _prompts(hf.config.vocab_size, 2, 2)
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path)).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    llm = LLM(str(path), speculative_method="dspark", num_speculative_tokens=4,
              speculative_model=str(draft))
    engine = llm.engine
    policy, proposer = engine.scheduler.spec_policy, engine.runner.proposer
    policy.sleep_after, policy.wake_after = 4, 1
    drafted_for = []
    propose = proposer.propose

    def recording_propose(inp):
        out = propose(inp)
        drafted_for.append(set(out))
        return out

    proposer.propose = recording_propose
    outs: dict[str, list[int]] = {}

    def step():
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)

    engine.add_request("a", prompts[0], sp)
    while not policy.dormant and engine.has_unfinished():
        step()
    step()
    a = engine.scheduler.requests["a"]
    asleep_at = a.num_computed_tokens           # positions before it: written asleep or not
    # as if a's blocks had held another request's projected context: every slot counts as
    # context until a step that runs asleep writes it
    proposer._valid.fill_(True)
    step()
    missed = a.num_computed_tokens              # a step ran asleep: slots it wrote are out
    assert missed > asleep_at
    seen = len(drafted_for)
    engine.add_request("b", prompts[1], sp)
    step()
    assert not policy.dormant                   # the admission woke it
    policy.alpha["a"] = 0.99                    # as if its drafts stood: the plan drafts for it
    while "a" in engine.scheduler.requests and not any(
            "a" in d for d in drafted_for[seen:]):
        step()
    assert any("a" in d for d in drafted_for[seen:])   # drafted again after the wake
    bs, ids = engine.cache.block_size, engine.cache.block_ids("a")
    slot = ids[asleep_at // bs] * bs + asleep_at % bs
    assert not bool(proposer._valid[slot])      # a slot written asleep: out of the context
    # the step asleep was a burst: its later forwards' slots are out too (Proposer.missed's
    # offset), not only its first's
    assert missed - asleep_at > 1
    for pos in range(asleep_at, missed):
        assert not bool(proposer._valid[ids[pos // bs] * bs + pos % bs]), pos
    now = a.num_computed_tokens - 1             # written by a step after the wake
    assert bool(proposer._valid[ids[now // bs] * bs + now % bs])
    while engine.has_unfinished():
        step()
    assert [outs["a"], outs["b"]] == want


def test_a_prompt_prefilled_in_chunks_is_all_draft_context(hf_checkpoint, tmp_path):
    """Steps in which nobody samples (prompt chunks before the last) are captured too: once
    the prompt is in, every one of its positions is in the draft's context."""
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    prompt = _prompts(hf.config.vocab_size, 1, 7)[0] * 4              # 36 tokens
    llm = LLM(str(path), speculative_method="dspark", num_speculative_tokens=3,
              speculative_model=str(draft), speculative_adaptive=False,
              max_num_batched_tokens=8, long_prefill_token_threshold=8)
    engine = llm.engine
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True))
    steps = 0
    while not engine.scheduler.requests["a"].output_token_ids:
        engine.step()
        steps += 1
    assert steps >= 4                             # the prompt took several chunks
    bs, ids = engine.cache.block_size, engine.cache.block_ids("a")
    slots = [ids[p // bs] * bs + p % bs for p in range(len(prompt))]
    assert bool(engine.runner.proposer._valid[slots].all())


def test_a_larger_sampled_batch_does_not_wake_a_drafter_its_acceptance_cannot_pay_for(
        hf_checkpoint, tmp_path):
    """Sampled requests and a useless draft: once the drafter slept, 8 sampled requests
    admitted together take the batch through buckets 1, 2, 4 and 8, and none wakes it (the
    acceptance measured for sampled requests would not pay there): exactly plain decoding's
    forward rows, nothing captured or drafted, and the seeded outputs of plain decoding."""
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    warm, batch = _prompts(hf.config.vocab_size, 1, 7), _prompts(hf.config.vocab_size, 8, 8)

    def params(n: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24,
                               ignore_eos=True) for i in range(n)]

    def run(llm) -> tuple[list[list[int]], tuple[int, int, int, int]]:
        start = _rows(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params(8),
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], tuple(
            e - s for e, s in zip(_rows(llm), start))

    plain = LLM(str(path), max_num_seqs=8)
    want, plain_rows = run(plain)
    llm = LLM(str(path), max_num_seqs=8, speculative_method="dspark",
              num_speculative_tokens=4, speculative_model=str(draft))
    policy = llm.engine.scheduler.spec_policy
    llm.generate([{"prompt_token_ids": warm[0]}], params(1), use_tqdm=False)
    # asleep: the nap that times asleep steps (adaptive.py) may not have ended yet
    assert policy.dormant and policy.sleeps + policy.rest.napping == 1
    drafts = llm.engine.scheduler.num_draft_tokens
    got, rows = run(llm)
    assert policy.dormant and policy.sleeps + policy.rest.napping == 1    # never woken
    assert rows == (plain_rows[0], 0, 0, 0)                # plain's rows; nothing captured
    assert llm.engine.scheduler.num_draft_tokens == drafts
    assert got == want


def test_requests_admitted_together_are_one_batch_to_the_wake_rule(hf_checkpoint, tmp_path):
    """Greedy requests and a drafter asleep at batch 32, where drafting would not pay (as if
    it paid below 8 rows only). 32 requests admitted in one step make a batch of 32, the
    bucket it fell asleep at, and do not wake it, though the first of them alone would have
    been a batch of 1: plain decoding's forward rows and tokens."""
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    warm, batch = _prompts(hf.config.vocab_size, 32, 9), _prompts(hf.config.vocab_size, 32, 10)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(llm, prompts) -> tuple[list[list[int]], tuple[int, int, int, int]]:
        start = _rows(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], tuple(
            e - s for e, s in zip(_rows(llm), start))

    plain = LLM(str(path), max_num_seqs=32)
    want, plain_rows = run(plain, batch)
    llm = LLM(str(path), max_num_seqs=32, speculative_method="dspark",
              num_speculative_tokens=4, speculative_model=str(draft))
    policy = llm.engine.scheduler.spec_policy
    policy.wake_after = policy.rest._wait = 10 ** 6      # only a batch-size move may wake it
    policy._would_pay = lambda rows, sampled: rows < 8
    run(llm, warm)
    assert policy.dormant and policy.sleeps == 1
    got, rows = run(llm, batch)
    assert policy.dormant and policy.sleeps + policy.rest.napping == 1    # never woken
    assert rows == (plain_rows[0], 0, 0, 0)
    assert got == want
    # the rule itself still wakes it for a batch that moved to where drafting pays
    llm.generate([{"prompt_token_ids": batch[0]}], sp, use_tqdm=False)
    assert policy.sleeps == 2
