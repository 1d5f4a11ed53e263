"""MLA rows of a step: where new latents are written in the pages, which pages each query
reads, and the masks (or the lengths, past the dense limits of kdaserve.ops.mla).

Decode rows run one absorbed query per token over pages gathered through the block table;
prefill rows gather their context pages and attend with a causal-with-offset mask, or plainly
causal (no mask) when they are fresh prompts of one length. Legend: Td decode tokens, Bp
prefill rows, Qp the longest prefill chunk, W blocks in a context window.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kdaserve.model.layout.rows import PackedRows, arange
from kdaserve.ops import mla as mla_ops


@dataclass
class MLALayout:
    """Past the dense size limits of kdaserve.ops.mla the dense masks are not built (they grow
    with the context) and layers attend in blocks from the lengths instead."""

    slot_mapping: torch.Tensor | None      # [T] flat cache row for each new token
    decode_ctx_blocks: torch.Tensor | None  # [Td, Wd] cache blocks (one query per token)
    decode_ctx_mask: torch.Tensor | None    # [Td, Wd*block_size] bool (None: blockwise)
    prefill_q_idx: torch.Tensor            # [Bp, Qp] rows of prefill tokens (Tp = zero row)
    prefill_unpad_idx: torch.Tensor        # [Tp] flat rows of [Bp*Qp]
    prefill_ctx_blocks: torch.Tensor | None  # [Bp, Wp] cache blocks (None: no cache)
    prefill_mask: torch.Tensor | None      # [Bp, 1, Qp, Lp] bool (Lp = Wp*block_size with a
                                           # cache), None when plainly causal or blockwise
    decode_kv_lens: torch.Tensor | None = None    # [Td] keys each decode query sees
    prefill_ctx_lens: torch.Tensor | None = None  # [Bp] cached tokens before each chunk
    decode_blockwise: bool = False         # split-K over the page table (no decode_ctx_mask)
    prefill_blockwise: bool = False        # context tiles + online softmax (no prefill_mask)
    # fresh prompts of one length: the keys are the first Qp cache rows and the mask is plain
    # causal, so none is built and the attention skips the future (half the work of a mask)
    prefill_causal: bool = False


def block_table(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, width] block ids, rows right-padded with block 0. Built through array('q') because
    it is rebuilt every step and a 1M-token request holds 65536 blocks: torch.tensor over
    Python ints costs ~10x more (milliseconds per step, a real share of a decode step)."""
    width = max(1, max((len(t) for t in block_tables), default=1))
    flat = array("q")
    zero = array("q", [0])
    for t in block_tables:
        flat.extend(t)
        flat.extend(zero * (width - len(t)))
    return torch.frombuffer(flat, dtype=torch.long).view(len(block_tables), width).to(device)


