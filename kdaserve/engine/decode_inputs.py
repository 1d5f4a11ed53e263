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
    def __init__(self, device: torch.device, rows: int = 8, width: int = 16) -> None:
        self.device = torch.device(device)
        self._alloc(rows, width)

    def _alloc(self, rows: int, width: int) -> None:
        pin = self.device.type == "cuda"
        self.rows, self.width = rows, width
        self.vectors = torch.zeros(3, rows, dtype=torch.long, device=self.device)
        self.table = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        self._host_vectors = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self._host_table = torch.zeros(rows, width, dtype=torch.long, pin_memory=pin)

    def fill(self, seqs: Sequence[ScheduledSequence]) -> DecodeStepInputs:
        """Write the step's inputs (one token per row) into the buffers; returns views."""
        n = len(seqs)
        width = max(1, max(len(s.block_ids) for s in seqs))
        if n > self.rows or width > self.width:
            self._alloc(max(n, 2 * self.rows if n > self.rows else self.rows),
                        max(width, 2 * self.width if width > self.width else self.width))
        host = self._host_vectors
        host[0, :n] = torch.frombuffer(array("q", [s.token_ids[0] for s in seqs]),
                                       dtype=torch.long)
        host[1, :n] = torch.frombuffer(array("q", [s.context_len for s in seqs]),
                                       dtype=torch.long)
        host[2, :n] = torch.frombuffer(array("q", [s.state_slot for s in seqs]),
                                       dtype=torch.long)
        for b, s in enumerate(seqs):
            if s.block_ids:
                self._host_table[b, :len(s.block_ids)] = torch.frombuffer(
                    array("q", s.block_ids), dtype=torch.long)
        # the staging buffers are rewritten next step: safe while each step ends by reading
        # its tokens back (the copy has run by then); overlapping steps need two of them
        self.vectors[:, :n].copy_(host[:, :n], non_blocking=True)
        self.table[:n, :width].copy_(self._host_table[:n, :width], non_blocking=True)
        return DecodeStepInputs(self.vectors[0, :n], self.vectors[1, :n], self.vectors[2, :n],
                                self.table[:n, :width])
