"""Multi-step decoding (kdaserve/engine/decode_burst.py): a batch that only decodes runs several
forwards per scheduling decision. Outputs must equal one step at a time token for token
(greedy, stops inside a burst, seeded sampling with penalties and logprobs, prefix hits on
snapshots that decode steps took), on the fused decoder and on the torch forward, and a burst
must never compute a token past a request's last or plan a later step that fills a block."""

from __future__ import annotations

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine import decode_burst


@pytest.fixture(autouse=True)
def _untimed(monkeypatch):
    # a burst's length by its measured step time would make which bursts run depend on the
    # machine's speed: the counts below need them all
    monkeypatch.setattr(decode_burst, "BURST_SECONDS", 1e9)


def _llm(steps: int, **kw) -> LLM:
    kw = {"max_num_seqs": 4, "cache_memory": 64 << 20, "num_threads": 1, "max_model_len": 512,
          "block_size": 16, **kw}
    return LLM(num_scheduler_steps=steps, **kw)


def _prompts(vocab: int, lens=(5, 23, 40, 17, 9, 33)) -> list[list[int]]:
    return [torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in lens]


def _record(llm: LLM) -> list[tuple[int, list[int], int]]:
    """Each step the runner ran: (forwards, each row's context length, requests waiting)."""
    seen = []
    runner, sched = llm.engine.runner, llm.engine.scheduler
    execute = runner.execute

    def recording(out):
        seen.append((out.num_steps, [s.context_len for s in out.sequences], len(sched.waiting)))
        return execute(out)
    runner.execute = recording
    return seen


def _run(llm: LLM, prompts, sp) -> list[tuple[list[int], str, list | None, int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].logprobs,
             o.num_cached_tokens) for o in outs]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_bursts_equal_single_steps(fused: bool):
    def build(steps):
        llm = _llm(steps)
        if not fused:
            llm.engine.runner._fused = False      # every step through the torch forward
        return llm

    one = build(1)
    prompts = _prompts(one.engine.model_config.vocab_size)
    # lengths that end mid-burst, sampled and greedy, stops inside bursts, a prefix hit
    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 7, 22, 33, 18, 29)]
    want = _run(one, prompts, greedy)
    stops = [want[0][0][9], want[3][0][14]]
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=stops)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=30, repetition_penalty=1.3,
                             presence_penalty=0.5, logprobs=2)
    # request 0's blocks 16-31 and 32-47 were completed by decode steps: their snapshots
    again = [prompts[0] + want[0][0][:30]]
    cases = [(prompts, stopped), (prompts, sampled), (again, greedy[0])]
    want += [r for ps, sp in cases for r in _run(one, ps, sp)]
    rows_one = one.engine.runner.num_forward_tokens

    for steps in (4, 3) if fused else (4,):
        many = build(steps)
        seen = _record(many)
        got = _run(many, prompts, greedy)
        got += [r for ps, sp in cases for r in _run(many, ps, sp)]
        assert [g[:2] for g in got] == [w[:2] for w in want]
        for g, w in zip(got, want):
            if w[2] is not None:          # logprobs, token by token
                for a, b in zip(g[2], w[2]):
                    assert a.keys() == b.keys(), (a, b)
                    if fused:         # the fused rows sum the same whatever the batch
                        assert a == b
                    else:             # the torch forms' batches differ: arrivals are
                        # admitted at other steps when requests end inside bursts
                        assert list(a.values()) == pytest.approx(list(b.values()), rel=1e-5)
        assert got[-1][3] == want[-1][3] == 32          # the hit on decode's snapshots
        assert max(k for k, _, _ in seen) == steps        # bursts ran
        if steps == 4:
            # the stops end requests inside bursts: only those rows may compute more
            assert rows_one <= many.engine.runner.num_forward_tokens <= rows_one + 2 * 3 * 4


def test_bursts_stay_within_their_limits():
    llm = _llm(4, max_num_seqs=2)
    seen = _record(llm)
    prompts = _prompts(llm.engine.model_config.vocab_size, (6, 21, 11))
    sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 9, 14)]
    outs = _run(llm, prompts, sp)
    assert [len(o[0]) for o in outs] == [30, 9, 14]
    # no token computed twice or past the last: prompt + max_tokens - 1 rows each
    assert llm.engine.runner.num_forward_tokens == sum(len(p) + n - 1 for p, n in
                                                       zip(prompts, (30, 9, 14)))
    assert any(k > 1 for k, _, _ in seen)
    for k, contexts, waiting in seen:
        if k > 1:
            assert waiting == 0          # an arrival is admitted, never kept behind a burst
            for c in contexts:           # later steps never fill a block (its snapshot's hash)
                assert all((c + j + 1) % 16 for j in range(1, k))


def test_stop_strings_run_single_steps():
    llm = _llm(4)
    seen = _record(llm)
    prompts = _prompts(llm.engine.model_config.vocab_size, (8, 12))
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=["\x00never"])
    _run(llm, prompts, sp)
    assert seen and all(k == 1 for k, _, _ in seen)
    seen.clear()
    _run(llm, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert any(k > 1 for k, _, _ in seen)


def test_bursts_are_off_where_the_engine_needs_each_step():
    assert _llm(4, async_scheduling=True).engine.scheduler.max_burst == 1
    assert _llm(4, speculative_method="ngram",
                speculative_adaptive=False).engine.scheduler.max_burst == 1
    # adaptive speculation: bursts while its drafter sleeps (burst_steps asks the policy)
    assert _llm(4, speculative_method="ngram").engine.scheduler.max_burst == 4
    assert _llm(1).engine.scheduler.max_burst == 1
    assert _llm(4).engine.scheduler.max_burst == 4


def test_bursts_beside_a_held_long_prompt_equal_single_steps():
    """Decodes burst while the decode guard holds a long prompt back (engine/decode_guard.py):
    greedy tokens and the long prompt's own output are those of one step at a time. The guard
    is given a CPU-like cost model and no clock, so which steps hold the prompt is fixed."""
    def build(steps):
        llm = _llm(steps, max_model_len=1024)
        g = llm.engine.scheduler.guard
        for i in range(60):       # 2 ms a plain step, 12 ms more with prefill, 0.2 ms a token
            prefill = (0, 0, 512, 37, 0, 300)[i % 6]
            g.observe(prefill, 1 + i % 3, 2e-3 + 1e-4 * (1 + i % 3)
                      + (12e-3 + 2e-4 * prefill if prefill else 0.0))
        g.observe = lambda *a, **k: None
        return llm

    def run(llm):
        seen = []                 # (forwards, the long prompt is still prefilling)
        sched, execute = llm.engine.scheduler, llm.engine.runner.execute

        def recording(out):
            r = sched.requests.get("long")
            seen.append((out.num_steps, r is not None and r.num_computed_tokens < len(long)))
            return execute(out)
        llm.engine.runner.execute = recording
        vocab = llm.engine.model_config.vocab_size
        short = _prompts(vocab, (5, 9, 7))
        long = _prompts(vocab, (700,))[0]
        sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        engine = llm.engine
        for i, p in enumerate(short):
            engine.add_request(f"s{i}", p, sp)
        got: dict[str, list[int]] = {}

        def step():
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
        for _ in range(3):
            step()
        engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=8,
                                                        ignore_eos=True))
        while engine.has_unfinished():
            step()
        return got, seen

    want, one = run(build(1))
    got, many = run(build(4))
    assert got == want
    assert all(k == 1 for k, _ in one)
    assert any(k > 1 and prefilling for k, prefilling in many)
