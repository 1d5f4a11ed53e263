"""Admission of waiting requests into a step (Scheduler.schedule, after the running ones): in
FCFS or priority order with fairness between groups (engine/fairness.py), while the token
budget, `max_num_seqs` and the cache allow. A request's prefix-cache hit sets where it starts;
an import (prefill/decode disaggregation, kdaserve/disagg/handoff.py) starts past its prompt,
whose cache arrives from the prefill instance. Plain Python over the scheduler's state, like
the scheduler (no tensors)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from kdaserve.cache.prefix_cache import PrefixHit
from kdaserve.disagg import handoff
from kdaserve.engine import decode_guard, prompt_logprobs
from kdaserve.engine.fairness import next_waiting
from kdaserve.engine.prompt_logprobs import wants_prompt_logprobs
from kdaserve.engine.spec import draft_plan
from kdaserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler


def admit(sched: Scheduler, scheduled: list[tuple[Request, int]], budget: int, chunk_cap: int,
          drafts: dict[str, int]) -> None:
    """Admit waiting requests into `scheduled` (request, tokens) until `budget` tokens are
    spent; the drafts an import verifies at once go to `drafts`."""
    counts = Counter(r.group for r in sched.running)
    capped: set[str] = set()   # no room left this step for their kind of chunk
    admitted: list[Request] = []
    while sched.waiting and budget > 0 and len(sched.running) < sched.config.max_num_seqs:
        ready = [r for r in sched.waiting if prompt_logprobs.leader_done(r, sched.requests)
                 and r.request_id not in capped]
        if not ready:
            break
        req = next_waiting(ready, counts, sched.config.policy)
        if req.num_pending:           # preempted with a token in flight: next step
            break
        imports = handoff.imports(req) and req.request_id not in sched._imported
        hit = _hit(sched, req, imports)
        if imports:               # the prompt's cache comes from a prefill instance
            computed = req.num_prompt_tokens
        else:
            computed = hit.num_tokens if hit is not None else req.num_computed_tokens
        n = prompt_logprobs.chunk(req, min(req.num_tokens - computed, budget, chunk_cap),
                                  sched._scoring_left)
        n = decode_guard.take(req.num_tokens - computed, n, sched.guard, sched._bulk_left)
        if n == 0:
            # a scoring or bulk chunk with no room left: requests behind it of another
            # kind (a short prompt) still start this step
            capped.add(req.request_id)
            continue
        # an import's first step verifies the drafts its prefill instance proposed after
        # the first token (they came with its cache), as a colocated second step would
        d = draft_plan.num_drafts(sched, req, budget) if imports and req.spec_token_ids else 0
        n += d
        if not sched.cache.allocate(req.request_id, computed + n, hit):
            if not sched.running and not scheduled:
                # Alone and still too big: it can never fit; end it instead of spinning.
                sched.finish(req.request_id, RequestStatus.FINISHED_LENGTH)
                sched._ended.append(req.request_id)
                continue
            break
        sched.waiting.remove(req)
        req.status = RequestStatus.RUNNING
        if imports:
            _take_import(sched, req, hit, computed)
            hit = None            # the transfer's state replaces the hit's snapshot
            if d:
                drafts[req.request_id] = d
        if hit is not None:
            req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
            if hit.snapshot is not None:
                sched._restore[req.request_id] = hit.snapshot.snapshot_id
        sched.running.append(req)
        counts[req.group] += 1
        scheduled.append((req, n))
        budget -= n
        admitted.append(req)
    if sched.spec_policy is not None:
        # told once the step's admissions are done, with the batch they made: told one by
        # one, 32 requests admitted together passed through every smaller batch size, and
        # the first (a batch of 1, where drafting pays) woke a drafter asleep at 32 on each
        # such step: 3% of a batch-32 demo run
        for req in admitted:
            sched.spec_policy.admitted(len(sched.running), req.request_id,
                                       not req.sampling_params.greedy)


def reserve_for_waiting(sched: Scheduler, budget: int) -> int:
    """Budget a partial prefill leaves for admitting waiting requests (at most half the
    step), so a short request arriving during a long prefill starts at the next step
    instead of after the whole prompt; 0 when no slot is free to admit into."""
    if not sched.waiting or len(sched.running) >= sched.config.max_num_seqs:
        return 0
    need = 0
    for req in sched.waiting:
        need += req.num_tokens - req.num_computed_tokens
        if need >= budget // 2:
            return budget // 2
    return need


def _hit(sched: Scheduler, req: Request, imports: bool) -> PrefixHit | None:
    """The request's prefix-cache hit. An import's: blocks this instance holds need not be
    written again; the ones the hit query pinned for it first (the transfer leaves them
    out)."""
    if imports:
        hit = sched.cache.held_hit(req.sampling_params.kv_transfer.transfer_id,
                                   req.prompt_token_ids, req.extra_keys, req.cache_salt)
        if hit is not None:
            return hit
    elif req.num_computed_tokens or wants_prompt_logprobs(req):
        return None
    return sched.cache.find_hit(req.all_token_ids, req.extra_keys, req.cache_salt)


def _take_import(sched: Scheduler, req: Request, hit: PrefixHit | None, computed: int) -> None:
    """An admitted import: its prompt counts as computed, and the step receives its cache."""
    held = hit.num_tokens if hit is not None else 0
    req.num_computed_tokens, req.num_cached_tokens = computed, held
    sched._imported.add(req.request_id)
    # the request shares the held blocks now: the hold's references can go
    sched.cache.release_hold(req.sampling_params.kv_transfer.transfer_id)
    sched._receives[req.request_id] = handoff.receive_op(
        req, sched.cache.block_ids(req.request_id), sched.cache.slot(req.request_id), held)
