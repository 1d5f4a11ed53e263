"""What a proposer sees after a verified step, and the interface every proposer implements."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from kdaserve.engine.sampler import SamplingRow
from kdaserve.outputs import ScheduledSequence
from kdaserve.request import Request


@dataclass
class ProposalInput:
    seqs: list[ScheduledSequence]        # in forward order
    num_valid: list[int]                 # tokens of each sequence whose computation stands
    new_tokens: dict[str, list[int]]     # tokens sampled this step, per request that sampled
    requests: Mapping[str, Request]
    positions: torch.Tensor              # [T] each token's position, in forward order
    cache_slots: torch.Tensor            # [T] each token's row in the paged MLA layout
    hidden: torch.Tensor | None          # [T, n*H] the target's hidden states at the draft's layers
    sampling: dict[str, SamplingRow]     # per request that sampled (its generator, params)
    limits: dict[str, int] | None = None  # most drafts to propose per request (None: all)

    def limit(self, request_id: str, most: int) -> int:
        return most if self.limits is None else min(most, self.limits.get(request_id, most))


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None    # [len(tokens), V] when drawn at random, else None


class Proposer(Protocol):
    num_tokens: int
    capture_layers: tuple[int, ...]

    def propose(self, inp: ProposalInput) -> dict[str, Proposal]: ...

    def missed(self, seqs: list[ScheduledSequence], offset: int = 0) -> None:
        """A step ran without capture (the drafter sleeps): what it wrote is not context.
        offset: the rows' tokens sat that many positions past their context_len (a decode
        burst's later forwards run the burst's first rows again, one position on)."""

    def forget_context(self) -> None:
        """Steps ran without the drafter at all (no request in flight now): no slot holds
        context it can trust."""


class NgramDrafts:
    """The n-gram proposer behind the Proposer interface."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        from kdaserve.engine.spec.ngram import NgramProposer

        self.num_tokens = num_tokens
        self.lookup = NgramProposer(num_tokens, ngram_min, ngram_max)

    def missed(self, seqs: list[ScheduledSequence], offset: int = 0) -> None:
        """Nothing to keep: the n-gram lookup reads the token ids, which are all there."""

    def forget_context(self) -> None:
        """Nothing kept: the n-gram lookup reads the token ids."""

    def propose(self, inp: ProposalInput) -> dict[str, Proposal]:
        out = {}
        for rid, new in inp.new_tokens.items():
            k = inp.limit(rid, self.num_tokens)
            if not k:
                continue
            drafts = self.lookup.propose(inp.requests[rid].all_token_ids + new)[:k]
            if drafts:
                out[rid] = Proposal(drafts)
        return out
