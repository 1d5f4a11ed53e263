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
    interior: bool = False      # some snapshot reads a chunk-end state (the kernel keeps them)


@dataclass(frozen=True)
class SnapshotAt:
    """Save the state of batch row `row` after absolute position `position` - 1 (that is,
    with `position` tokens in) into snapshot `snapshot_id`."""

    row: int
    position: int
    snapshot_id: int


def snapshot_plan(snapshots: list[SnapshotAt], rows: PackedRows, conv: ConvRows,
                  seq_lens: list[int], context_lens: list[int], chunk_size: int
                  ) -> SnapshotPlan:
    """Checked and laid out from the Python lists (nothing waits on the device)."""
    nd = rows.num_decode
    final, chunk, upto = [], [], []
    for s in snapshots:
        u = s.position - context_lens[s.row]             # tokens of this step before it
        if not 0 < u <= seq_lens[s.row]:
            raise ValueError("snapshot positions must fall inside the sequence's tokens of "
                             "the step")
        final.append(u == seq_lens[s.row])
        upto.append(u)
        if final[-1]:
            chunk.append(0)
            continue
        if s.row < nd:
            raise ValueError("decode rows can only snapshot their final state")
        into = u + context_lens[s.row] % chunk_size      # padded rows up to it (left pad)
        if into % chunk_size:
            raise ValueError("interior snapshots must sit on KDA chunk boundaries")
        chunk.append(into // chunk_size - 1)

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, device=rows.device)

    seq = tensor([s.row for s in snapshots])
    return SnapshotPlan(tensor([s.snapshot_id for s in snapshots]), seq, tensor(final),
                        tensor(chunk), conv.before(seq, rows.cu[seq], tensor(upto)),
                        interior=not all(final))
