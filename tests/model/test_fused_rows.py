"""The fused step's row inputs (kdaserve/model/fused_rows.py RowInputs) against the plain
construction, one row per token, over steps whose shapes change and repeat."""

import torch

from kdaserve.model.fused_rows import RowInputs
from kdaserve.outputs import ScheduledSequence


def _reference(seqs):
    width = max(1, max(len(s.block_ids) for s in seqs))
    ids, pos, slots, table = [], [], [], []
    for s in seqs:
        ids += s.token_ids
        for j in range(len(s.token_ids)):
            pos.append(s.context_len + j)
            slots.append(s.state_slot)
            table.append(s.block_ids + [0] * (width - len(s.block_ids)))
    return (torch.tensor(ids), torch.tensor(pos), torch.tensor(slots),
            torch.tensor(table).view(len(pos), width))


def _seq(i, tokens, ctx, blocks, slot):
    return ScheduledSequence(f"r{i}", list(range(7 * i, 7 * i + tokens)), ctx, blocks, slot, True,
                             num_draft_tokens=tokens - 1)


def test_fill_matches_the_plain_construction_across_steps():
    inputs = RowInputs()
    steps = [
        [_seq(0, 1, 17, [3, 9], 2)],
        [_seq(0, 1, 18, [3, 9], 2)],                       # same shape: the same buffers
        [_seq(0, 3, 31, [3, 9, 4], 2), _seq(1, 1, 5, [7], 0)],   # drafts share the slot
        [_seq(0, 1, 0, [], 1), _seq(1, 2, 200, list(range(40, 53)), 5)],  # grows, no blocks
        [_seq(0, 1, 7, [1], 3)],                           # shrinks again
    ]
    for seqs in steps:
        got = inputs.fill(seqs)
        want = _reference(seqs)
        for g, w in zip(got, want):
            assert g.dtype == torch.long and g.is_contiguous()
            assert torch.equal(g, w)


def test_a_kept_tensor_changes_with_the_next_fill():
    """The documented contract: the views hold until the next fill (callers clone)."""
    inputs = RowInputs()
    first = inputs.fill([_seq(0, 1, 10, [1], 0)])[1]
    kept = first.clone()
    inputs.fill([_seq(0, 1, 11, [1], 0)])
    assert torch.equal(kept, torch.tensor([10])) and torch.equal(first, torch.tensor([11]))
