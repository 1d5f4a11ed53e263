"""MLA attention over latents: absorbed decode and expanded prefill, dense (the reference) and
blockwise (bounded memory at any context length).

Legend: B sequences, Q queries, L keys, H heads, N nope dim, R rope dim, Dc kv_lora_rank,
Vd value dim, T decode rows, NB pages, bs block size, W blocks per table.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from kdaserve.ops import cpu_kernels, gpu
from kdaserve.ops.online_softmax import (
    attention_lse,
    key_mask,
    merge_into,
    merge_partials,
    paged_tiles,
)


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
    vd = v.shape[-1]
    if vd < q.shape[-1]:
        # torch's CPU flash kernel wants one head size for q, k and v, and falls back to the
        # math path (the whole score matrix, 7x slower at 2k tokens) when v is narrower: zero
        # columns make v as wide, and their outputs (zero) are cut off
        v = F.pad(v, (0, q.shape[-1] - vd))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, is_causal=mask is None, scale=scale,
    )
    return out.transpose(1, 2)[..., :vd]


# ---- blockwise (flash-style) attention ---------------------------------------------------------
# The functions above are the reference: they build the whole [Q, L] score matrix and, for
# prefill, K/V expanded over the whole context. Those grow with the context (quadratically for
# the scores), so past the sizes below a layer attends in blocks instead (kdaserve.ops.
# online_softmax): working memory then depends on the chunk and tile sizes only.

DENSE_MAX_SCORES = 1 << 22
"""Most prefill scores (sum over sequences of queries × keys) the dense path may build."""
DENSE_MAX_DECODE_KEYS = 1 << 15
"""Most keys (sum over decode queries) the dense absorbed decode may gather."""
# expanded K and V of one context tile; small, because the tail tile's temporaries change
# size every chunk and the allocator keeps the holes: its growth stays a few tiles' worth
PREFILL_TILE_BYTES = 8 << 20
DECODE_TILE_BYTES = 32 << 20    # latents of one decode tile, when they must be gathered
DECODE_SPLIT_TOKENS = 512       # keys per split-K partial
# keys per partial of the compiled decode: a unit of work for one thread, and few partials
# to merge (32 at 128k keys); fixed, so a row's result never depends on its batch
DECODE_KERNEL_SPLIT_TOKENS = 4096


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
    whole blocks and expanded one tile at a time, never whole. Returns [B,Q,H,Vd].
    """
    qh = q.transpose(1, 2)                                                  # [B,H,Q,N+R]
    k, v = expand(lat)
    # causal over the chunk itself: right padding keeps a real query's keys real
    o, lse = attention_lse(qh, k.transpose(1, 2), v.transpose(1, 2), scale, causal=True)
    lens = ctx_lens.tolist() if ctx_lens is not None else []
    if pages is not None and lens and max(lens) > 0:
        assert ctx_blocks is not None
        per_token = k.shape[2] * (k.shape[3] + max(k.shape[3], v.shape[3])) * k.element_size()
        for t in paged_tiles(pages, ctx_blocks, lens, PREFILL_TILE_BYTES // per_token):
            k_t, v_t = expand(t.ctx.to(q.dtype))
            o_t, lse_t = attention_lse(
                qh if t.rows is None else qh[t.rows], k_t.transpose(1, 2), v_t.transpose(1, 2),
                scale, key_mask=key_mask(t.t0, t.t1, t.lens, q.device))
            merge_into(o, lse, t.rows, o_t, lse_t)
    return o.transpose(1, 2).to(q.dtype)


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


def triton_paged_decode(device: torch.device) -> bool:
    """Decode rows read the pages through `mla_decode_split_k` at any context length (the
    layout builds no dense mask): where a kernel reads the page table in place without a host
    read, gathering the context first would only cost a copy."""
    return gpu.kernels_for(device.type)


def mla_decode_split_k(
    q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
    kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Absorbed decode over paged latents without gathering the whole context: the Triton
    kernel on CUDA (`ops/gpu/mla_decode.py`: no host read, capturable in a CUDA graph), the
    compiled CPU kernel where it applies (fp32 pages on CPU), else `mla_decode_split_k_torch`.
    Same arguments and result."""
    if gpu.kernels_for(pages.device.type) and pages.dtype != torch.uint8:   # (uint8: FP8)
        from kdaserve.ops.gpu.mla_decode import mla_decode_split_k_triton

        return mla_decode_split_k_triton(q_nope, q_pe, pages, blocks, kv_lens, w_uk, w_uv, scale)
    kernel = _paged_decode_kernel() if pages.device.type == "cpu" else None
    if kernel is None or pages.dtype != torch.float32 or not pages.is_contiguous():
        return mla_decode_split_k_torch(q_nope, q_pe, pages, blocks, kv_lens, w_uk, w_uv, scale)
    t, h, _ = q_nope.shape
    dc = w_uk.shape[-1]
    q_lat = torch.einsum("thn,hnc->thc", q_nope.float(), w_uk.float())
    qa = (torch.cat([q_lat, q_pe.float()], -1) * scale).contiguous()      # [T,H,Dc+R]
    o = kernel(pages, blocks, kv_lens, qa)                                 # [T,H,Dc+R]
    return torch.einsum("thc,hvc->thv", o[..., :dc].to(q_nope.dtype), w_uv)


def decode_split_k_graph_safe(device: torch.device) -> bool:
    """Whether `mla_decode_split_k` runs on `device` without reading lengths back to the host
    (a captured CUDA graph needs that): the Triton kernel does; the torch form tiles by the
    lengths on the host."""
    return triton_paged_decode(device)


@cache
def _paged_decode_kernel() -> Callable[..., torch.Tensor] | None:
    """csrc/mla_cpu.c's fused paged decode, or None (no compiler, disabled, build failed)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn = cpu_kernels._c_function("mla_cpu.c", "mla_decode_paged",
                                 [i64, i64, i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                                  i64, ptr, ptr])
    if fn is None:
        return None

    def run(pages: torch.Tensor, blocks: torch.Tensor, kv_lens: torch.Tensor,
            qa: torch.Tensor) -> torch.Tensor:
        """pages [NB,bs,D] fp32, blocks [T,W], kv_lens [T], qa [T,H,D] scaled -> o [T,H,D]."""
        t, h, d = qa.shape
        bs = pages.shape[1]
        split = max(1, DECODE_KERNEL_SPLIT_TOKENS // bs) * bs
        assert bs <= 1024 and pages.shape[2] == d
        num_splits = max(1, -(-int(kv_lens.max()) // split))
        blocks_ = blocks.to(torch.int64).contiguous()
        lens_ = kv_lens.to(torch.int64).contiguous()
        o = torch.empty(t * num_splits, h, d)
        lse = torch.empty(t * num_splits, h)
        cpu_kernels.parallel_rows(
            "mla_cpu.c", fn, t * num_splits, int(lens_.sum()) * h,
            ctypes.c_void_p(pages.data_ptr()), bs, d,
            ctypes.c_void_p(blocks_.data_ptr()), blocks_.shape[1],
            ctypes.c_void_p(lens_.data_ptr()), ctypes.c_void_p(qa.data_ptr()), h, split,
            num_splits, ctypes.c_void_p(o.data_ptr()), ctypes.c_void_p(lse.data_ptr()))
        if num_splits == 1:
            return o
        return merge_partials(o.view(t, num_splits, h, d), lse.view(t, num_splits, h), 1)[0]

    return run


def mla_decode_split_k_torch(
    q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
    kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
) -> torch.Tensor:
    """Absorbed decode over paged latents without gathering the whole context (torch).

    q_nope [T,H,N], q_pe [T,H,R] (one query per row), pages [NB,bs,Dc+R], blocks [T,W] each row's
    block table, kv_lens [T] keys each row sees; w_uk [H,N,Dc], w_uv [H,Vd,Dc]. Keys are read a
    tile of blocks at a time; a tile is cut into splits of DECODE_SPLIT_TOKENS keys computed
    together (split-K) whose partials merge by log-sum-exp, and tiles fold into the running
    result (online softmax). In absorbed form all heads share one key per token (the latent),
    so the H heads are the queries of one attention. Returns [T,H,Vd].
    """
    t, h, _ = q_nope.shape
    dc = w_uk.shape[-1]
    bs, row = pages.shape[1:]                # (FP8 pages: a row is the latent and its scale)
    dev = q_nope.device
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    qa = torch.cat([q_lat, q_pe], -1)                                       # [T,H,Dc+R]
    d = qa.shape[-1]
    split = max(1, DECODE_SPLIT_TOKENS // bs) * bs
    o = lse = None
    for tl in paged_tiles(pages, blocks, kv_lens.tolist(),
                          DECODE_TILE_BYTES // (row * pages.element_size())):
        ctx, n = tl.ctx.to(q_nope.dtype), tl.t1 - tl.t0
        q_t = qa if tl.rows is None else qa[tl.rows]
        # whole splits in one call, the ragged tail (< split keys) in another: no padding copy
        full = n // split * split
        parts = [_split_attention(q_t, ctx[:, a:z], key_mask(tl.t0 + a, tl.t0 + z, tl.lens, dev),
                                  size, scale)
                 for a, z, size in ((0, full, split), (full, n, n - full)) if z > a]
        o_t, lse_t = parts[0] if len(parts) == 1 else merge_partials(
            torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), 0)
        if o is None and tl.rows is None:
            o, lse = o_t, lse_t
            continue
        if o is None:
            o = torch.zeros(t, h, d, device=dev)
            lse = torch.full((t, h), float("-inf"), device=dev)
        merge_into(o, lse, tl.rows, o_t, lse_t)
    assert o is not None
    return torch.einsum("thc,hvc->thv", o[..., :dc].to(q_nope.dtype), w_uv)
