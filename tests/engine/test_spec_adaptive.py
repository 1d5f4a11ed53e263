"""Adaptive speculation: the cost model recovers a machine's step costs; a request whose drafts
are never accepted stops speculating (probes aside), one whose drafts always are keeps all of
them; with a useless draft the engine takes no more steps than without speculation, and greedy
output is unchanged. Decisions and step counts, never wall time."""

from __future__ import annotations

import random

import pytest
import torch

from kdaserve import LLM, SamplingParams
from kdaserve.engine.spec.adaptive import AdaptiveSpeculation
from kdaserve.engine.spec.step_cost import RealizedRates, StepCostModel
from test_spec_dspark import _random_draft


def test_cost_model_recovers_coefficients():
    m = StepCostModel(warmup=0)
    rng = random.Random(0)
    for _ in range(200):
        t, r = rng.randint(1, 64), rng.randint(0, 8)
        v = rng.random() < 0.5
        m.observe(t, r, 0.008 + 5e-5 * t + 1e-3 * r + 3e-3 * v, verifies=v)
    a, b, c, d = m.coefficients()
    assert a == pytest.approx(0.008, rel=0.05) and b == pytest.approx(5e-5, rel=0.05)
    assert c == pytest.approx(1e-3, rel=0.05) and d == pytest.approx(3e-3, rel=0.05)


def test_decisions_follow_acceptance():
    p = AdaptiveSpeculation(7, probe_every=16)
    for _ in range(30):
        p.record("bad", 7, 0)
        p.record("good", 7, 7)
    plans = [p.plan({"bad": 7, "good": 7}, 2) for _ in range(32)]
    assert all(pl["good"] == 7 for pl in plans)
    # one probe every 16 steps, each spanning two plans: its draft proposed, then verified
    probes = [i for i, pl in enumerate(plans) if pl["bad"]]
    assert probes == [15, 16] and all(plans[i]["bad"] == 7 for i in probes)


def test_bad_draft_turns_speculation_off(hf_checkpoint, tmp_path):
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (12,), generator=g).tolist()
               for _ in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(path), **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine

    plain, plain_engine = run()
    fixed, fixed_engine = run(speculative_method="dspark", num_speculative_tokens=6,
                              speculative_model=str(draft), speculative_adaptive=False)
    adaptive, engine = run(speculative_method="dspark", num_speculative_tokens=6,
                           speculative_model=str(draft))
    assert fixed == plain and adaptive == plain
    # with speculation off, plain steps took the fused CPU decode path (capturing the draft's
    # context layers), and the output did not change
    from kdaserve.model.fused_decode import FusedDecoder
    from kdaserve.ops.cpu_kernels import decode_block_kernels
    if decode_block_kernels() is not None:
        assert isinstance(engine.runner._fused, FusedDecoder)
    policy = engine.scheduler.spec_policy
    assert engine.stats.steps <= plain_engine.stats.steps
    # a useless draft: nearly nothing accepted, so nearly nothing verified after the start
    assert engine.scheduler.num_accepted_tokens <= 2
    assert engine.scheduler.num_draft_tokens < fixed_engine.scheduler.num_draft_tokens / 3
    assert policy.steps_speculating < policy.steps / 2


def _costly_verify_policy() -> AdaptiveSpeculation:
    """Plain steps take 2 ms (a fused decode path); any verifying step pays 10 ms more."""
    p = AdaptiveSpeculation(7)
    p.cost.warmup = 0
    for _ in range(64):
        p.cost.observe(1, 0, 0.002)
        p.cost.observe(8, 1, 0.002 + 0.010 + 7 * 5e-5 + 2e-4, verifies=True)
        p.cost.observe(2, 1, 0.002 + 0.010 + 5e-5 + 2e-4, verifies=True)
    return p


@pytest.mark.parametrize("accepted, speculates", [(4, False), (7, True)])
def test_a_verifying_steps_fixed_cost_must_be_repaid(accepted, speculates):
    p = _costly_verify_policy()
    for _ in range(40):
        p.record("r", 7, accepted)
    plan = p.plan({"r": 7}, 1)
    assert (plan["r"] > 0) == speculates


