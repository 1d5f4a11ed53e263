"""The snapshot plan of a step: which KDA states the forward saves at block boundaries
(prefix-cache snapshots), from where, into which snapshot ids.

A snapshot at the end of a sequence's share of the step is its final state; one inside a
prefill chunk is a chunk-end state of the chunked kernel (so it must sit on a chunk boundary
of the padded layout); decode rows can only snapshot their final state. The conv window at
the snapshot is a row gather of the conv input (kdaserve/model/layout/rows.py ConvRows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.model.layout.rows import ConvRows, PackedRows


@dataclass
class SnapshotPlan:
    """KDA states to save at block boundaries during this forward (prefix-cache snapshots)."""

    dest: torch.Tensor          # [S] snapshot ids
    seq: torch.Tensor           # [S] batch index of the sequence
    final: torch.Tensor         # [S] bool: the boundary is the end of this step's chunk
    chunk: torch.Tensor         # [S] index into the prefill row's chunk states (when not final)
    window_idx: torch.Tensor    # [S, K-1] ConvRows of the window at the boundary


@dataclass(frozen=True)
class SnapshotAt:
    """Save the state of batch row `row` after absolute position `position` - 1 (that is,
    with `position` tokens in) into snapshot `snapshot_id`."""

    row: int
    position: int
    snapshot_id: int


def snapshot_plan(snapshots: list[SnapshotAt], rows: PackedRows, conv: ConvRows,
                  pre: torch.Tensor, chunk_size: int) -> SnapshotPlan:
    """`pre`: the prefill rows' left pads (kdaserve/model/layout/kda.py prefill_padding)."""
    device, nd = rows.device, rows.num_decode
    seq = torch.tensor([s.row for s in snapshots], dtype=torch.long, device=device)
    pos = torch.tensor([s.position for s in snapshots], dtype=torch.long, device=device)
    dest = torch.tensor([s.snapshot_id for s in snapshots], dtype=torch.long, device=device)
    upto = pos - rows.ctx[seq]                             # tokens of this step before p
    if bool(((upto <= 0) | (upto > rows.lens[seq])).any()):
        raise ValueError("snapshot positions must fall inside the sequence's tokens of the step")
    final = upto == rows.lens[seq]
    interior = ~final
    if bool((interior & (seq < nd)).any()):
        raise ValueError("decode rows can only snapshot their final state")
    chunk = torch.zeros_like(seq)
    if bool(interior.any()):
        into = upto + pre[(seq - nd).clamp(min=0)]         # padded rows up to p
        if bool((interior & (into % chunk_size != 0)).any()):
            raise ValueError("interior snapshots must sit on KDA chunk boundaries")
        chunk = torch.where(interior, into // chunk_size - 1, chunk)
    return SnapshotPlan(dest, seq, final, chunk, conv.before(seq, rows.cu[seq], upto))
