"""Persistent input tensors of a decode step on the device.

A decode step's inputs (token ids, positions, KDA state slots, MLA block tables) are written
into tensors allocated once and reused step after step, through one host staging copy each
(pinned on CUDA, so the copies are asynchronous), instead of fresh tensors per step. With the
layout built from Python-known sizes and the MoE routed without reading counts back
(`ForwardBatch.sync_free`), a decode step's forward then never waits on the device, and its
inputs sit at fixed addresses: what a captured CUDA graph needs (docs/design.md, "The
device-resident decode step"). The buffers grow (new storage) only when a step needs more
rows or a wider block table than any before.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kdaserve.outputs import ScheduledSequence


@dataclass
class DecodeStepInputs:
    """Views of the persistent buffers for one step of n one-token decode rows."""

    ids: torch.Tensor            # [n]
    positions: torch.Tensor      # [n]
    slots: torch.Tensor          # [n]
    block_table: torch.Tensor    # [n, width] (entries past a row's blocks are stale: masked)


class DecodeInputs:
    def __init__(self, device: torch.device, rows: int = 8, width: int = 16,
                 fixed: bool = False) -> None:
        """fixed: the buffers never move (captured graphs read them): sized for the largest
        batch and the widest block table up front, and a step that needs more is an error."""
        self.device = torch.device(device)
        self.fixed = fixed
        self._alloc(rows, width)

    def _alloc(self, rows: int, width: int) -> None:
        pin = self.device.type == "cuda"
        self.rows, self.width = rows, width
        self.vectors = torch.zeros(3, rows, dtype=torch.long, device=self.device)
        self.table = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self._host_vectors = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self._host_table = torch.zeros(rows, width, dtype=torch.long, pin_memory=pin)

    def fill(self, seqs: Sequence[ScheduledSequence], pad_to: int | None = None,
             pad_slot: int = 0, pad_block: int = 0) -> DecodeStepInputs:
        """Write the step's inputs (one token per row) into the buffers; returns views.
        pad_to: rows past the step's, up to this many, become padding (token 0 at position 0
        in `pad_slot` and `pad_block`: a captured graph's batch size; the table keeps its full
        width then)."""
        n = len(seqs)
        rows = n if pad_to is None else pad_to
        width = max(1, max((len(s.block_ids) for s in seqs), default=1))
        if rows > self.rows or width > self.width:
            if self.fixed:
                raise ValueError(f"a step of {rows} rows and {width} blocks does not fit the "
                                 f"fixed decode buffers ({self.rows} x {self.width})")
            self._alloc(max(rows, 2 * self.rows if rows > self.rows else self.rows),
                        max(width, 2 * self.width if width > self.width else self.width))
        if pad_to is not None:
            width = self.width
        host = self._host_vectors
        pad = rows - n
        host[0, :rows] = torch.frombuffer(array("q", [s.token_ids[0] for s in seqs] + [0] * pad),
                                          dtype=torch.long)
        host[1, :rows] = torch.frombuffer(array("q", [s.context_len for s in seqs] + [0] * pad),
                                          dtype=torch.long)
        host[2, :rows] = torch.frombuffer(
            array("q", [s.state_slot for s in seqs] + [pad_slot] * pad), dtype=torch.long)
        for b, s in enumerate(seqs):
            if s.block_ids:
                self._host_table[b, :len(s.block_ids)] = torch.frombuffer(
                    array("q", s.block_ids), dtype=torch.long)
        self._host_table[n:rows, 0] = pad_block
        # the staging buffers are rewritten next step: safe while each step ends by reading
        # its tokens back (the copy has run by then); overlapping steps need two of them
        self.vectors[:, :rows].copy_(host[:, :rows], non_blocking=True)
        self.table[:rows, :width].copy_(self._host_table[:rows, :width], non_blocking=True)
        return DecodeStepInputs(self.vectors[0, :rows], self.vectors[1, :rows],
                                self.vectors[2, :rows], self.table[:rows, :width])