def test_probes_stay_within_their_budget():
    p = _costly_verify_policy()
    p.sleep_after = None                 # awake throughout: the probes' own budget is measured
    for _ in range(40):
        p.record("r", 7, 0)
    plans = [p.plan({"r": 7}, 1) for _ in range(2000)]
    verifying = sum(1 for pl in plans if pl["r"])
    a, b, c, d = p.cost.coefficients()
    # every probe step pays the verifying step's fixed cost: at most 3% of the plain time
    assert 0 < verifying * (d + 7 * b + c) <= 0.03 * 2000 * (a + b) + 2 * (d + 7 * b + c)


def test_a_new_request_drafts_what_the_engine_wide_acceptance_earns():
    p = _costly_verify_policy()
    assert p.initial_drafts(1) == 0          # acceptance 0.5 does not repay a verifying step
    for _ in range(40):
        p.record("old", 7, 7)
    assert p.initial_drafts(1) == 7          # drafts have been standing: a new request drafts
    for _ in range(40):
        p.record("old", 7, 0)
    assert p.initial_drafts(1) == 0


def test_realized_rates_overrule_a_cost_model_that_misjudges():
    """The linear model says speculate; verifying steps at this batch size delivered fewer
    tokens per second than plain ones: the plan verifies nothing (probes aside)."""
    p = AdaptiveSpeculation(7)                            # the prior costs: verifying is cheap
    for _ in range(40):
        p.record("r", 7, 7)
    batch = {f"r{i}": 7 for i in range(32)}
    for rid in batch:
        p.alpha[rid] = 0.99
    assert sum(p.plan(batch, 32).values()) > 0
    for _ in range(10):
        p.realized.observe(32, False, 32, 0.010)          # 3,200 tok/s plain
        p.realized.observe(32, True, 200, 0.080)          # 2,500 tok/s verifying
        p.realized.observe(1, True, 8, 0.010)             # another bucket: speculation wins
        p.realized.observe(1, False, 1, 0.002)
    assert sum(p.plan(batch, 32).values()) <= 7           # at most one probe's block
    assert p.initial_drafts(32) == 0
    assert not p.realized.speculation_loses(1)


def test_speculation_must_beat_the_asleep_engine_not_only_awake_plain_steps():
    """Awake plain steps (one forward a step, states captured) are slower than an asleep
    engine's bursts. Verifying steps that beat the first and not the second lose: the
    alternative to speculating is sleeping. The Kimi Linear demo at batch 1: 0.56 tokens a
    ms verifying, 0.40 awake, 0.77 asleep."""
    p = AdaptiveSpeculation(7)
    batch = {"r": 7}
    p.alpha["r"] = 0.99
    for _ in range(p.realized.min_steps):
        p.realized.observe(1, True, 56, 0.100)             # 560 tok/s verifying
        p.realized.observe(1, False, 40, 0.100)            # 400 tok/s awake, plain
    assert not p.realized.speculation_loses(1)
    assert p.plan(batch, 1)["r"] == 0 and p.rest.napping  # a nap times the asleep steps
    for _ in range(p.realized.min_steps - 1):
        p.realized.observe(1, False, 77, 0.100, asleep=True)
    assert not p.realized.speculation_loses(1)             # too few asleep steps yet
    assert p.plan(batch, 1)["r"] == 0 and p.rest.napping
    p.realized.observe(1, False, 77, 0.100, asleep=True)   # 770 tok/s asleep
    assert p.realized.speculation_loses(1)
    assert p.plan(batch, 1)["r"] == 0
    assert p.dormant and not p.rest.napping and p.sleeps == 1   # the nap became a sleep
    assert not p.realized.speculation_loses(32)            # per batch-size bucket
    for _ in range(40):
        p.realized.observe(1, True, 90, 0.100)             # until verifying beats both
    assert not p.realized.speculation_loses(1)


