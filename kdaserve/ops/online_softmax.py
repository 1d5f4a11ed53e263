"""Attention in blocks: partial results over disjoint key sets, each an output and the
log-sum-exp of its scores, merge exactly (the online softmax of flash attention). With keys read
from a page table a tile at a time, working memory depends on the tile size, not the context.

Legend: B sequences, H heads, Q queries, L keys, E query-key head size, Ev value head size,
NB pages, bs block size, W blocks per table, D latent width.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import pairwise

import torch
import torch.nn.functional as F

from kdaserve.ops import fp8_latents

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool = False,
    key_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale)·v with the log-sum-exp of each query's scores: the pair partial
    results merge by. q [B,H,Q,E], k [B,H,L,E], v [B,H,L,Ev]; causal: query i sees keys j <= i;
    key_mask [B,L] bool (True: visible). Returns o [B,H,Q,Ev] fp32, lse [B,H,Q] fp32; a query
    that sees no key gets o = 0, lse = -inf."""
    ev = v.shape[-1]
    if _FLASH_CPU is not None and q.device.type == "cpu":
        e = q.shape[-1]
        # the fused CPU kernel wants one head size for q, k and v: zero columns change nothing
        if ev < e:
            v = F.pad(v, (0, e - ev))
        elif e < ev:
            q, k = F.pad(q, (0, ev - e)), F.pad(k, (0, ev - e))
        mask = None
        if key_mask is not None:
            mask = torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~key_mask, float("-inf"))[:, None, None, :]
        o, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        o = o[..., :ev].float()
    else:
        s = torch.einsum("bhqe,bhle->bhql", q, k).float() * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
                              .triu(1), float("-inf"))
        if key_mask is not None:
            s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        lse = s.logsumexp(-1)
        p = torch.exp(s - _finite(lse)[..., None])
        o = torch.einsum("bhql,bhlv->bhqv", p, v.float())
    if key_mask is not None:
        # the fused kernel reports lse 0 for a query that sees nothing
        lse = lse.masked_fill(~key_mask.any(-1)[:, None, None], float("-inf"))
    return o, lse


def _finite(m: torch.Tensor) -> torch.Tensor:
    return m.masked_fill(m == float("-inf"), 0.0)


def merge_partials(o: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """Combine partial attentions over disjoint key sets along `dim` of lse [...] (o has one
    more trailing dim). Exact up to rounding: softmax over the union of the key sets."""
    m = _finite(lse.amax(dim, keepdim=True))
    w = torch.exp(lse - m)
    den = w.sum(dim)
    out = (o * w.unsqueeze(-1)).sum(dim) / den.clamp_min(1e-30).unsqueeze(-1)
    return out, m.squeeze(dim) + den.log()


def merge_into(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None,
               o_t: torch.Tensor, lse_t: torch.Tensor) -> None:
    """Online softmax step: fold a block's partial into the running (o, lse) of `rows` (None:
    every row), in place."""
    o_r, lse_r = (o, lse) if rows is None else (o[rows], lse[rows])
    mo, ml = merge_partials(torch.stack([o_r, o_t]), torch.stack([lse_r, lse_t]), 0)
    if rows is None:
        o.copy_(mo)
        lse.copy_(ml)
    else:
        o[rows], lse[rows] = mo, ml


def gather_blocks(pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Latents of whole blocks: pages [NB,bs,D], blocks [B,n] -> [B, n*bs, D]."""
    b, n = blocks.shape
    return pages.index_select(0, blocks.reshape(-1)).view(b, n * pages.shape[1], -1)


@dataclass
class Tile:
    t0: int                        # key positions t0 .. t1-1 of each row
    t1: int
    rows: torch.Tensor | None      # [b] the rows with keys here (None: every row)
    lens: list[int]                # keys of each of those rows
    ctx: torch.Tensor              # [b, t1-t0, D]


def paged_tiles(pages: torch.Tensor, blocks: torch.Tensor, lens: list[int],
                tile: int) -> Iterator[Tile]:
    """Row i's first lens[i] keys (block table blocks[i]) in tiles of whole blocks, at most
    `tile` keys in all (over the rows a tile reads). A lone row whose blocks come in long
    consecutive runs (what a fresh pool hands
    out) is read in place, run by run: no copy of the context."""
    if fp8_latents.is_packed(pages):       # FP8 latents: each tile read out in fp32
        for t in _tiles(pages, blocks, lens, tile):
            yield replace(t, ctx=fp8_latents.read(t.ctx))
    else:
        yield from _tiles(pages, blocks, lens, tile)


def _tiles(pages: torch.Tensor, blocks: torch.Tensor, lens: list[int],
           tile: int) -> Iterator[Tile]:
    bs, d = pages.shape[1:]
    tile_blocks = max(1, tile // bs)
    if len(lens) == 1 and blocks.device.type == "cpu" and lens[0] > 0:
        n = -(-lens[0] // bs)
        ids = blocks[0, :n]
        cuts = [0, *((ids.diff() != 1).nonzero()[:, 0] + 1).tolist(), n]
        if len(cuts) - 1 <= max(8, n // 32):
            for a, z in pairwise(cuts):
                first = int(ids[a]) - a
                for p in range(a, z, tile_blocks):
                    e = min(z, p + tile_blocks)
                    yield Tile(p * bs, e * bs, None, lens,
                               pages[first + p: first + e].view(1, (e - p) * bs, d))
            return
    t0 = 0
    while t0 < max(lens):
        live = [i for i, n in enumerate(lens) if n > t0]
        rows = None if len(live) == len(lens) else torch.tensor(live, device=blocks.device)
        live_lens = [lens[i] for i in live]
        # `tile` keys over all rows: a batch's gather stays as small as one row's
        t1 = min(t0 + max(1, tile_blocks // len(live)) * bs, -(-max(live_lens) // bs) * bs)
        sel = blocks[:, t0 // bs: t1 // bs]
        yield Tile(t0, t1, rows, live_lens, gather_blocks(pages, sel if rows is None
                                                          else sel.index_select(0, rows)))
        t0 = t1


def key_mask(t0: int, t1: int, lens: list[int], device: torch.device) -> torch.Tensor | None:
    """[b, t1-t0] bool: which of keys t0 .. t1-1 each row has (None: all of them)."""
    if min(lens) >= t1:
        return None
    keys = torch.arange(t0, t1, device=device)
    return keys[None] < torch.tensor(lens, device=device)[:, None]