def _pad_fill(q_valid: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A padded query row attends to key 0 alone (an all-False row would make NaNs)."""
    return mask & q_valid[:, :, None] | (~q_valid[:, :, None] & (keys == 0)[None, None])


def mla_layout(rows: PackedRows, seq_lens: list[int], context_lens: list[int],
               block_size: int | None, block_tables: list[list[int]] | torch.Tensor | None,
               decode_width: int | None = None) -> MLALayout:
    """The step's MLA indices; `block_size` None: no cache (training, reference forwards).
    `block_tables`: per sequence, or already a [B, width] tensor (a decode step's persistent
    inputs). Every size comes from the Python lists, so nothing waits on the device.
    `decode_width`: blocks each decode query may read, whatever the lengths (a captured
    graph serves every step of its batch size: `refresh_decode` rewrites the rest)."""
    nd, Td, device = rows.num_decode, rows.num_decode_tokens, rows.device
    Bp = rows.num_seqs - nd
    Tp = rows.num_tokens - Td
    p_lens, p_cu = rows.lens[nd:], rows.cu[nd:] - Td
    q_len = max(seq_lens[nd:]) if Bp else 0
    qi = arange(q_len, device)
    q_valid = qi[None] < p_lens[:, None]                                  # [Bp, Qp]
    lay = MLALayout(None, None, None,
                    torch.where(q_valid, p_cu[:-1, None] + qi[None],
                                torch.full((Bp, q_len), Tp, dtype=torch.long, device=device)),
                    (rows.seq_of[Td:] - nd) * q_len + rows.local[Td:], None, None)
    if block_size is None:
        if Bp and Bp * q_len * q_len > mla_ops.DENSE_MAX_SCORES:
            lay.prefill_blockwise = True
        elif Bp and any(n != seq_lens[nd] for n in seq_lens[nd:]):
            causal = qi[None, None, :] <= qi[None, :, None]                  # [1, Qp, Qp]
            lay.prefill_mask = _pad_fill(q_valid, causal & q_valid[:, None, :], qi)[:, None]
        return lay
    if block_tables is None:
        raise ValueError("block_tables are required with a cache")
    bs = block_size
    bt = (block_tables if isinstance(block_tables, torch.Tensor)
          else block_table(block_tables, device))                         # [B, width]
    pos = rows.positions
    blk = (pos // bs).clamp(max=bt.shape[1] - 1)
    lay.slot_mapping = bt[rows.seq_of, blk] * bs + pos % bs
    # context is read whole blocks at a time: a gather of block_size rows per index
    if nd:
        lay.decode_kv_lens = pos[:Td] + 1
        wd = decode_width or -(-max(c + n for c, n in zip(context_lens[:nd], seq_lens[:nd]))
                               // bs)
        # index_select: advanced indexing with a trailing slice takes a slow path that
        # costs milliseconds at 1M-token page tables
        lay.decode_ctx_blocks = bt[:, :wd].index_select(0, rows.seq_of[:Td])
        lay.decode_blockwise = (Td * wd * bs > mla_ops.DENSE_MAX_DECODE_KEYS
                                or mla_ops.triton_paged_decode(device))
        if not lay.decode_blockwise:
            lay.decode_ctx_mask = arange(wd * bs, device)[None] < lay.decode_kv_lens[:, None]
    if Bp:
        p_ctx = rows.ctx[nd:]
        wp = -(-max(c + n for c, n in zip(context_lens[nd:], seq_lens[nd:])) // bs)
        lay.prefill_ctx_blocks = bt[nd:, :wp]
        lay.prefill_ctx_lens = p_ctx
        lay.prefill_blockwise = Bp * q_len * wp * bs > mla_ops.DENSE_MAX_SCORES
        lay.prefill_causal = (not lay.prefill_blockwise
                              and all(c == 0 for c in context_lens[nd:])
                              and len(set(seq_lens[nd:])) == 1)
        if not (lay.prefill_blockwise or lay.prefill_causal):
            jk = arange(wp * bs, device)
            qpos = p_ctx[:, None] + qi[None]                              # [Bp, Qp]
            lay.prefill_mask = _pad_fill(q_valid, jk[None, None, :] <= qpos[:, :, None],
                                         jk)[:, None]
    return lay


def refresh_decode(lay: MLALayout, positions: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int) -> None:
    """Rewrite in place what a decode-only layout (one token a row, `decode_width` set)
    derives from its persistent inputs: a captured graph runs this before its forward, so the
    replay sees this step's positions and tables. The same values as `mla_layout`."""
    bs, bt = block_size, block_tables
    blk = (positions // bs).clamp(max=bt.shape[1] - 1)
    torch.add(bt.gather(1, blk[:, None])[:, 0] * bs, positions % bs, out=lay.slot_mapping)
    torch.add(positions, 1, out=lay.decode_kv_lens)
    lay.decode_ctx_blocks.copy_(bt[:, :lay.decode_ctx_blocks.shape[1]])
    if lay.decode_ctx_mask is not None:
        keys = arange(lay.decode_ctx_mask.shape[1], positions.device)
        torch.lt(keys[None], lay.decode_kv_lens[:, None], out=lay.decode_ctx_mask)
