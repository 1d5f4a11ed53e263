"""bench spec's `measure`: each group of concurrent requests alternates between the plain and
the speculative engine, and each side's fastest run of each group counts. A scripted clock
stands in for the host's noise, so the arithmetic is checked exactly."""

from __future__ import annotations

from types import SimpleNamespace

import kdaserve.bench.spec_measure as spec_bench


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Engine:
    """generate() advances the clock by the next scripted duration; one step a token. The
    first `prefill` seconds of each run come before its first token."""

    def __init__(self, name: str, clock: _Clock, durations: list[float], log: list,
                 tokens: int = 4, prefill: float = 0.0) -> None:
        self.name, self.clock, self.durations, self.tokens = name, clock, list(durations), tokens
        self.log, self.prefill = log, prefill
        self.forgotten = 0
        self.engine = SimpleNamespace(
            stats=SimpleNamespace(steps=0), has_unfinished=lambda: False,
            scheduler=SimpleNamespace(num_draft_tokens=0, num_accepted_tokens=0,
                                      num_verify_rows=0, spec_policy="policy"),
            runner=SimpleNamespace(proposer=SimpleNamespace(forget_context=self._forget)))

    def _forget(self) -> None:
        self.forgotten += 1

    def generate(self, prompts, params, use_tqdm=False):
        # which engine ran: speculation off (no policy, no proposer) is the plain side
        on = self.engine.scheduler.spec_policy is not None
        assert on == (self.engine.runner.proposer is not None)
        self.log.append((self.name if on else "plain", *prompts))
        start = self.clock.now
        self.clock.now += self.durations.pop(0)
        self.engine.stats.steps += self.tokens * len(prompts)
        out = SimpleNamespace(token_ids=list(range(self.tokens)), acceptance_length=None,
                              spec_verifications=0)
        metrics = SimpleNamespace(first_token_time=start + self.prefill,
                                  last_token_time=self.clock.now)
        return [SimpleNamespace(outputs=[out], metrics=metrics) for _ in prompts]


