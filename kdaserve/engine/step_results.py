"""A step's results into the scheduler's requests (Scheduler.update): computed counts, sampled
tokens and accepted drafts, the speculation counters, stop conditions, offload and transfer
failures, prefix-cache commits. Plain Python over the scheduler's state, like the scheduler
(no tensors); engine/lookahead.py settles async steps with the same pieces."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdaserve.cache.ops import DISAGG
from kdaserve.disagg import handoff
from kdaserve.engine.prompt_logprobs import record
from kdaserve.engine.stop_conditions import append_tokens
from kdaserve.outputs import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from kdaserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler


def apply(sched: Scheduler, out: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
    """Returns the requests that got a new token (finished ones included)."""
    touched = []
    if result.cache.dropped_snapshots:
        sched.cache.drop_snapshots(result.cache.dropped_snapshots)
    reloaded = settle_cache_ops(sched, result)
    for seq in out.sequences:
        req = sched.requests.get(seq.request_id)
        if req is None or seq.request_id in reloaded:  # aborted, or sat the step out
            continue
        tokens = result.sampled.get(seq.request_id, []) if seq.sample else []
        if seq.num_draft_tokens:
            # the last known token and the accepted drafts are computed; the rest is not
            req.num_computed_tokens += len(tokens)
            _count_verification(sched, req, seq, len(tokens) - 1)
        else:            # a burst's later steps computed the tokens its earlier ones sampled
            req.num_computed_tokens += len(seq.token_ids) + out.num_steps - 1
        if seq.request_id in result.prompt_logprobs:
            record(req, *result.prompt_logprobs[seq.request_id])
        req.spec_token_ids = []
        if not seq.sample:
            commit(sched, req)
            continue
        status = append_tokens(req, tokens, sched.config.max_model_len)
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        commit(sched, req)
        touched.append(req)
        if status is not None:
            if handoff.exports(req):     # its drafts go along with its cache
                req.spec_token_ids = result.drafts.get(req.request_id, [])
            sched.finish(req.request_id, status)
        else:
            req.spec_token_ids = result.drafts.get(req.request_id, [])
    return touched


def _count_verification(sched: Scheduler, req: Request, seq: ScheduledSequence,
                        accepted: int) -> None:
    req.num_draft_tokens += seq.num_draft_tokens
    req.num_accepted_tokens += accepted
    req.num_spec_verifications += 1
    sched.num_verify_rows += 1
    sched.num_draft_tokens += seq.num_draft_tokens
    sched.num_accepted_tokens += accepted
    sched.acceptance_lengths[accepted + 1] += 1
    for j in range(accepted):
        sched.accepted_by_position[j] += 1
    if sched.spec_policy is not None:
        sched.spec_policy.record(req.request_id, seq.num_draft_tokens, accepted)


def settle_cache_ops(sched: Scheduler, result: ModelRunnerOutput) -> set[str]:
    """Entries that failed to store or load leave the offload tiers; a request whose load
    failed sat the step out and starts over (its next prefix hit is shorter: recomputed,
    never computed on bad data). Returns the requests that sat the step out."""
    if not result.cache.failures:
        return set()
    moved = {f.request_id for f in result.cache.failures if f.tier == DISAGG}
    for f in result.cache.failures:
        if f.tier == DISAGG and f.request_id in sched.requests:
            sched.finish(f.request_id, RequestStatus.FINISHED_ABORTED)
            sched._failed[f.request_id] = f.reason
    rest = [f for f in result.cache.failures if f.tier != DISAGG]
    if not rest:
        return moved
    failed = sched.cache.settle(rest)
    for rid in failed:
        req = sched.requests.get(rid)
        if req is not None and req in sched.running:
            sched.running.remove(req)
            sched.cache.free(rid)
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = req.num_cached_tokens = 0
            req.spec_token_ids = []
            sched.waiting.appendleft(req)
    return failed | moved


def commit(sched: Scheduler, req: Request) -> None:
    """The request's computed full blocks into the prefix cache."""
    if not sched.cache.prefix_caching:
        return
    sched.cache.commit(req.request_id, req.all_token_ids, req.num_computed_tokens,
                       req.extra_keys, req.cache_salt)
