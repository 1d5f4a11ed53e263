"""Multi-step decoding (vLLM's `--num-scheduler-steps`): a batch that only decodes runs up to
`num_scheduler_steps` forwards for one scheduling decision.

Why: on a CPU a small model's decode step is ~1 ms of kernels, and scheduling, planning and the
output bookkeeping around it cost a quarter more in Python. Overlapping them with the forward
(async scheduling) does not pay on a machine whose cores all run the forward. A burst pays
them once for several tokens instead: the scheduler allocates the pages of every step ahead,
the runner feeds each step's sampled token to the next forward itself, and the results come
back as several tokens per request, stopped where a stop condition falls (the tokens after it
are dropped, as after a stop inside accepted drafts).

This module is the scheduler's half (plain Python, no tensors); the runner's is
engine/burst_forwards.py. A burst is planned only where its tokens cannot depend on anything
the engine decides between steps. Every running request decodes one token (nothing
was preempted, no drafts), with no grammar (masks follow each token), no stop strings (the
detokenizer finds them), no cache transfer, no tokens in flight. Nothing waits, unless what is
left out is long prompts the decode guard holds back this step (engine/decode_guard.py): the
steps the burst replaces would not carry them either, so the decodes beside a long prompt run
at a burst's pace, and the burst ends where the guard's credit buys the prompt's next chunk
(each of its forwards earns that credit as a plain step does). The burst ends before:
- any request's max_tokens or the model length (no token is computed past the last);
- a prefix-cache snapshot at a block boundary after its first step (its hash needs tokens
  the burst has not sampled yet).
Its length also keeps a burst within BURST_SECONDS of measured step time, so a request that
arrives meanwhile waits no longer than that. Greedy tokens are the same as one step at a time:
the same forwards run in the same order. With adaptive speculation a batch bursts only while
the drafter sleeps (the policy counts each of the burst's steps as a step asleep); the engine
turns bursts off with fixed speculation, async scheduling, worker processes and
disaggregation (engine/core.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kdaserve.request import Request

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler

BURST_SECONDS = 0.04        # the longest a burst aims to take (what an arrival may wait)


def burst_steps(sched: Scheduler, scheduled: Sequence[tuple[Request, int]],
                preempted: Sequence[str], drafts: dict[str, int]) -> int:
    """How many forwards this step's decode rows run (1: a plain step). Plain Python over
    the scheduler's state; allocates the pages the extra steps write."""
    steps = sched.max_burst
    if sched.spec_policy is not None and not sched.spec_policy.dormant:
        return 1             # an awake drafter plans each step
    if sched.decode_seconds > 0:
        steps = min(steps, max(1, int(BURST_SECONDS / sched.decode_seconds)))
    if steps <= 1 or not scheduled or preempted or drafts:
        return 1
    held = _held_bulk(sched, scheduled)
    if held is None:
        return 1
    if held:
        steps = min(steps, sched.guard.steps_to_chunk())
        if steps <= 1:
            return 1
    bs, prefix = sched.cache.block_size, sched.cache.prefix_caching
    max_len = sched.config.max_model_len
    for req, n in scheduled:
        sp = req.sampling_params
        if (n != 1 or req.num_pending or req.num_tokens - req.num_computed_tokens != 1
                or sp.guided is not None or sp.stop or sp.kv_transfer is not None):
            return 1
        steps = min(steps, req.max_tokens - len(req.output_token_ids),
                    max_len - req.num_tokens)
        if prefix:           # the first later step that fills a block (the first may)
            steps = min(steps, (-(req.num_computed_tokens + 1)) % bs or bs)
        if steps <= 1:
            return 1
    for req, _ in scheduled:
        if not sched.cache.allocate(req.request_id, req.num_computed_tokens + steps):
            return 1         # what was taken stays the request's: its next steps use it
    if sched.spec_policy is not None:
        sched.spec_policy.slept(steps - 1)
    if held:
        sched.guard.earn(steps - 1)
    return steps


def _held_bulk(sched: Scheduler, scheduled: Sequence[tuple[Request, int]]) -> bool | None:
    """False: every request runs in this step and nothing waits. True: what is left out is
    long prompts the decode guard holds back this step (engine/decode_guard.py): they would
    wait for the plain steps the burst replaces anyway, and the burst ends where the guard's
    credit buys their next chunk. None: a burst would keep something else waiting."""
    ran = {q.request_id for q, _ in scheduled}
    left = [r for r in sched.running if r.request_id not in ran] + list(sched.waiting)
    if not left:
        return False
    guard = sched.guard
    if guard is None or sched.bulk_room() != 0:
        return None
    if not all(guard.is_bulk(r.num_tokens - r.num_cached_tokens) for r in left):
        return None
    return True
