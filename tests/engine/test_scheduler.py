"""Scheduler alone, with exact expectations (no model, no tensors)."""

from __future__ import annotations

from kdaserve.cache.manager import CacheManager
from kdaserve.config import SchedulerConfig
from kdaserve.engine.scheduler import Scheduler
from kdaserve.outputs import ModelRunnerOutput, SampledToken
from kdaserve.request import Request, RequestStatus, SamplingParams


def make(budget=16, seqs=4, blocks=64, block_size=4, slots=4, max_len=1000, policy="fcfs",
         chunk=None):
    cache = CacheManager(blocks, block_size, slots)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                          policy=policy, long_prefill_token_threshold=chunk)
    return Scheduler(cfg, cache), cache


def req(rid, n, max_tokens=5, priority=0, t=0.0):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens,
                                                               temperature=0.0),
                   priority=priority, arrival_time=t)


def step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = {q.request_id: [SampledToken(token)] for q in out.sequences if q.sample}
    s.update(out, ModelRunnerOutput(sampled))
    return {q.request_id: len(q.token_ids) for q in out.sequences}, out


def test_budget_and_chunked_prefill():
    s, _ = make(budget=10)
    s.add_request(req("a", 25))
    assert step(s)[0] == {"a": 10}
    assert step(s)[0] == {"a": 10}
    got, out = step(s)
    assert got == {"a": 5} and out.sequences[0].sample
    assert step(s)[0] == {"a": 1}  # decode


def test_decode_never_starved_by_long_prompt():
    s, _ = make(budget=8)
    s.add_request(req("d", 3, max_tokens=20))
    step(s)                               # d prefilled, sampled its first token
    s.add_request(req("long", 100))
    for _ in range(5):
        got, out = step(s)
        assert got["d"] == 1              # the decode goes first, every step
        assert got["long"] == 7           # the prompt takes what is left
        assert out.sequences[0].request_id == "d"


def test_max_num_seqs_and_fcfs_order():
    s, _ = make(budget=100, seqs=2)
    for r in ("a", "b", "c"):
        s.add_request(req(r, 4))
    assert step(s)[0] == {"a": 4, "b": 4}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_priority_policy():
    s, _ = make(budget=100, seqs=1, policy="priority")
    s.add_request(req("low", 4, priority=5, t=0))
    s.add_request(req("high", 4, priority=1, t=1))
    assert step(s)[0] == {"high": 4}


def test_preempts_most_recent_and_recomputes():
    s, cache = make(budget=100, blocks=4, block_size=4, slots=4)
    s.add_request(req("a", 7, max_tokens=8, t=0))   # 2 blocks
    s.add_request(req("b", 7, max_tokens=8, t=1))   # 2 blocks: pool full
    assert step(s)[0] == {"a": 7, "b": 7}
    got, _ = step(s)                                # both decode 1: 8 tokens fit in 2 blocks each
    assert got == {"a": 1, "b": 1}
    got, out = step(s)                              # a needs a 3rd block: b is preempted
    assert out.preempted == ["b"] and got == {"a": 1}
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and cache.num_free_blocks == 1
    while "a" in s.requests:
        step(s)
    got, _ = step(s)                                # b comes back: prompt + its 2 outputs
    assert got == {"b": 9}


def test_stop_conditions_and_frees():
    s, cache = make()
    r = req("a", 3, max_tokens=3)
    r.eos_token_ids = frozenset({9})
    s.add_request(r)
    step(s, token=5)
    step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 9]
    r2 = req("b", 3, max_tokens=2)
    s.add_request(r2)
    step(s)
    step(s)
    assert r2.status == RequestStatus.FINISHED_LENGTH
    assert cache.all_free()


def test_request_larger_than_pool_is_ended_not_spun():
    s, cache = make(budget=100, blocks=2, block_size=4)
    s.add_request(req("big", 8, max_tokens=5))
    step(s)
    got, _ = step(s)           # needs a third block; alone in the pool: preempted
    got, out = step(s)         # cannot be admitted again: finished as length
    assert "big" not in s.requests and cache.all_free()


def test_abort_frees_everything():
    s, cache = make()
    s.add_request(req("a", 9))
    step(s)
    s.abort("a")
    assert cache.all_free() and not s.has_unfinished()


def test_cache_operations_are_typed_and_in_order():
    """Frees first, then each sequence's restore, snapshots and (verifying) settle."""
    from kdaserve.cache.ops import FreeRequest, RestoreSnapshot, SettleDrafts, TakeSnapshot

    cache = CacheManager(64, 4, 4, enable_prefix_caching=True, num_snapshots=8,
                         snapshot_bytes=1, mla_bytes_per_token=1, snapshot_interval=8)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                  max_model_len=1000), cache)
    s.add_request(req("a", 13, max_tokens=5))
    _, out = step(s)
    takes = out.ops_of(TakeSnapshot)
    assert out.ops == takes and [t.position for t in takes] == [8, 12]
    assert {t.request_id for t in takes} == {"a"}
    # a speculating decode step: the row carries its drafts and a settle of its slot
    s.requests["a"].spec_token_ids = [5, 6]
    _, out = step(s)
    assert out.sequences[0].num_draft_tokens == 2
    assert out.ops[-1] == SettleDrafts("a", out.sequences[0].state_slot)
    while s.has_unfinished():
        _, out = step(s)
    # a later request with the same prompt hits a's snapshot: restored into its own slot
    s.add_request(req("b", 13, max_tokens=1))
    _, out = step(s)
    assert out.ops[0] == FreeRequest("a")
    restore = out.ops_of(RestoreSnapshot)
    assert len(restore) == 1 and restore[0].request_id == "b"
    assert restore[0].slot == out.sequences[0].state_slot
    assert restore[0].snapshot_id == takes[-1].snapshot_id
    assert out.sequences[0].context_len == 12