def test_verifying_steps_are_set_against_the_plain_rate_of_their_moment():
    """The host slows after the verifying steps were timed: their old rate beats the plain
    rate of the slow moment, but each lost to the plain rate of its own, and speculation stays
    off. Where they beat the plain rate of their moment, the two comparisons agree."""
    p = AdaptiveSpeculation(7)
    r = p.realized
    for _ in range(r.min_steps):
        r.observe(1, False, 80, 0.100, asleep=True)         # fast moment: 800 tok/s asleep
    for _ in range(r.min_steps):
        r.observe(1, True, 70, 0.100)                       # 700 tok/s verifying: 0.875x
    for _ in range(60):
        r.observe(1, False, 40, 0.100, asleep=True)         # slow moment: 400 tok/s asleep
    spec = r.sums[(1, "verify")]
    assert spec[0] / spec[1] > 400.0                        # as rates, verifying would win
    assert r.speculation_loses(1)
    p.alpha["r"] = 0.99                  # drafts that would pay by the cost model's prior
    assert p.plan({"r": 7}, 1)["r"] == 0
    q = RealizedRates()
    for _ in range(q.min_steps):
        q.observe(1, False, 40, 0.100, asleep=True)         # 400 tok/s asleep
    for _ in range(q.min_steps):
        q.observe(1, True, 60, 0.100)                       # 600 tok/s verifying: 1.5x
    assert not q.speculation_loses(1)
    assert q.against[1][0] > q.against[1][1]


def _verifying_measured(p: AdaptiveSpeculation) -> dict[str, int]:
    """A batch of one request whose drafts the prior says pay, and a batch size's verifying
    steps measured (1,000 tok/s)."""
    batch = {"r": 7}
    p.alpha["r"] = 0.99
    assert p.plan(batch, 1)["r"] > 0
    for _ in range(p.realized.min_steps):
        p.realized.observe(1, True, 7, 0.007)
    return batch


def test_a_nap_times_the_asleep_engine_when_speculation_never_stopped():
    """Verifying steps measured at a batch size, asleep ones not (a drafter whose drafts the
    cost model says pay never sleeps on its own): the next decode-only plan naps until the
    asleep steps are timed, then compares the two realized rates. Losing, the nap becomes a
    sleep; winning, the drafter wakes and drafts again."""
    for asleep_ms, wins in ((0.5, False), (2.0, True)):
        p = AdaptiveSpeculation(7)
        batch = _verifying_measured(p)
        assert p.realized.needs_asleep(1)
        assert p.plan(batch, 3)["r"] == 0 and not p.dormant   # a prompt in the step: no nap
        assert p.plan(batch, 1)["r"] == 0 and p.dormant and p.rest.napping
        for _ in range(p.realized.min_steps):
            p.realized.observe(1, False, 1, asleep_ms / 1000, asleep=True)
        assert p.plan(batch, 1)["r"] == (7 if wins else 0)
        assert not p.rest.napping and p.dormant is not wins and p.sleeps == (not wins)


def test_a_nap_without_its_measurement_ends_as_a_sleep():
    """A nap whose asleep steps never come at its batch size (the batch moved) ends after
    nap_steps as a sleep: a drafter not shown to pay stays off until the wake rules say."""
    p = AdaptiveSpeculation(7)
    p.alpha["r"] = 0.99
    for _ in range(p.realized.min_steps):
        p.realized.observe(1, True, 7, 0.007)
    assert p.plan({"r": 7}, 1)["r"] == 0 and p.rest.napping
    for _ in range(p.realized.min_steps):
        p.realized.observe(2, False, 2, 0.001, asleep=True)     # another bucket's
    p.slept(p.nap_steps - 1)
    assert p.plan({}, 2) == {} and p.rest.napping
    assert p.plan({}, 2) == {} and p.dormant and not p.rest.napping and p.sleeps == 1


