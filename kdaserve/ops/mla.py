"""MLA attention over latents: absorbed decode and expanded prefill, dense (the reference) and
blockwise (bounded memory at any context length).

Legend: B sequences, Q queries, L keys, H heads, N nope dim, R rope dim, Dc kv_lora_rank,
Vd value dim, E / Ev query-key / value head size, T decode rows, NB pages, bs block size,
W blocks per table, S splits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def mla_decode_absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """One query per sequence against its cached latents, never expanding K/V.

    q_nope [B,H,N], q_pe [B,H,R], latents [B,L,Dc+R] (normed latent ‖ rope key), mask [B,L] bool,
    w_uk [H,N,Dc], w_uv [H,Vd,Dc] (the two halves of kv_b_proj). Returns [B,H,Vd].
    """
    return mla_absorbed(q_nope[:, None], q_pe[:, None], latents, mask[:, None], w_uk, w_uv,
                        scale)[:, 0]


def mla_absorbed(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor,
    w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Q queries per sequence: q_nope [B,Q,H,N], q_pe [B,Q,H,R], latents [B,L,Dc+R],
    mask [B,Q,L] bool (True: may attend). Returns [B,Q,H,Vd]."""
    dc = w_uk.shape[-1]
    c, k_pe = latents[..., :dc], latents[..., dc:]
    q_lat = torch.einsum("bqhn,hnc->bqhc", q_nope, w_uk)
    scores = torch.einsum("bqhc,blc->bqhl", q_lat, c)
    if k_pe.shape[-1]:
        scores = scores + torch.einsum("bqhr,blr->bqhl", q_pe, k_pe)
    scores = (scores.float() * scale).masked_fill(~mask[:, :, None, :], float("-inf"))
    probs = scores.softmax(-1).to(c.dtype)
    out_lat = torch.einsum("bqhl,blc->bqhc", probs, c)
    return torch.einsum("bqhc,hvc->bqhv", out_lat, w_uv)


def mla_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """q [B,Q,H,N+R], k [B,L,H,N+R], v [B,L,H,Vd]; mask [B,1,Q,L] bool or None (plain causal,
    Q == L). Returns [B,Q,H,Vd]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale,
    )
    return out.transpose(1, 2)


# ---- blockwise (flash-style) attention ---------------------------------------------------------
# The functions above are the reference: they build the whole [Q, L] score matrix and, for
# prefill, K/V expanded over the whole context. Those grow with the context (quadratically for
# the scores), so past the sizes below a layer attends in blocks instead: each block yields a
# partial output and its log-sum-exp, and partials merge exactly (online softmax). Working memory
# then depends on the chunk and tile sizes only, never on the context length.

DENSE_MAX_SCORES = 1 << 22
"""Most prefill scores (sum over sequences of queries × keys) the dense path may build."""
DENSE_MAX_DECODE_KEYS = 1 << 15
"""Most keys (sum over decode queries) the dense absorbed decode may gather."""
PREFILL_TILE_BYTES = 32 << 20   # expanded K and V of one context tile
DECODE_TILE_BYTES = 32 << 20    # latents gathered for one decode tile
DECODE_SPLIT_TOKENS = 512       # keys per split-K partial

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
        p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
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


def _merge_into(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None, o_t: torch.Tensor,
                lse_t: torch.Tensor) -> None:
    """Online softmax step: fold a block's partial into the running (o, lse) of `rows`."""
    if rows is None:
        mo, ml = merge_partials(torch.stack([o, o_t]), torch.stack([lse, lse_t]), 0)
        o.copy_(mo)
        lse.copy_(ml)
    else:
        mo, ml = merge_partials(torch.stack([o[rows], o_t]), torch.stack([lse[rows], lse_t]), 0)
        o[rows], lse[rows] = mo, ml


