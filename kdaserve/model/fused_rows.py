"""Which decode steps take the fused CPU path and how their rows are laid out: one row per
token (a token and its drafts each a row of the request's slot), the states kept after each
row for the rollback of rejected drafts, and the threads a step's rows are split over when
the compiled blocks do not run in parallel themselves (kdaserve/model/fused_decode.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kdaserve.model.hybrid_cache import HybridCache

# the blocks read each weight once per step for all rows (decode_blocks.h, matmat); up to this
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


def step_inputs(seqs) -> tuple[torch.Tensor, ...]:
    """positions, slots [R] and the block table [R, width] of the step's rows, one row per
    token: a decode row's token and its drafts (kdaserve.outputs.ScheduledSequence) each get
    their own position, sharing the request's slot and pages."""
    width = max(len(s.block_ids) for s in seqs)
    n = [len(s.token_ids) for s in seqs]
    table = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        if not s.block_ids:
            continue
        # through an int64 array: a quarter of torch.tensor(list)'s time (0.09 vs 0.33 ms for
        # the 8,192 blocks of a 128k context, every step)
        table[b, :len(s.block_ids)] = torch.frombuffer(array("q", s.block_ids),
                                                        dtype=torch.long)
    rep = torch.tensor(n, dtype=torch.long)
    positions = torch.tensor([s.context_len + j for s, m in zip(seqs, n) for j in range(m)],
                             dtype=torch.long)
    slots = torch.tensor([s.state_slot for s in seqs], dtype=torch.long)
    if all(m == 1 for m in n):
        return positions, slots, table
    return (positions, slots.repeat_interleave(rep),
            table.repeat_interleave(rep, dim=0).contiguous())


def applies(seqs, num_decode: int) -> bool:
    """Decode rows that each sample (one token, or one and its drafts to verify), few enough
    tokens in all."""
    return (0 < len(seqs) and num_decode == len(seqs)
            and sum(len(s.token_ids) for s in seqs) <= MAX_FUSED_ROWS
            and all(s.sample and len(s.token_ids) == 1 + s.num_draft_tokens for s in seqs))
