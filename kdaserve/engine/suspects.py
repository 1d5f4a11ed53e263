"""Failure isolation in the scheduler: after a failed step every request of it is reset and
becomes a "suspect" (Scheduler.reset_for_retry); while any is left, a step runs one suspect
alone, so the next failure names its request and ends only that one (EngineCore.step), and a
step that succeeds clears it (Scheduler.cleared). A suspect that cannot run alone goes back
to the normal order. Plain Python over the scheduler's state (no tensors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdaserve.cache.ops import CacheOp
from kdaserve.engine.scheduled_sequence import sequence_for
from kdaserve.outputs import SchedulerOutput
from kdaserve.request import RequestStatus

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler


def schedule_alone(sched: Scheduler) -> SchedulerOutput | None:
    """A step of one suspect (a waiting one first), or None when none can run alone."""
    sched._suspects &= set(sched.requests)
    req = next((r for r in sched.waiting if r.request_id in sched._suspects), None)
    if req is None:
        req = next((r for r in sched.running if r.request_id in sched._suspects), None)
    if req is None:
        return None
    budget = sched.config.max_num_batched_tokens
    n = min(req.num_tokens - req.num_computed_tokens, budget,
            sched.config.long_prefill_token_threshold or budget)
    if n <= 0 or not sched.cache.allocate(req.request_id, req.num_computed_tokens + n):
        sched._suspects.discard(req.request_id)   # cannot run alone: back to normal order
        return None
    if req in sched.waiting:
        sched.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
    seq_ops: list[CacheOp] = []
    seq = sequence_for(sched, req, n, seq_ops)
    return SchedulerOutput(sequences=[seq], preempted=[], ops=sched._step_ops(seq_ops),
                           drafting=sched._drafting())
