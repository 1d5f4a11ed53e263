"""The decode latency guard (engine/decode_guard.py): bulk prefill beside decoding requests is
paid from a credit, so the steps they wait on cost at most max_slowdown times their plain cost;
a long prompt still advances; nothing changes when nothing waits. No model, no clock: step
costs come from a fixed synthetic formula."""

from __future__ import annotations

from kdaserve.cache.manager import CacheManager
from kdaserve.config import SchedulerConfig
from kdaserve.engine.decode_guard import DecodeGuard
from kdaserve.engine.scheduler import Scheduler
from kdaserve.outputs import ModelRunnerOutput, SampledToken
from kdaserve.request import Request, SamplingParams

# a CPU-like step: 2 ms plain, 12 ms more as soon as it carries prefill, 0.2 ms a token
PLAIN, SWITCH, PER_TOKEN, PER_ROW = 2e-3, 12e-3, 2e-4, 1e-4


def cost(prefill: int, rows: int) -> float:
    return PLAIN + PER_ROW * rows + (SWITCH + PER_TOKEN * prefill if prefill else 0.0)


def trained(slowdown: float = 2.0) -> DecodeGuard:
    g = DecodeGuard(slowdown)
    for i in range(60):                        # the machine's own steps, of every kind
        prefill = (0, 0, 512, 37, 0, 300)[i % 6]
        g.observe(prefill, 1 + i % 3, cost(prefill, 1 + i % 3))
    return g


def test_no_cap_when_nothing_waits_on_the_step():
    assert trained().bulk_budget(0, 0) is None


def test_waiting_steps_cost_at_most_the_slowdown_and_bulk_advances():
    for slowdown in (1.5, 2.0, 3.0):
        g = trained(slowdown)
        plain = loaded = 0.0
        done = 0
        for _ in range(200):
            n = g.bulk_budget(1, 0)
            assert n == 0 or n >= g.min_chunk
            g.charge(n)
            plain += cost(0, 1)
            loaded += cost(n, 1)
            done += n
        # (the fit is least squares with a prior, a few % off the exact formula)
        assert loaded <= slowdown * plain * 1.05, (slowdown, loaded / plain)
        assert done > 0                        # never starved
        assert loaded >= (slowdown - 0.5) * plain   # and the room is used


def test_cheap_chunks_stay_whole():
    """A GPU-like machine: a chunk costs little beside a decode step, so the cap is the
    step's budget or more."""
    g = DecodeGuard(2.0)
    for i in range(60):
        prefill = (0, 2048, 0, 700)[i % 4]
        g.observe(prefill, 8, 5e-3 + 1e-7 * prefill)
    assert g.bulk_budget(8, 0) >= 2048


def make(slowdown=2.0, budget=2048, seqs=8):
    cache = CacheManager(512, 16, seqs)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=4096,
                          max_decode_slowdown=slowdown)
    return Scheduler(cfg, cache)


def req(rid, n, max_tokens=64, prompt_logprobs=None):
    return Request(rid, list(range(1, n + 1)),
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                  prompt_logprobs=prompt_logprobs))


def run_step(s: Scheduler) -> dict[str, int]:
    out = s.schedule()
    sampled = {q.request_id: [SampledToken(7)] for q in out.sequences if q.sample}
    s.update(out, ModelRunnerOutput(sampled))
    got = {q.request_id: len(q.token_ids) for q in out.sequences}
    if s.guard is not None:
        decoding = sum(1 for q in out.sequences if q.is_decode)
        prefill = sum(len(q.token_ids) for q in out.sequences if not q.is_decode)
        s.guard.observe(prefill, decoding, cost(prefill, decoding))
    return got


def test_long_prompt_beside_a_decode_comes_in_paid_chunks():
    s = make()
    s.add_request(req("d", 4, max_tokens=4000))
    for _ in range(40):                        # d decodes alone: the plain steps' cost
        run_step(s)
    s.add_request(req("long", 3000))
    chunks = []
    while "long" in s.requests and s.requests["long"].num_computed_tokens < 3000:
        got = run_step(s)
        assert got["d"] == 1                   # the decode runs every step
        chunks.append(got.get("long", 0))
    last = max(i for i, c in enumerate(chunks) if c)
    assert all(c == 0 or c >= s.guard.min_chunk for c in chunks[:last])   # (the last: what
    assert chunks[last] <= 256                                            # was left)
    assert chunks.count(0) > len(chunks) // 2  # most steps stay plain
    assert sum(chunks) == 3000                 # and the prompt got through


def test_without_the_guard_chunks_take_the_budget():
    s = make(slowdown=0)
    assert s.guard is None
    s.add_request(req("d", 4, max_tokens=400))
    run_step(s)
    s.add_request(req("long", 3000))
    assert run_step(s) == {"d": 1, "long": 2047}


def test_short_request_starts_behind_capped_prompt_logprob_requests():
    """Requests scoring their prompts wait for scoring room; a short request queued behind
    them starts at the next step instead of after all of them."""
    s = make()
    for i in range(4):
        s.add_request(req(f"echo{i}", 600, max_tokens=1, prompt_logprobs=1))
    run_step(s)
    s.add_request(req("short", 5, max_tokens=8))
    got = run_step(s)
    assert got.get("short") == 5
    assert sum(n for rid, n in got.items() if rid.startswith("echo")) <= 512


