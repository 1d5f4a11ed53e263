"""A request's share of a step as the runner gets it (`ScheduledSequence`: its tokens, drafts
included, its blocks and state slot, whether it samples), and the cache operations that share
asks for, in the order they run: a disaggregated import's receive, an export's push of what
is computed, a prefix hit's snapshot restore, the snapshots to take at block boundaries, and
the settling of drafts. Plain Python over the scheduler's state (no tensors)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdaserve.cache.ops import CacheOp, RestoreSnapshot, SettleDrafts, TakeSnapshot
from kdaserve.disagg import handoff
from kdaserve.outputs import ScheduledSequence
from kdaserve.request import Request

if TYPE_CHECKING:
    from kdaserve.engine.scheduler import Scheduler


def sequence_for(sched: Scheduler, req: Request, n: int, ops: list[CacheOp],
                 num_drafts: int = 0) -> ScheduledSequence:
    """The request's next n tokens (the last num_drafts of them drafts); its cache operations
    go to `ops`."""
    rid, start = req.request_id, req.num_computed_tokens
    slot = sched.cache.slot(rid)
    tokens = req.token_ids_between(start, start + n - num_drafts)
    if num_drafts:
        tokens += req.spec_token_ids[:num_drafts]
    if rid in sched._receives:
        ops.append(sched._receives.pop(rid))
    block_ids = sched.cache.block_ids(rid)
    push = (handoff.push_op(req, block_ids, sched.cache.block_size, sched._pushed.get(rid))
            if req.sampling_params.kv_transfer is not None else None)
    if push is not None:
        ops.append(push)
        sched._pushed[rid] = (push.token_end, push.part + 1)
    if rid in sched._restore:
        ops.append(RestoreSnapshot(rid, sched._restore[rid], slot))
    if sched.cache.prefix_caching:
        # Snapshots past a draft's position are taken only if that draft is accepted; the
        # runner reports the others as dropped (hashing drafts here is what they would be).
        all_ids = req.all_token_ids
        for pos, sid in sched.cache.plan_snapshots(
                rid, all_ids + tokens[1:] if num_drafts else all_ids,
                req.num_prompt_tokens, start, start + n, req.extra_keys, req.cache_salt,
                certain=start + n - num_drafts):
            ops.append(TakeSnapshot(rid, pos, sid))
    if num_drafts:
        ops.append(SettleDrafts(rid, slot))
    return ScheduledSequence(
        request_id=rid, token_ids=tokens, context_len=start,
        block_ids=block_ids, state_slot=slot,
        sample=start + n - num_drafts == req.num_tokens,
        num_draft_tokens=num_drafts,
        media=tuple(m for m in req.media if m.overlaps(start, start + n)) if req.media
        else (),
    )
