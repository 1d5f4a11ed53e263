"""The snapshot plan (kdaserve/model/layout/snapshots.py): final and chunk-end states, the
conv windows at the boundary, and the positions it refuses."""

from __future__ import annotations

import pytest
import torch

from kdaserve.model.layout.rows import ConvRows, PackedRows
from kdaserve.model.layout.snapshots import SnapshotAt, snapshot_plan

CPU = torch.device("cpu")
KM1, C = 3, 4


def _plan(lens, ctx, nd, snaps):
    rows = PackedRows.build(lens, ctx, nd, CPU)
    conv = ConvRows(len(lens), KM1, rows.num_tokens)
    return snapshot_plan(snaps, rows, conv, lens, ctx, C), rows, conv


def test_final_and_interior_snapshots():
    lens, ctx = [1, 10], [7, 2]          # a decode row, then a prefill chunk at 2..11
    snaps = [SnapshotAt(0, 8, 11), SnapshotAt(1, 12, 12), SnapshotAt(1, 8, 13)]
    plan, rows, conv = _plan(lens, ctx, 1, snaps)
    assert plan.dest.tolist() == [11, 12, 13] and plan.seq.tolist() == [0, 1, 1]
    assert plan.final.tolist() == [True, True, False]
    # position 8 of row 1: 6 tokens in, after a left pad of 2 -> the end of padded chunk 1
    assert int(plan.chunk[2]) == (2 + 6) // C - 1
    for i, s in enumerate(snaps):
        upto = s.position - ctx[s.row]
        want = conv.before(torch.tensor([s.row]), rows.cu[s.row:s.row + 1],
                           torch.tensor([upto]))[0]
        assert plan.window_idx[i].tolist() == want.tolist()


@pytest.mark.parametrize("snap, match", [
    (SnapshotAt(1, 2, 0), "inside the sequence's tokens"),        # at the context: no token in
    (SnapshotAt(1, 13, 0), "inside the sequence's tokens"),       # past the chunk
    (SnapshotAt(1, 7, 0), "chunk boundaries"),                    # not a chunk end
])
def test_refused_positions(snap, match):
    with pytest.raises(ValueError, match=match):
        _plan([1, 10], [7, 2], 1, [snap])


def test_decode_rows_snapshot_only_their_final_state():
    with pytest.raises(ValueError, match="final state"):
        _plan([3], [8], 1, [SnapshotAt(0, 9, 0)])