def test_no_wake_where_the_acceptance_shown_could_not_pay_until_the_longest_wait():
    """Verifying steps so slow that, at the acceptance greedy requests have shown, they
    would deliver fewer tokens a second than the asleep engine: admissions after wake_after
    steps asleep do not wake the drafter; one after max_wake_after steps does. Where that
    acceptance would pay, wake_after wakes it."""
    for verify_s, hopeless in ((0.007, True), (0.003, False)):
        p = AdaptiveSpeculation(7)
        for _ in range(60):
            p.record("r", 7, 7)                           # every draft stood: ~8 a block
        for _ in range(p.realized.min_steps):
            p.realized.observe(1, True, 5, verify_s)      # 5 of 8 tokens a block, here
            p.realized.observe(1, False, 4, 0.002, asleep=True)   # 2,000 tok/s asleep
        assert p.realized.speculation_loses(1)
        assert p.realized.cannot_pay(1, 8) is hopeless    # 8 / 7 ms < 2 a ms < 8 / 3 ms
        p.forget("r")
        p.rest.nap(p.nap_steps, 1)
        p.rest.end_nap(True)                              # asleep, as after a losing nap
        p.slept(p.wake_after)
        p.admitted(1, "a")
        assert p.dormant is hopeless
        if hopeless:
            p.slept(p.max_wake_after)
            p.admitted(1, "b")
            assert not p.dormant
    p = AdaptiveSpeculation(7)                            # sampled requests' prior, 0.3:
    for _ in range(p.realized.min_steps):                 # ~1.4 tokens a block, hopeless
        p.realized.observe(1, True, 5, 0.003)             # where 8 would not be
        p.realized.observe(1, False, 4, 0.002, asleep=True)
    p.rest.nap(p.nap_steps, 1)
    p.rest.end_nap(True)
    p.slept(p.wake_after)
    p.admitted(1, "s", sampled=True)
    assert p.dormant


def test_a_batch_size_where_verifying_could_not_pay_rules_out_the_larger_ones():
    """Batch 1's verifying steps could not beat its asleep steps at the acceptance greedy
    requests have shown: a batch of 8 (unmeasured) neither drafts nor wakes the drafter, as
    each row's share of a plain step only shrinks with the batch. Batch 1 has no smaller
    batch size (its own figures judge it). At 3 ms a verifying step the batch of 8 drafts."""
    p = AdaptiveSpeculation(7)
    for _ in range(60):
        p.record("x", 7, 7)
    p.forget("x")
    for _ in range(p.realized.min_steps):
        p.realized.observe(1, True, 5, 0.007)              # 8 / 7 ms < 2 a ms: hopeless
        p.realized.observe(1, False, 4, 0.002, asleep=True)
    many = {str(i): 7 for i in range(8)}
    p.alpha.update(dict.fromkeys(many, 0.99))
    assert p._hopeless_below(8) and not p._hopeless_below(1)
    assert not any(p.plan(many, 8).values())
    assert not p._would_pay(8, False) and p.initial_drafts(8) == 0
    p.rest.nap(p.nap_steps, 1)
    p.rest.end_nap(True)
    p.slept(p.wake_after)
    p.admitted(8, "y")                                     # no wake at 8 rows either
    assert p.dormant
    q = AdaptiveSpeculation(7)                             # the same at 3 ms: it could pay
    for _ in range(60):
        q.record("x", 7, 7)
    q.forget("x")
    for _ in range(q.realized.min_steps):
        q.realized.observe(1, True, 5, 0.003)
        q.realized.observe(1, False, 4, 0.002, asleep=True)
    q.alpha.update(dict.fromkeys(many, 0.99))
    assert not q._hopeless_below(8) and any(q.plan(many, 8).values())


def test_a_vetoed_drafter_sleeps_once_its_trials_are_in():
    """Woken where the realized rates say verifying loses: the owed probe blocks run, and
    the drafter sleeps at the next plan without drafts, not sleep_after plans later (no
    number of plans lifts the veto)."""
    p = AdaptiveSpeculation(7)
    for _ in range(60):
        p.record("x", 7, 7)                               # greedy drafts have paid before
    p.forget("x")
    for _ in range(p.realized.min_steps):
        p.realized.observe(1, True, 4, 0.003)             # 1,333 tok/s verifying
        p.realized.observe(1, False, 4, 0.002, asleep=True)   # 2,000 tok/s asleep
    assert p.realized.speculation_loses(1) and not p.realized.cannot_pay(1, 7.5)
    p.rest.nap(p.nap_steps, 1)
    p.rest.end_nap(True)                                 # asleep
    p.slept(p.wake_after)
    p.admitted(1, "r")                                   # woken: 2 probe blocks owed
    assert not p.dormant
    assert p.plan({"r": 7}, 1)["r"] == 7                 # the first
    p.record("r", 7, 7)
    assert p.plan({"r": 7}, 1)["r"] == 7 and not p.dormant   # the second, at once
    p.record("r", 7, 7)
    assert p.plan({"r": 7}, 1)["r"] == 0 and p.dormant and p.sleeps == 2


