"""Sampling a step's rows: plain rows through the sampler, verify rows (a token and its drafts)
through the rejection sampler, each with its request's own generator, and the draft
probabilities a probabilistic proposer left for the next verification."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kdaserve.engine.sampler import SamplingRow, sample
from kdaserve.engine.spec.rejection import VerifyRow, verify
from kdaserve.engine.step_message import RunnerRequest
from kdaserve.outputs import SampledToken, ScheduledSequence


class RowSampler:
    def __init__(self, seed: int) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._unseeded = torch.Generator().manual_seed(seed)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._draft_probs.pop(request_id, None)

    def keep_draft_probs(self, request_id: str, probs: torch.Tensor | None) -> None:
        """The proposer's probabilities of the drafts it just made (None: point masses)."""
        if probs is not None:
            self._draft_probs[request_id] = probs
        else:
            self._draft_probs.pop(request_id, None)

    def _generator(self, req: RunnerRequest) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._unseeded
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def row(self, req: RunnerRequest) -> SamplingRow:
        return SamplingRow(req.request_id, req.sampling_params, req.prompt_token_ids,
                           req.output_token_ids, self._generator(req))

    def sample(self, seqs: Sequence[ScheduledSequence], logits: torch.Tensor,
               requests: Mapping[str, RunnerRequest],
               masks: Mapping[str, torch.Tensor] | None = None,
               ) -> dict[str, list[SampledToken]]:
        """logits: the wanted rows in forward order (all positions of verify rows).
        masks: grammar bitmasks [positions, W] of the constrained requests."""
        masks = masks or {}
        plain_idx, plain_rows, ver_idx, ver_rows = [], [], [], []
        at = 0
        for s in seqs:
            if s.num_draft_tokens:
                n = s.num_draft_tokens + 1
                ver_idx.extend(range(at, at + n))
                probs = self._draft_probs.pop(s.request_id, None)
                if probs is not None:
                    probs = probs[: s.num_draft_tokens]
                ver_rows.append(VerifyRow(self.row(requests[s.request_id]),
                                          list(s.token_ids[1:]), probs,
                                          masks.get(s.request_id)))
                at += n
            elif s.sample:
                plain_idx.append(at)
                plain_rows.append(self.row(requests[s.request_id]))
                if s.request_id in masks:
                    plain_rows[-1].bitmask = masks[s.request_id][0]
                at += 1
        out: dict[str, list[SampledToken]] = {}
        if plain_rows:
            tokens = sample(logits[plain_idx], plain_rows)
            out.update({r.request_id: [t] for r, t in zip(plain_rows, tokens)})
        if ver_rows:
            tokens = verify(logits[ver_idx], ver_rows)
            out.update({v.row.request_id: t for v, t in zip(ver_rows, tokens)})
        return out
