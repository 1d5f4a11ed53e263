"""`sampler.Penalties` (built once, advanced by drafts, expanded to verified positions) equals a
plain per-row, per-position recomputation of repetition, frequency and presence penalties."""

from __future__ import annotations

import torch

from kdaserve.engine.sampler import Penalties, SamplingRow
from kdaserve.request import SamplingParams

V = 50


def _reference(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One row at a time, from the row's whole history."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long),
                                minlength=V).float()
        row = out[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(r.prompt_token_ids, dtype=torch.long)] = True
            row = torch.where(seen, torch.where(row > 0, row / p.repetition_penalty,
                                                row * p.repetition_penalty), row)
        out[i] = row - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())
    return out


def _rows(g: torch.Generator) -> list[SamplingRow]:
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3),
              SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(temperature=0.8, repetition_penalty=0.9, presence_penalty=-0.5)]
    return [SamplingRow(f"r{i}", p, torch.randint(0, V, (7,), generator=g).tolist(),
                        torch.randint(0, V, (i * 3,), generator=g).tolist(), None)
            for i, p in enumerate(params)]


def test_build_and_apply_match_reference():
    g = torch.Generator().manual_seed(0)
    rows = _rows(g)
    logits = torch.randn(len(rows), V, generator=g)
    pen = Penalties.build(rows, V)
    assert torch.equal(pen.apply(logits), _reference(logits, rows))
    assert Penalties.build(rows[:1], V) is None


def test_advance_matches_rebuilt_history():
    g = torch.Generator().manual_seed(1)
    rows = _rows(g)
    pen = Penalties.build(rows, V)
    for _ in range(4):
        tok = torch.randint(0, V, (len(rows),), generator=g)
        pen.advance(tok)
        rows = [SamplingRow(r.request_id, r.params, r.prompt_token_ids,
                            r.output_token_ids + [int(t)], None) for r, t in zip(rows, tok)]
        logits = torch.randn(len(rows), V, generator=g)
        assert torch.equal(pen.apply(logits), _reference(logits, rows))


def test_positions_see_earlier_drafts():
    g = torch.Generator().manual_seed(2)
    rows = _rows(g)
    drafts = [[3, 3, 9], [], [4, 4], [1, 2, 3, 4]]
    pos_rows = [SamplingRow(r.request_id, r.params, r.prompt_token_ids,
                            r.output_token_ids + d[:j], None)
                for r, d in zip(rows, drafts) for j in range(len(d) + 1)]
    logits = torch.randn(len(pos_rows), V, generator=g)
    pen = Penalties.build(rows, V).positions(drafts)
    assert torch.equal(pen.apply(logits), _reference(logits, pos_rows))
