"""Attention data parallelism with expert-parallel MoE (the "DEP" layout): one scheduler on
rank 0 as for every layout, but each request runs on one rank only. That rank computes its
attention, holds its MLA blocks and KDA states, and samples it; the MoE layers exchange every
rank's tokens with the experts' owners (ep_all2all with `tokens_local`). A rank with no
request in a step still joins each MoE layer's collectives with no tokens.

Placement (on the engine side, `Placement`): a request that starts with a prefix hit runs on
the rank that wrote the cached prefix (the owner of its restored KDA snapshot, else of its
first block), since only that rank holds the data; any other request goes to the rank with
the fewest requests. A preempted request is placed again when it comes back. Every rank
allocates the cache the scheduler plans (one logical pool, the blocks of each rank's requests
used there): simple, and correct with prefix caching, at the cost of D times the memory of a
layout whose scheduler would plan one pool per rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from kdaserve.cache.ops import RestoreSnapshot, TakeSnapshot, ops_for
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput


class Placement:
    """Which data-parallel rank runs each request, kept by the engine across steps."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.rank_of: dict[str, int] = {}
        self.placed = [0] * size          # requests placed on each rank so far
        self._block_owner: dict[int, int] = {}
        self._snapshot_owner: dict[int, int] = {}

    def _place(self, seq, restore: int | None) -> int:
        if seq.context_len > 0:            # a prefix hit: where the prefix was computed
            if restore is not None and restore in self._snapshot_owner:
                return self._snapshot_owner[restore]
            if seq.block_ids and seq.block_ids[0] in self._block_owner:
                return self._block_owner[seq.block_ids[0]]
        load = [0] * self.size
        for r in self.rank_of.values():
            load[r] += 1
        return min(range(self.size), key=lambda r: (load[r], r))

    def assign(self, out: SchedulerOutput) -> dict[str, int]:
        """The ranks of this step's requests (and the ownership of what they write)."""
        for rid in (*out.finished, *out.preempted):
            self.rank_of.pop(rid, None)
        restores = {op.request_id: op.snapshot_id for op in out.ops_of(RestoreSnapshot)}
        for s in out.sequences:
            r = self.rank_of.get(s.request_id)
            if r is None:
                r = self.rank_of[s.request_id] = self._place(s, restores.get(s.request_id))
                self.placed[r] += 1
            for b in s.block_ids:
                self._block_owner[b] = r
        for op in out.ops_of(TakeSnapshot):
            self._snapshot_owner[op.snapshot_id] = self.rank_of[op.request_id]
        return {s.request_id: self.rank_of[s.request_id] for s in out.sequences}


def rank_share(out: SchedulerOutput, rank: int) -> SchedulerOutput:
    """This rank's sequences and their cache operations; the request data and the frees stay
    whole, so that every rank knows every request (one may be placed elsewhere after
    preemption)."""
    mine = {rid for rid, r in out.dp_ranks.items() if r == rank}
    return replace(out, sequences=[s for s in out.sequences if s.request_id in mine],
                   ops=ops_for(out.ops, mine))


def idle_moe_pass(model, device: torch.device) -> None:
    """The collectives of one forward without tokens: each MoE layer in order."""
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or moe.routed_backend is None:
            continue
        k = moe.gate.top_k
        x = torch.empty(0, moe.width, dtype=model.dtype, device=device)
        ids = torch.empty(0, k, dtype=torch.long, device=device)
        moe.routed_backend(moe, x, torch.empty(0, k, device=device), ids)


def merge(outs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    merged = ModelRunnerOutput(sampled={})
    for o in outs:
        merged.sampled.update(o.sampled)
        merged.drafts.update(o.drafts)
        merged.cache.extend(o.cache)
        merged.prompt_logprobs.update(o.prompt_logprobs)
        merged.grammar_errors.update(o.grammar_errors)
        merged.draft_seconds = max(merged.draft_seconds, o.draft_seconds)   # ranks in parallel
    return merged


def execute_step(runner, out: SchedulerOutput, rank: int, world: int) -> ModelRunnerOutput | None:
    """One step on one data-parallel rank; rank 0 returns every rank's results merged."""
    mine = rank_share(out, rank)
    result = runner.execute(mine)
    if not mine.sequences:
        idle_moe_pass(runner.model, runner.device)
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    return merge(gathered) if rank == 0 else None
