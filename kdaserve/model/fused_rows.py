"""Which decode steps take the fused CPU path and how their rows are laid out: one row per
token (a token and its drafts each a row of the request's slot), the states kept after each
row for the rollback of rejected drafts, and the threads a step's rows are split over when
the compiled blocks do not run in parallel themselves (kdaserve/model/fused_decode.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
import torch

from kdaserve.model.hybrid_cache import HybridCache

# the blocks read each weight once per step for all rows (row_products.h); up to this
# many decode rows they beat the batched torch forward (docs/benchmarks.md, "Fused decode")
MAX_FUSED_ROWS = 64
# rows per thread below which one thread runs the whole step (a pool hand-off costs more)
MIN_ROWS_PER_THREAD = 4


@dataclass
class Kept:
    """Every row's KDA state and conv window after its token, per KDA layer (by kda_index):
    states [rows, H, D, D] fp32, conv [rows, K-1, 3HD] in the cache's dtype."""

    states: list[torch.Tensor]
    conv: list[torch.Tensor]

    @classmethod
    def allocate(cls, cache: HybridCache, rows: int) -> Kept:
        return cls([torch.empty((rows,) + tuple(s.shape[1:]), dtype=s.dtype)
                    for s in cache.kda_states],
                   [torch.empty((rows,) + tuple(c.shape[1:]), dtype=c.dtype)
                    for c in cache.kda_conv])

    def copy_to(self, rows: torch.Tensor, states: list[torch.Tensor],
                convs: list[torch.Tensor], dest: torch.Tensor) -> None:
        """The kept entries of `rows` into `dest` of states/convs (slots or snapshots)."""
        for ks, kc, st, cv in zip(self.states, self.conv, states, convs):
            st.index_copy_(0, dest, ks[rows].to(st.dtype))
            cv.index_copy_(0, dest, kc[rows].to(cv.dtype))


def split_parts(threads: int, rows: int, capture: tuple[int, ...] = (),
                decoder=None) -> int:
    """Threads of our own to split a fused step's rows over: 1 when the blocks run in
    parallel themselves (built with OpenMP, on torch's threads). Otherwise the caller runs the
    step's torch ops on one thread when this is above 1: torch's OpenMP workers spin-wait after
    each parallel op and would take the cores the row threads need (measured: 1,350 vs 2,220
    tok/s at 32 rows on 2 cores)."""
    if capture or (decoder is not None and decoder.k.parallel):
        return 1
    return max(1, min(threads, rows // MIN_ROWS_PER_THREAD))


class RowInputs:
    """token ids, positions, slots [R] and the block table [R, width] of a step's rows, one row
    per token:
    a decode row's token and its drafts (kdaserve.outputs.ScheduledSequence) each get their own
    position, sharing the request's slot and pages.

    They are views of host buffers kept from step to step, each filled by one copy: fresh
    tensors and torch ops per row cost 29 us at one row and 208 us at 32 (6 and 52 us this
    way, warm; more in the engine, whose kernels leave Python's caches cold). So the tensors
    hold until the next fill only: a caller that keeps one clones it."""

    def __init__(self) -> None:
        self._rows = torch.zeros(0, dtype=torch.long)   # positions | slots | ids, 3 x capacity
        self._table = torch.zeros(0, dtype=torch.long)      # [R, width], flat
        self._views: tuple | None = None     # ((R, width), numpy views, the tensors) of the last

    @staticmethod
    def _grown(buf: torch.Tensor, need: int) -> torch.Tensor:
        return buf if buf.numel() >= need else torch.zeros(max(need, 2 * buf.numel()),
                                                           dtype=torch.long)

    def fill(self, seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(1, max(len(s.block_ids) for s in seqs))
        # each input built whole in an int64 array, then one copy into its buffer (positions,
        # slots and ids in the buffer's order: one copy for the three): a numpy slice
        # assignment per row would cost more than the rows' own work
        ids, pos, slots, table = array("q"), array("q"), array("q"), array("q")
        pad = None                        # zeros after a row with fewer blocks than the widest
        for s in seqs:
            m = len(s.token_ids)
            ids.extend(s.token_ids)
            pos.extend(range(s.context_len, s.context_len + m))
            slots.extend((s.state_slot,) * m)
            short = width - len(s.block_ids)
            for _ in range(m):
                table.extend(s.block_ids)
                if short:
                    pad = pad or array("q", bytes(8 * width))
                    table.extend(pad[:short])
        R = len(pos)
        if self._views is None or self._views[0] != (R, width):
            self._rows = self._grown(self._rows, 3 * R)
            self._table = self._grown(self._table, R * width)
            self._views = ((R, width), self._rows.numpy(), self._table.numpy(),
                           (self._rows[2 * R:3 * R], self._rows[:R], self._rows[R:2 * R],
                            self._table[:R * width].view(R, width)))
        _, rows, flat, views = self._views
        pos.extend(slots)
        pos.extend(ids)
        rows[:3 * R] = np.frombuffer(pos, dtype=np.int64)
        flat[:R * width] = np.frombuffer(table, dtype=np.int64)
        return views

    def advance(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]:
        """The last fill's rows one position on, each with its new token (a burst's next
        forward, engine/decode_burst.py: one token a row, the pages already in the table)."""
        (R, _), rows, _, views = self._views
        rows[:R] += 1
        rows[2 * R:3 * R] = tokens
        return views


def applies(seqs, num_decode: int) -> bool:
    """Decode rows that each sample (one token, or one and its drafts to verify), few enough
    tokens in all."""
    return (0 < len(seqs) and num_decode == len(seqs)
            and sum(len(s.token_ids) for s in seqs) <= MAX_FUSED_ROWS
            and all(s.sample and len(s.token_ids) == 1 + s.num_draft_tokens for s in seqs))
