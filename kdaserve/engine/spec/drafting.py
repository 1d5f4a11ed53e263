"""A step's drafts (ModelRunner.finish, after sampling): the proposer (DSpark or n-gram) is
handed the step's rows, the tokens that stand, the hidden states the forward captured and each
request's sampling row, and proposes the next drafts; those a request's grammar refuses are
trimmed, and the draft's probabilities are kept for the verification of the next step. While
adaptive speculation keeps the drafter asleep it only hears which rows it missed."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kdaserve.engine.spec.proposer import Proposal, ProposalInput
from kdaserve.outputs import SampledToken, ScheduledSequence

if TYPE_CHECKING:
    from kdaserve.engine.runner import ModelRunner


def propose_drafts(runner: ModelRunner, seqs: list[ScheduledSequence], valid: list[int],
                   sampled: Mapping[str, list[SampledToken]], captured: list[torch.Tensor],
                   positions: torch.Tensor, cache_slots: torch.Tensor | None,
                   draft_limits: dict[str, int] | None, drafting: bool
                   ) -> tuple[dict[str, list[int]], float]:
    """The drafts by request, and the host seconds spent proposing them (on a GPU the
    draft's kernels may still run: a wait here would cost more)."""
    proposer = runner.proposer
    assert proposer is not None
    if not drafting:                         # the drafter sleeps
        proposer.missed(seqs)
        return {}, 0.0
    began = time.perf_counter()
    # a step in which nobody sampled (prompt chunks only) is draft context too
    hidden = torch.cat(captured, -1) if captured else None
    requests = runner.requests
    rows = {rid: runner.sampler.row(requests[rid]) for rid in sampled}
    props = proposer.propose(ProposalInput(
        seqs, valid, {rid: [t.token_id for t in ts] for rid, ts in sampled.items()},
        requests, positions, cache_slots, hidden, rows, draft_limits))
    drafts = _keep(runner, props)
    return drafts, time.perf_counter() - began


def _keep(runner: ModelRunner, props: dict[str, Proposal]) -> dict[str, list[int]]:
    drafts = {}
    for rid, p in props.items():
        drafts[rid] = p.tokens
        if runner.structured is not None:   # drafts the grammar refuses cannot be accepted
            drafts[rid] = runner.structured.trim_drafts(rid, p.tokens)
        runner.sampler.keep_draft_probs(rid, p.probs)
    return drafts