def test_each_group_alternates_and_its_fastest_run_counts(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(spec_bench.time, "perf_counter", clock)
    # 3 groups (batch 1), 3 repeats; durations in call order, group by group
    log: list = []
    base = _Engine("plain", clock, [1.0, 2.0, 3.0,   1.5, 1.0, 3.0,   0.5, 4.0, 3.5], log)
    spec = _Engine("spec", clock, [2.0, 2.0, 2.0,   1.0, 3.0, 2.5,   9.0, 1.5, 2.0], log)
    prompts = ["a", "b", "c"]
    row = spec_bench.measure(base, spec, prompts, [None] * 3, 1, greedy=True, repeats=3)
    # the two engines take turns group by group, and who goes first alternates by repeat
    order = [("plain", "spec"), ("spec", "plain"), ("plain", "spec")]
    assert log == [(e, p) for first in order for p in "abc" for e in first]
    t_base, t_spec = 0.5 + 1.0 + 3.0, 1.0 + 1.5 + 2.0
    assert row["baseline_tok_s"] == round(12 / t_base, 1)
    assert row["spec_tok_s"] == round(12 / t_spec, 1)
    assert row["speedup"] == round(t_base / t_spec, 3)
    # repeats took 6.0, 5.5 and 8.0 s on the plain side: median 6.0 against 4.5 counted
    assert row["baseline_spread"] == round(6.0 / 4.5 - 1.0, 3)
    assert row["baseline_step_ms"] == round(1000 * t_base / 12, 3)
    assert row["identical"] is True and row["requests"] == 3


def test_one_batch_is_one_group(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(spec_bench.time, "perf_counter", clock)
    log: list = []
    base, spec = _Engine("plain", clock, [2.0, 1.0], log), _Engine("spec", clock, [1.0, 3.0], log)
    row = spec_bench.measure(base, spec, ["a", "b"], [None] * 2, 2, greedy=False, repeats=2)
    assert log == [("plain", "a", "b"), ("spec", "a", "b"), ("spec", "a", "b"),
                   ("plain", "a", "b")]
    assert row["speedup"] == round(1.0 / 1.0, 3) and "identical" not in row
    assert row["baseline_spread"] == round(1.5 / 1.0 - 1.0, 3)


def test_one_engine_is_its_own_plain_baseline(monkeypatch):
    """measure(spec, spec): the plain runs are the same engine with its speculation policy
    and proposer taken away, given back after each run, and the drafter told to forget its
    context (the plain run wrote slots it never heard of)."""
    clock = _Clock()
    monkeypatch.setattr(spec_bench.time, "perf_counter", clock)
    log: list = []
    spec = _Engine("spec", clock, [2.0, 1.0, 1.0, 3.0], log)
    row = spec_bench.measure(spec, spec, ["a", "b"], [None] * 2, 2, greedy=True, repeats=2)
    assert log == [("plain", "a", "b"), ("spec", "a", "b"), ("spec", "a", "b"),
                   ("plain", "a", "b")]
    assert spec.forgotten == 2
    assert spec.engine.scheduler.spec_policy == "policy"
    assert spec.engine.runner.proposer is not None
    # plain runs took 2.0 and 3.0 s, speculative ones 1.0 and 1.0
    assert row["speedup"] == round(2.0 / 1.0, 3)


def test_a_real_engine_without_speculation_decodes_as_a_plain_one(hf_checkpoint, tmp_path):
    """`speculation_off` on a real speculative engine: nothing drafted, captured or verified, the
    forward tokens and greedy output of an engine built without speculation; speculation back
    on afterwards, drafting again, with the same output."""
    import torch
    from k3_models import write_random_draft

    from kdaserve import LLM, SamplingParams

    path, hf = hf_checkpoint
    cfg = hf.config
    draft = write_random_draft(tmp_path / "draft", cfg.hidden_size, cfg.vocab_size,
                               (0, cfg.num_hidden_layers - 1), block=4)
    g = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, cfg.vocab_size, (n,),
                                                  generator=g).tolist()} for n in (5, 21)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(llm):
        n0 = llm.engine.runner.num_forward_tokens
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        return outs, llm.engine.runner.num_forward_tokens - n0

    want, plain_rows = run(LLM(str(path), max_num_seqs=2, enable_prefix_caching=False))
    spec = LLM(str(path), max_num_seqs=2, enable_prefix_caching=False, speculative_method="dspark",
               num_speculative_tokens=3, speculative_adaptive=False,
               speculative_model=str(draft))
    sched, proposer = spec.engine.scheduler, spec.engine.runner.proposer
    assert run(spec)[0] == want and bool(proposer._valid.any())    # context projected
    with spec_bench.speculation_off(spec):
        drafted, captured = sched.num_draft_tokens, proposer.rows_captured
        assert run(spec) == (want, plain_rows)
        assert (sched.num_draft_tokens, proposer.rows_captured) == (drafted, captured)
    assert spec.engine.runner.proposer is proposer
    assert not bool(proposer._valid.any())        # told to forget what the plain run wrote
    got, _ = run(spec)
    assert got == want and sched.num_draft_tokens > drafted


def test_the_decode_alone_leaves_the_prefill_out(monkeypatch):
    """A long prompt's prefill (9 s on both sides) dilutes a 2x faster decode to 1.1x over
    the whole run; the decode's own ratio shows the 2x."""
    clock = _Clock()
    monkeypatch.setattr(spec_bench.time, "perf_counter", clock)
    log: list = []
    base = _Engine("plain", clock, [11.0] * 3, log, prefill=9.0)
    spec = _Engine("spec", clock, [10.0] * 3, log, prefill=9.0)
    row = spec_bench.measure(base, spec, ["a"], [None], 1, greedy=True, repeats=3)
    assert row["spec_vs_plain_paired"] == 1.1
    assert row["decode_spec_vs_plain_paired"] == 2.0
    assert row["decode_spec_vs_plain_ci95_low"] == row["decode_spec_vs_plain_ci95_high"] == 2.0