def gather_blocks(pages: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Latents of whole blocks: pages [NB,bs,D], blocks [B,n] -> [B, n*bs, D]. A single run of
    consecutive blocks (what a fresh pool hands out) is a view, not a copy."""
    b, n = blocks.shape
    bs, d = pages.shape[1:]
    if b == 1 and blocks.device.type == "cpu":
        first = int(blocks[0, 0])
        if int(blocks[0, -1]) - first == n - 1 and (n == 1 or bool((blocks.diff() == 1).all())):
            return pages[first:first + n].view(1, n * bs, d)
    return pages.index_select(0, blocks.reshape(-1)).view(b, n * bs, d)


def _active(lens: list[int], t0: int, device: torch.device) -> torch.Tensor | None:
    """Rows with keys at or past t0 (None: all of them)."""
    rows = [i for i, n in enumerate(lens) if n > t0]
    return None if len(rows) == len(lens) else torch.tensor(rows, device=device)


def mla_prefill_blockwise(
    q: torch.Tensor, lat: torch.Tensor,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], scale: float, *,
    pages: torch.Tensor | None = None, ctx_blocks: torch.Tensor | None = None,
    ctx_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill chunks attending to their cached context and causally to themselves, in blocks.

    q [B,Q,H,N+R] and lat [B,Q,Dc+R]: each sequence's chunk, right-padded to Q (padded rows come
    out as garbage); `expand` turns latents [b,L,Dc+R] into keys [b,L,H,N+R] and values
    [b,L,H,Vd] (kv_b_proj). pages [NB,bs,Dc+R], ctx_blocks [B,W] and ctx_lens [B]: the context
    before each chunk (absent: chunks start their sequences). The context is read in tiles of
    whole blocks, expanded one tile at a time. Returns [B,Q,H,Vd].
    """
    qh = q.transpose(1, 2)                                                  # [B,H,Q,N+R]
    k, v = expand(lat)
    # causal over the chunk itself: right padding keeps a real query's keys real
    o, lse = attention_lse(qh, k.transpose(1, 2), v.transpose(1, 2), scale, causal=True)
    lens = ctx_lens.tolist() if ctx_lens is not None else []
    if pages is not None and lens and max(lens) > 0:
        assert ctx_blocks is not None
        bs = pages.shape[1]
        per_token = k.shape[2] * (k.shape[3] + max(k.shape[3], v.shape[3])) * k.element_size()
        tile = max(1, PREFILL_TILE_BYTES // (per_token * bs)) * bs
        for t0 in range(0, max(lens), tile):
            rows = _active(lens, t0, q.device)
            live = lens if rows is None else [lens[i] for i in rows.tolist()]
            t1 = min(t0 + tile, -(-max(live) // bs) * bs)
            blocks = ctx_blocks[:, t0 // bs: t1 // bs]
            ctx = gather_blocks(pages, blocks if rows is None else blocks[rows]).to(q.dtype)
            mask = None
            if min(live) < t1:
                keys = torch.arange(t0, t1, device=q.device)
                mask = keys[None] < torch.tensor(live, device=q.device)[:, None]   # [b,Lt]
            k_t, v_t = expand(ctx)
            o_t, lse_t = attention_lse(qh if rows is None else qh[rows], k_t.transpose(1, 2),
                                       v_t.transpose(1, 2), scale, key_mask=mask)
            _merge_into(o, lse, rows, o_t, lse_t)
    return o.transpose(1, 2).to(q.dtype)


def _key_mask(t0: int, t1: int, live: list[int], device: torch.device) -> torch.Tensor | None:
    """[b, t1-t0] bool: keys t0..t1-1 that each live row has (None: all of them)."""
    if min(live) >= t1:
        return None
    keys = torch.arange(t0, t1, device=device)
    return keys[None] < torch.tensor(live, device=device)[:, None]


def _split_attention(qa: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                     split: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed attention of qa [b,H,D] over ctx [b,s*split,D] cut into s splits computed in
    one call (the splits are the batch), merged by log-sum-exp: o [b,H,D], lse [b,H]."""
    b, h, d = qa.shape
    s = ctx.shape[1] // split
    ks = ctx.reshape(b * s, 1, split, d)
    qs = qa[:, None].expand(b, s, h, d).reshape(b * s, 1, h, d)
    o, lse = attention_lse(qs, ks, ks, scale,
                           key_mask=None if mask is None else mask.reshape(b * s, split))
    if s == 1:
        return o.view(b, h, d), lse.view(b, h)
    return merge_partials(o.view(b, s, h, d), lse.view(b, s, h), 1)


def mla_decode_split_k(
    q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
    kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Absorbed decode over paged latents without gathering the whole context.

    q_nope [T,H,N], q_pe [T,H,R] (one query per row), pages [NB,bs,Dc+R], blocks [T,W] each row's
    block table, kv_lens [T] keys each row sees; w_uk [H,N,Dc], w_uv [H,Vd,Dc]. Keys are read a
    tile of blocks at a time; a tile is cut into splits of DECODE_SPLIT_TOKENS keys computed
    together (split-K) whose partials merge by log-sum-exp, and tiles fold into the running
    result (online softmax). In absorbed form all heads share one key per token (the latent),
    so the H heads are the queries of one attention. Returns [T,H,Vd].
    """
    t, h, _ = q_nope.shape
    dc = w_uk.shape[-1]
    bs, d = pages.shape[1:]
    dev = q_nope.device
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    qa = torch.cat([q_lat, q_pe], -1)                                       # [T,H,Dc+R]
    split = max(1, DECODE_SPLIT_TOKENS // bs) * bs
    tile = max(1, DECODE_TILE_BYTES // (d * pages.element_size() * split)) * split
    lens = kv_lens.tolist()
    o = lse = None
    for t0 in range(0, max(lens), tile):
        rows = _active(lens, t0, dev)
        live = lens if rows is None else [lens[i] for i in rows.tolist()]
        t1 = min(t0 + tile, -(-max(live) // bs) * bs)
        sel = blocks[:, t0 // bs: t1 // bs]
        ctx = gather_blocks(pages, sel if rows is None else sel[rows]).to(q_nope.dtype)
        q_t = qa if rows is None else qa[rows]
        # whole splits in one call, the ragged tail (< split keys) in another: no padding copy
        full = (t1 - t0) // split * split
        parts = []
        for a, z, size in ((0, full, split), (full, t1 - t0, t1 - t0 - full)):
            if z > a:
                mask = _key_mask(t0 + a, t0 + z, live, dev)
                parts.append(_split_attention(q_t, ctx[:, a:z], mask, size, scale))
        o_t, lse_t = parts[0] if len(parts) == 1 else merge_partials(
            torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), 0)
        if o is None and rows is None:
            o, lse = o_t, lse_t
            continue
        if o is None:
            o = torch.zeros(t, h, d, device=dev)
            lse = torch.full((t, h), float("-inf"), device=dev)
        _merge_into(o, lse, rows, o_t, lse_t)
    assert o is not None
    return torch.einsum("thc,hvc->thv", o[..., :dc].to(q_nope.dtype), w_uv)
