"""The plain fused decode step's calls, built once per set of buffers.

A plain step (kdaserve/model/fused_decode.py: one calling thread, no capture, no rollback, no
residual mixes) is one compiled call per token mixer and per feed-forward, then the head. Their
arguments name the model's weights, the cache's tensors and the step's buffers (the embedded
rows, the row inputs that fused_rows.RowInputs keeps from step to step, the scratch), so the
argument tuples are built once for a set of buffers and the step is the calls alone: building
them cost ~56 us of Python a step at one row (warm; more in the engine's loop, whose kernels
leave Python's caches cold). The logits are new each step (a caller may keep them): the head's
call takes them last.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from kdaserve.model.fused_args import _p

if TYPE_CHECKING:
    from kdaserve.model.fused_decode import FusedDecoder
    from kdaserve.model.hybrid_cache import HybridCache

# sets of buffers kept at once: a regrown buffer leaves its old keys naming dead memory
_MAX_PLANS = 64


class PlainCalls:
    """The rows' embedding buffer and the built calls, by (rows, block-table width, buffer
    pointers); dropped when the cache or the decoder's kernel table changes."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self._x = torch.empty(0, hidden, dtype=torch.float32)
        self._plans: dict[tuple, tuple[list, tuple]] = {}
        self._cache: weakref.ref | None = None     # the cache those calls write

    def clear(self) -> None:
        self._plans = {}

    def run(self, dec: FusedDecoder, ids: torch.Tensor, positions: torch.Tensor,
            slots: torch.Tensor, block_table: torch.Tensor, cache: HybridCache,
            logits: torch.Tensor) -> None:
        """Every layer and the head for all rows on this thread."""
        B = ids.shape[0]
        if self._x.shape[0] < B:
            self._x = torch.empty(max(B, 2 * self._x.shape[0]), self.hidden)
        x, emb = self._x[:B], dec.model.model.embed_tokens.weight
        if emb.dtype == torch.float32:
            torch.index_select(emb, 0, ids, out=x)
        else:
            x.copy_(torch.embedding(emb, ids))
        scratch = dec.scratch_for(0, B)
        if self._cache is None or self._cache() is not cache:
            # another cache (an id could be a dead one's again): its tensors, new calls
            self._plans = {}
            self._cache = weakref.ref(cache)
        key = (B, block_table.shape[1], x.data_ptr(), positions.data_ptr(), slots.data_ptr(),
               block_table.data_ptr(), scratch.data_ptr())
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans = {}
            calls: list = []
            dec.rows(0, 0, B, x, positions, slots, block_table, cache, None, record=calls)
            plan = self._plans[key] = (calls, calls.pop()[1][:-2])
        calls, head = plan
        for fn, args in calls:
            fn(*args)
        dec.k.head(*head, _p(logits), _p(scratch))
