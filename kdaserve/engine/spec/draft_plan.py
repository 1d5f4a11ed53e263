"""How many drafts each request verifies and proposes in a step (Scheduler.schedule), from the
adaptive speculation policy (engine/spec/adaptive.py): the plan for the decoding requests, each
request's share within its budget, and the limits the step's proposer honours. Plain Python
over the scheduler's state, like the scheduler (no tensors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdaserve.request import Request

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler


def plan(sched: Scheduler) -> None:
    """Drafts per decoding request for this step; the same numbers bound what is proposed for
    the next."""
    policy = sched.spec_policy
    if policy is None:
        sched._draft_plan = {}
        return
    if policy.dormant:          # the plan is all zeros: no drafts exist
        sched._draft_plan = policy.plan({}, max(1, len(sched.running)))
        return
    candidates = {r.request_id: policy.max_drafts for r in sched.running
                  if r.num_computed_tokens == r.num_tokens - 1 or r.spec_token_ids}
    sched._draft_plan = policy.plan(candidates, max(1, len(sched.running)))


def num_drafts(sched: Scheduler, req: Request, budget: int) -> int:
    """How many of the request's drafts to verify: never past max_tokens or max_model_len
    (the step yields drafts + 1 tokens), nor the step's token budget."""
    room = min(req.max_tokens - len(req.output_token_ids),
               sched.config.max_model_len - req.num_tokens) - 1
    planned = sched._draft_plan.get(req.request_id, len(req.spec_token_ids))
    return max(0, min(len(req.spec_token_ids), planned, room, budget - 1))


def limits(sched: Scheduler, scheduled: list[tuple[Request, int]]) -> dict[str, int] | None:
    """The most drafts to propose after this step for each scheduled request (None: no
    policy, or a sleeping drafter that proposes nothing). Requests outside the plan (still
    prefilling) get what acceptance earns, asked once a step for each kind (sampled or
    greedy)."""
    policy = sched.spec_policy
    if policy is None or policy.dormant:
        return None
    out = {req.request_id: sched._draft_plan.get(req.request_id) for req, _ in scheduled}
    first: dict[bool, int] = {}
    for req, _ in scheduled:
        if out[req.request_id] is None:
            kind = not req.sampling_params.greedy
            if kind not in first:
                first[kind] = policy.initial_drafts(max(1, len(sched.running)), kind)
            out[req.request_id] = first[kind]
    return out
