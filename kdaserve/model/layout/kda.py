"""KDA rows of a step: the conv windows, decode rows padded for verification, prefill rows
padded into KDA chunks.

Decode rows and prefill rows are padded separately, each to its own longest (one padded
layout for both made a mixed step pad 48 decode rows to a 128-token prompt chunk). Each
prefill row is left-padded by `context_len % C`, so chunk boundaries fall on absolute positions
that are multiples of C: the state at a block boundary is a chunk-end state the chunked kernel
already computes (docs/design.md). Legend: Bd decode rows, Bp prefill rows, Lc/Ld/L padded
lengths, C chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.model.layout.rows import ConvRows, PackedRows, arange


@dataclass
class KDALayout:
    # per run of sequences (decode rows, prefill rows): ([b, K-1+Lc] ConvRows of each padded
    # conv position, [t] flat rows of that run's conv output [b*Lc] or None when every
    # sequence of the run has length Lc)
    conv_groups: list[tuple[torch.Tensor, torch.Tensor | None]]
    conv_state_idx: torch.Tensor    # [B, K-1] ConvRows of the window after this step
    pad_src: torch.Tensor           # [Bp, L] rows of prefill tokens (Tp = a zero row)
    unpad_idx: torch.Tensor         # [Tp] flat rows of the padded [Bp*L] layout, packed order
    padded_len: int
    pad_is_reshape: bool = False    # equal lengths, no alignment pad: [Tp] -> [Bp, L] is a view


@dataclass
class DecodeLayout:
    """Decode rows with more than one token (verification of drafts): a padded [Bd, Ld] view."""

    pad_src: torch.Tensor           # [Bd, Ld] rows of decode tokens (Td = a zero row)
    unpad_idx: torch.Tensor         # [Td] flat rows of [Bd*Ld], packed order
    window_idx: torch.Tensor        # [Bd*Ld, K-1] ConvRows of the window after each position


def conv_layout(rows: PackedRows, conv: ConvRows, seq_lens: list[int]) -> tuple[list, torch.Tensor]:
    """The conv's padded groups (decode rows, prefill rows) and the windows after the step."""
    B, nd, device = rows.num_seqs, rows.num_decode, rows.device
    groups = []
    for r0, r1 in ((0, nd), (nd, B)):
        if r1 == r0:
            continue
        g_lens = rows.lens[r0:r1]
        lc = max(seq_lens[r0:r1])
        jc = arange(conv.km1 + lc, device) - conv.km1                      # [K-1+Lc]
        seq = arange(r1 - r0, device)[:, None] + r0
        pad_idx = torch.where(
            jc[None] < 0, conv.window(seq, conv.km1 + jc[None]),
            torch.where(jc[None] < g_lens[:, None], conv.token(rows.cu[r0:r1, None] + jc[None]),
                        torch.full((r1 - r0, conv.km1 + lc), conv.zero, dtype=torch.long,
                                   device=device)))
        t0, t1 = sum(seq_lens[:r0]), sum(seq_lens[:r1])
        unpad = None
        if any(n != lc for n in seq_lens[r0:r1]):
            unpad = (rows.seq_of[t0:t1] - r0) * lc + rows.local[t0:t1]
        groups.append((pad_idx, unpad))
    state_idx = conv.before(arange(B, device), rows.cu[:-1], rows.lens)     # [B, K-1]
    return groups, state_idx


def decode_layout(rows: PackedRows, conv: ConvRows, seq_lens: list[int]) -> DecodeLayout | None:
    """The padded view of decode rows that verify drafts (None: one token each)."""
    nd, Td, device = rows.num_decode, rows.num_decode_tokens, rows.device
    if not nd or Td == nd:
        return None
    ld = max(seq_lens[:nd])
    jd = arange(ld, device)
    valid = jd[None] < rows.lens[:nd, None]
    pad_src = torch.where(valid, rows.cu[:nd, None] + jd[None],
                          torch.full((nd, ld), Td, dtype=torch.long, device=device))
    unpad = rows.seq_of[:Td] * ld + rows.local[:Td]
    b_of = arange(nd, device).repeat_interleave(ld)                        # [Bd*Ld]
    # positions past a row's tokens read the zero row (their states are never used)
    window = conv.before(b_of, rows.cu[b_of], (jd + 1).repeat(nd)).clamp(max=conv.zero)
    return DecodeLayout(pad_src, unpad, window)


def prefill_padding(rows: PackedRows, seq_lens: list[int], context_lens: list[int],
                    chunk_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, bool]:
    """Prefill rows padded to [Bp, L], each left-padded to align its chunks to absolute
    positions: (pre [Bp] left pads, pad_src, unpad_idx, L, whether the padding is a reshape)."""
    nd, Td, device = rows.num_decode, rows.num_decode_tokens, rows.device
    p_lens, p_cu = rows.lens[nd:], rows.cu[nd:] - Td
    Bp = rows.num_seqs - nd
    Tp = rows.num_tokens - Td
    p_seq = rows.seq_of[Td:] - nd                                          # [Tp]
    pre = rows.ctx[nd:] % chunk_size                                       # align chunks to C
    padded_len = 0
    if Bp:       # from the Python lists, as every size here (no wait on the device)
        longest = max(c % chunk_size + n for c, n in zip(context_lens[nd:], seq_lens[nd:]))
        padded_len = -(-longest // chunk_size) * chunk_size
    loc = arange(padded_len, device)[None] - pre[:, None]                  # [Bp, L]
    valid = (loc >= 0) & (loc < p_lens[:, None])
    pad_src = torch.where(valid, p_cu[:-1, None] + loc, torch.full_like(loc, Tp))
    unpad_idx = p_seq * padded_len + pre[p_seq] + rows.local[Td:]
    is_reshape = bool(Bp and all(c % chunk_size == 0 and n == padded_len
                                 for c, n in zip(context_lens[nd:], seq_lens[nd:])))
    return pre, pad_src, unpad_idx, padded_len, is_reshape


def kda_layout(rows: PackedRows, conv: ConvRows, seq_lens: list[int],
               context_lens: list[int], chunk_size: int
               ) -> tuple[KDALayout, DecodeLayout | None]:
    """Every KDA index of the step."""
    groups, state_idx = conv_layout(rows, conv, seq_lens)
    _, pad_src, unpad_idx, padded_len, is_reshape = prefill_padding(rows, seq_lens,
                                                                      context_lens, chunk_size)
    return (KDALayout(groups, state_idx, pad_src, unpad_idx, padded_len, is_reshape),
            decode_layout(rows, conv, seq_lens))