def burst_step(s: Scheduler) -> tuple[int, int]:
    """run_step for a scheduler that may burst: (forwards, bulk tokens) of the step."""
    out = s.schedule()
    sampled = {q.request_id: [SampledToken(7)] * out.num_steps
               for q in out.sequences if q.sample}
    s.update(out, ModelRunnerOutput(sampled))
    prefill = sum(len(q.token_ids) for q in out.sequences if not q.is_decode)
    decoding = sum(1 for q in out.sequences if q.is_decode)
    s.guard.observe(prefill, decoding, cost(prefill, decoding))
    return out.num_steps, prefill


def test_held_back_prompt_lets_the_decodes_burst_and_still_advances():
    """While the guard holds a long prompt back, the decodes beside it run as bursts (the steps
    they replace would carry no bulk either), each burst ending where the credit buys the next
    chunk; the credit counts every forward, so the chunks come as they would step by step."""
    def run(max_burst: int) -> tuple[list[tuple[int, int]], int]:
        s = make()
        s.max_burst = max_burst
        s.add_request(req("d", 4, max_tokens=4000))
        for _ in range(40):
            burst_step(s)
        s.add_request(req("long", 3000))
        steps = []
        while s.requests["long"].num_computed_tokens < 3000:
            steps.append(burst_step(s))
        return steps, sum(k for k, _ in steps)

    plain, plain_forwards = run(1)
    burst, burst_forwards = run(8)
    assert all(k == 1 for k, _ in plain)
    assert any(k > 1 for k, _ in burst)
    assert all(p == 0 for k, p in burst if k > 1)       # a burst never carries bulk
    assert sum(p for _, p in burst) == 3000
    # the same credit per forward: the prompt needs as many forwards either way
    assert abs(burst_forwards - plain_forwards) <= 8, (burst_forwards, plain_forwards)
    assert len(burst) < len(plain) // 2


def test_a_short_arrival_is_never_kept_behind_a_burst():
    s = make()
    s.max_burst = 8
    s.add_request(req("d", 4, max_tokens=4000))
    for _ in range(40):
        burst_step(s)
    s.add_request(req("long", 3000))
    burst_step(s)
    s.add_request(req("short", 5, max_tokens=8))
    out = s.schedule()
    assert out.num_steps == 1
    assert {q.request_id for q in out.sequences} >= {"d", "short"}


def test_bulk_alone_is_cut_to_the_arrival_bound_while_serving_and_whole_when_quiet():
    g = DecodeGuard(2.0)
    assert g.bulk_budget(0, 0) is None               # a fresh engine: nothing sensitive yet
    g.bulk_budget(1, 0)                              # a decode ran
    assert g.bulk_budget(0, 0) == g.bulk_tokens      # per-token cost not measured yet
    for i in range(60):
        prefill = (0, 0, 512, 37, 0, 300)[i % 6]
        g.observe(prefill, 1 + i % 3, cost(prefill, 1 + i % 3))
        g.bulk_budget(1, 0)                          # (these steps had decodes beside)
    n = g.bulk_budget(0, 0)
    # what the fit says takes arrival_seconds (the fit is a few % off the exact formula)
    assert g.min_chunk <= n < 512
    assert cost(n, 0) <= g.arrival_seconds * 1.05 < cost(int(n * 1.2), 0)
    while g.quiet < g.recent_seconds:                # bulk alone for recent_seconds of steps
        assert g.bulk_budget(0, 0) == n
        g.observe(n, 0, cost(n, 0))
    assert g.bulk_budget(0, 0) is None


def test_a_long_prompt_after_a_short_request_comes_in_bounded_steps():
    s = make()
    s.add_request(req("short", 5, max_tokens=4))
    while "short" in s.requests:
        run_step(s)
    s.add_request(req("long", 3000))
    got = run_step(s)
    assert got == {"long": s.guard.bulk_tokens}      # the per-token cost is not known yet
    got = run_step(s)
    assert s.guard.min_chunk <= got["long"] < 512
    assert cost(got["long"], 0) <= s.guard.arrival_seconds * 1.1


def test_bulk_alone_is_never_cut_below_twice_the_steps_fixed_cost():
    """A model read from memory every step: 35 ms before any token, 1.3 ms a token. The
    50 ms bound would leave 11 tokens (min_chunk: 32, each step mostly fixed cost); the
    chunk's tokens cost at least fixed_multiple times the fixed cost instead."""
    def slow(prefill: int, rows: int) -> float:
        return 2e-3 + 1e-4 * rows + (33e-3 + 1.3e-3 * prefill if prefill else 0.0)

    g = DecodeGuard(2.0)
    for i in range(60):
        prefill = (0, 0, 512, 37, 0, 300)[i % 6]
        g.observe(prefill, 1 + i % 3, slow(prefill, 1 + i % 3))
        g.bulk_budget(1, 0)
    n = g.bulk_budget(0, 0)
    a, b, _, d = g.cost.coefficients()
    assert n * b >= g.fixed_multiple * (a + d) - b        # by the fit (rounded down)
    fixed = slow(1, 0) - 1.3e-3              # the fit gives the 2 ms a step to its rows
    assert slow(n, 0) - fixed >= 0.9 * g.fixed_multiple * fixed
    assert n < 80 and slow(n, 0) > g.arrival_seconds