def test_without_a_rest_cycle_a_plain_step_is_timed_instead():
    """sleep_after None (the drafter never sleeps): no nap; the plan verifies nothing until
    a few plain steps are timed, then compares the two realized rates."""
    p = AdaptiveSpeculation(7, sleep_after=None)
    batch = _verifying_measured(p)
    assert p.realized.needs_plain(1)
    assert p.plan(batch, 1)["r"] == 0 and not p.dormant   # time a plain step
    for _ in range(p.realized.min_steps):
        p.realized.observe(1, False, 1, 0.0005)           # 2,000 tok/s plain
    assert not p.realized.needs_plain(1)
    assert p.realized.speculation_loses(1)
    assert p.plan(batch, 1)["r"] == 0                     # and speculation stays off
    for _ in range(40):
        p.realized.observe(1, True, 8, 0.002)             # until verifying wins again
    assert p.plan(batch, 1)["r"] > 0


def test_the_drafter_sleeps_when_nothing_earns_a_draft_and_wakes_with_an_admission():
    p = _costly_verify_policy()
    p.sleep_after, p.wake_after = 8, 20
    for _ in range(40):
        p.record("r", 7, 0)
    plans = [p.plan({"r": 7}, 1) for _ in range(8)]
    assert p.dormant and p.sleeps == 1 and not any(pl["r"] for pl in plans)
    assert p.initial_drafts(1) == 0 and p.decisions()["dormant"] == 1.0
    for _ in range(19):
        assert p.plan({"r": 7}, 1) == {"r": 0}
    p.admitted(1)                        # 19 steps asleep: not yet
    assert p.dormant
    p.plan({"r": 7}, 1)
    p.admitted(1)
    assert not p.dormant                 # 20 steps: the admission wakes it
    for _ in range(8):
        p.plan({"r": 7, "new": 7}, 2)
    assert not p.dormant                 # no evidence since the wake: it does not sleep
    for _ in range(p.sleep_trials):
        p.record("new", 7, 0)
    # the woken drafter may probe at once (a probe keeps it awake until verified), then sleeps
    for _ in range(8):
        p.plan({"r": 7, "new": 7}, 2)
    assert p.dormant and p.sleeps == 2
    for _ in range(30):
        p.plan({"r": 7, "new": 7}, 2)
    p.admitted(2)                        # the wake found nothing: the wait doubled to 40
    assert p.dormant
    p.admitted(32)                       # another batch size, where the acceptance measured
    assert p.dormant                     # for greedy requests (none) cannot pay either
    for _ in range(40):
        p.record("old", 7, 7)            # greedy drafts have been standing
    p.admitted(1, "sampled", sampled=True)
    assert p.dormant                     # not sampled ones: their acceptance is still the prior's
    p.admitted(1)                        # another batch size where it pays (a verifying step
    assert not p.dormant                 # costs 10 ms: one row's drafts repay it, not 32's)


def test_a_woken_drafter_takes_its_owed_trials_at_once_and_sleeps_again():
    """The trials a sleep rests on come at once after a wake, from the request that woke it
    even once its first block is measured: waiting on the probe budget for the second kept
    the drafter awake (no decode bursts, states captured) for 50-140 steps of every wake."""
    p = _costly_verify_policy()
    p.sleep_after, p.wake_after = 8, 20
    for _ in range(40):
        p.record("old", 7, 0)
    for _ in range(8 + 20):
        p.plan({"old": 7}, 1)
    assert p.dormant
    p.admitted(2, "new")
    assert not p.dormant
    awake, proposed = 0, set()
    while not p.dormant and awake < 100:
        out = p.plan({"old": 7, "new": 7}, 2)
        awake += 1
        for rid in proposed & {r for r, k in out.items() if k}:   # proposed last step
            p.record(rid, out[rid], 0)                            # verified now: useless
        proposed = {r for r, k in out.items() if k}
        assert not out["old"]                # measured useless before the wake: no trial
    assert p.dormant and awake <= p.sleep_after + 2 * p.sleep_trials + 2


