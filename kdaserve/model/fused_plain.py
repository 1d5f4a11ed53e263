"""The plain fused decode step's calls, built once per set of buffers.

A plain step (kdaserve/model/fused_decode.py: one calling thread, no capture, no rollback, no
residual mixes) is one compiled call per token mixer and per feed-forward, then the head. Their
arguments name the model's weights, the cache's tensors and the step's buffers (the embedded
rows, the row inputs that fused_rows.RowInputs keeps from step to step, the scratch), so the
argument tuples are built once for a set of buffers and the step is the calls alone: building
them cost ~56 us of Python a step at one row (warm; more in the engine's loop, whose kernels
leave Python's caches cold). The rows' embeddings are a compiled call too (csrc/decode_cpu.c
embed_rows, into a kept buffer): torch's gather and the modules' attribute lookups before it
cost ~50 us a step there. The logits are new each step (a caller may keep them): the head's
call takes them last.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from kdaserve.model.fused_args import _I, _p

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
        scratch = dec.scratch_for(0, B)
        if self._cache is None or self._cache() is not cache:
            # another cache (an id could be a dead one's again): its tensors, new calls
            self._plans = {}
            self._cache = weakref.ref(cache)
        key = (B, block_table.shape[1], ids.data_ptr(), self._x.data_ptr(), positions.data_ptr(),
               slots.data_ptr(), block_table.data_ptr(), scratch.data_ptr())
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans = {}
            plan = self._plans[key] = self._build(dec, ids, positions, slots, block_table,
                                                  cache, scratch)
        embed, calls, head = plan
        if embed is None:
            emb = dec.model.model.embed_tokens.weight
            self._x[:B].copy_(torch.embedding(emb, ids))
        elif dec.k.embed(*embed):
            raise ValueError(f"token ids outside the vocabulary: {ids.tolist()}")
        for fn, args in calls:
            fn(*args)
        dec.k.head(*head, _p(logits), _p(scratch))

    def _build(self, dec: FusedDecoder, ids: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor, block_table: torch.Tensor, cache: HybridCache,
               scratch: torch.Tensor) -> tuple:
        """(the embedding call or None, the layers' calls, the head's arguments less the
        logits and scratch). The embedding gathers in C from an fp32 or bf16 table; another
        dtype goes through torch each step."""
        B = ids.shape[0]
        x, emb = self._x[:B], dec.model.model.embed_tokens.weight
        embed = None
        if emb.dtype in (torch.float32, torch.bfloat16) and emb.is_contiguous() and \
                ids.dtype == torch.int64 and ids.is_contiguous():
            embed = (_I(B), _p(ids), _p(emb), _I(emb.dtype == torch.bfloat16),
                     _I(emb.shape[0]), _I(emb.shape[1]), _p(x))
        calls: list = []
        dec.rows(0, 0, B, x, positions, slots, block_table, cache, None, record=calls)
        return embed, calls, calls.pop()[1][:-2]