def test_greedy_and_sampled_requests_start_from_their_own_kind_of_acceptance():
    """Greedy drafts standing say nothing about sampled ones: a new sampled request starts
    from the sampled prior (below greedy's), and each kind's estimate moves with its own
    trials within a few blocks."""
    p = _costly_verify_policy()
    assert p.shared_alpha(True) < p.shared_alpha(False)
    for _ in range(10):
        p.record("g", 7, 7)
    assert p.shared_alpha(False) > 0.9 and p.shared_alpha(True) == p.prior_sampled
    assert p.initial_drafts(1) == 7 and p.initial_drafts(1, sampled=True) == 0
    p.admitted(1, "s", sampled=True)
    for _ in range(4):                   # four blocks of 7 drafts, one accepted in each
        p.record("s", 7, 1)
    assert abs(p.shared_alpha(True) - 0.5) < 0.1 and p.alpha["s"] < 0.5
    p.forget("s")
    assert "s" not in p.alpha


def test_a_drafter_that_earns_never_sleeps():
    p = _costly_verify_policy()
    p.sleep_after = 8
    for _ in range(40):
        p.record("r", 7, 7)
    assert all(p.plan({"r": 7}, 1)["r"] == 7 for _ in range(100))
    assert not p.dormant and p.sleeps == 0
    assert p.plan({}, 0) == {} and not p.dormant      # prefill-only steps do not count


def test_a_sleeping_drafter_captures_nothing_and_drafts_only_for_context_it_holds(
        hf_checkpoint, tmp_path):
    """A useless draft: the drafter falls asleep during the first request (no proposals, no
    capture from then on), wakes when the second is admitted, and then drafts for the second
    only (the first one's drafts were measured useless; test_spec_dormant.py drafts a request
    the drafter slept through). Greedy output is the plain one throughout."""
    path, hf = hf_checkpoint
    draft = _random_draft(path, tmp_path / "draft", block=4)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, hf.config.vocab_size, (10,), generator=g).tolist()
               for _ in range(2)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(path))
    want = [o.outputs[0].token_ids for o in plain.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    llm = LLM(str(path), speculative_method="dspark", num_speculative_tokens=4,
              speculative_model=str(draft))
    engine = llm.engine
    policy = engine.scheduler.spec_policy
    policy.sleep_after, policy.wake_after = 4, 1
    # this machine's step costs fixed (a verifying step's own cost 2 ms): fit online under
    # load, they now and then made one draft at "a"'s measured acceptance (~0.08) look worth
    # its cost after the wake (1 full run of this file in 21 beside a busy loop)
    policy.cost.prior = (5e-3, 5e-5, 2e-4, 2e-3)
    policy.cost.observe = lambda *args, **kwargs: None
    proposer = engine.runner.proposer
    calls, drafted_for, captures = [], [], []
    propose, forward = proposer.propose, engine.runner.forward

    def counting_propose(inp):
        calls.append(len(inp.seqs))
        out = propose(inp)
        drafted_for.append(set(out))
        return out

    def counting_forward(step, drafting=True, **kw):     # (kw: a burst's advance)
        captures.append(drafting)
        return forward(step, drafting, **kw)

    proposer.propose, engine.runner.forward = counting_propose, counting_forward
    engine.add_request("a", prompts[0], sp)
    outs = {}
    while engine.has_unfinished() and len(captures) < 30:
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert policy.dormant and (policy.sleeps >= 1 or policy.rest.napping)
    asleep_from = len(captures)
    while engine.has_unfinished() and len(captures) < asleep_from + 3:
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert not any(captures[asleep_from:])             # asleep: no capture, no proposals
    assert len(calls) == sum(captures)
    seen = len(drafted_for)
    engine.add_request("b", prompts[1], sp)
    while engine.has_unfinished():
        for d in engine.step():
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)
    after = set().union(*drafted_for[seen:])
    assert "a" not in after                            # its acceptance was measured: none
    assert [outs["a"], outs["b"]] == want
