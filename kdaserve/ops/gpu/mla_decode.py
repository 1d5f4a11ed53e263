"""Paged, absorbed MLA decode with split-K in Triton: the fast form of
`kdaserve.ops.mla.mla_decode_split_k` (same arguments, same result).

In absorbed form every head of a row scores the same key per token (the latent ‖ rope key), so
one program serves a group of BH heads: the keys are read once for all of them, and the two
score products and the value product are matrix products (tensor cores on a GPU).
- Stage 1, one program per (row, split, head group): the split's keys, read page by page
  through the row's block table in tiles of BN tokens, with an online softmax; it writes the
  split's normalised partial output [BH, Dc] and its log-sum-exp [BH].
- Stage 2, one program per (row, head): merges the row's live splits by log-sum-exp.
The absorption of q through W_uk and the output through W_uv are batched matmuls around them.

Split count from shapes: the launch grid may not depend on kv_lens (reading them on the host
would wait on the device and break graph capture), so the number of splits comes from the
block-table width: NS = ceil(W·bs / split). Splits past a row's length read nothing and write
nothing (their stores are masked off); stage 2 reads only the ceil(len / split) splits a row
has, computed in the kernel. A row with no keys (a padding row) gives zeros.
The split is a fixed number of keys while W·bs <= SPLIT_TOKENS·MAX_SPLITS, so a row's
result does not depend on how long the other rows of its batch are; past that the split grows
so the partials stay at most MAX_SPLITS per row.

Legend: T decode rows, H heads, N nope dim, R rope dim, Dc kv_lora_rank, Vd value dim,
NB pages, bs block size, W blocks per table, NS splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdaserve.ops.gpu import interpreting

SPLIT_TOKENS = 256     # keys per split: enough splits to fill the GPU at batch 1 from ~8k keys
MAX_SPLITS = 64        # partials per row: bounds the [T, NS, H, Dc] fp32 scratch
_BLOCK_N = 16          # tokens per tile of keys
_BLOCK_H = 16          # heads per program (the smallest M of a tensor-core product)


@triton.jit
def _split_kernel(
    q_c, q_r, pages, blocks, kv_lens, o_part, lse_part,
    s_qct, s_qch, s_qrt, s_qrh,       # q_c [T,H,Dc], q_r [T,H,R] (last stride 1)
    s_pn, s_pt,                       # pages [NB,bs,Dc+R] (last stride 1)
    s_bt,                             # blocks [T,W] (last stride 1)
    H, DC, R, bs, split, NS, scale,
    BH: tl.constexpr, BDC: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
    HAS_R: tl.constexpr, EXACT: tl.constexpr,
):
    t = tl.program_id(0)
    sp = tl.program_id(1)
    hg = tl.program_id(2)
    n_keys = tl.load(kv_lens + t).to(tl.int32)
    k0 = sp * split
    k1 = tl.minimum(k0 + split, n_keys)

    oh = hg * BH + tl.arange(0, BH)
    oc = tl.arange(0, BDC)
    orr = tl.arange(0, BR)
    mh, mc, mr = oh < H, oc < DC, orr < R
    qc = tl.load(q_c + t * s_qct + oh[:, None] * s_qch + oc[None, :],
                 mask=mh[:, None] & mc[None, :], other=0.0)                       # [BH, BDC]
    qr = tl.load(q_r + t * s_qrt + oh[:, None] * s_qrh + orr[None, :],
                 mask=mh[:, None] & mr[None, :], other=0.0)                       # [BH, BR]
    if EXACT:
        qc, qr = qc.to(tl.float32), qr.to(tl.float32)

    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BDC], dtype=tl.float32)
    for start in range(k0, k1, BN):
        on = start + tl.arange(0, BN)
        mn = on < k1
        blk = tl.load(blocks + t * s_bt + on // bs, mask=mn, other=0).to(tl.int64)
        row = pages + blk * s_pn + (on % bs) * s_pt                               # [BN] ptrs
        kc = tl.load(row[:, None] + oc[None, :], mask=mn[:, None] & mc[None, :], other=0.0)
        if EXACT:
            kc = kc.to(tl.float32)
            s = tl.dot(qc, tl.trans(kc), input_precision="ieee")                 # [BH, BN]
        else:
            s = tl.dot(qc, tl.trans(kc))
        if HAS_R:
            kr = tl.load(row[:, None] + DC + orr[None, :], mask=mn[:, None] & mr[None, :],
                         other=0.0)
            if EXACT:
                s += tl.dot(qr, tl.trans(kr.to(tl.float32)), input_precision="ieee")
            else:
                s += tl.dot(qr, tl.trans(kr))
        s = tl.where(mn[None, :], s * scale, float("-inf"))
        # every tile holds at least one key of the split: m_new is finite, alpha 0 at first
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if EXACT:
            pv = tl.dot(p, kc, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kc.dtype), kc)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # a split past the row's length stores nothing (stage 2 never reads it)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    base = (t * NS + sp) * H
    m_out = mh[:, None] & mc[None, :] & (tl.zeros([BH, BDC], dtype=tl.int32) + k0 < n_keys)
    tl.store(o_part + (base + oh[:, None]) * DC + oc[None, :], acc / l_safe[:, None],
             mask=m_out)
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    tl.store(lse_part + base + oh, lse, mask=mh & (tl.zeros([BH], dtype=tl.int32) + k0 < n_keys))


@triton.jit
def _merge_kernel(o_part, lse_part, kv_lens, out, H, DC, split, NS, BDC: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    n_keys = tl.load(kv_lens + t).to(tl.int32)
    n_live = (n_keys + split - 1) // split          # the splits this row has keys in
    oc = tl.arange(0, BDC)
    mc = oc < DC
    m = tl.full([BDC], float("-inf"), dtype=tl.float32)   # a vector: every lane the same
    den = tl.zeros([BDC], dtype=tl.float32)
    acc = tl.zeros([BDC], dtype=tl.float32)
    for sp in range(n_live):
        idx = (t * NS + sp) * H + h
        lse = tl.load(lse_part + idx)
        o_s = tl.load(o_part + idx * DC + oc, mask=mc, other=0.0)
        m_new = tl.maximum(m, lse)
        a = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * a + o_s * w
        den = den * a + w
        m = m_new
    res = tl.where(den > 0, acc / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out + (t * H + h) * DC + oc, res, mask=mc)


def split_size(max_keys: int, split_tokens: int = SPLIT_TOKENS,
               max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(keys per split, number of splits) for a block table of max_keys = W·bs keys: shapes
    only, never the lengths."""
    split = max(split_tokens, -(-max_keys // max_splits))
    split = -(-split // _BLOCK_N) * _BLOCK_N
    return split, max(1, -(-max_keys // split))


def split_meta(DC: int, R: int, exact: bool) -> dict[str, int | bool]:
    """Stage 1's compile-time parameters (tests compile them for sm_90). At Dc = 512,
    R = 64 it compiles without spills: bf16 at 8 warps 143 registers and 43 KB of shared
    memory, fp32 (exact) 218 registers and 75 KB."""
    bdc = max(16, triton.next_power_of_2(DC))
    return dict(BH=_BLOCK_H, BDC=bdc, BR=max(16, triton.next_power_of_2(max(R, 1))),
                BN=_BLOCK_N, HAS_R=R > 0, EXACT=exact, num_warps=8 if bdc >= 256 else 4,
                num_stages=2)


def merge_meta(DC: int) -> dict[str, int]:
    return dict(BDC=max(16, triton.next_power_of_2(DC)), num_warps=4)


def mla_paged_attention_triton(
    q_lat: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
    kv_lens: torch.Tensor, scale: float, split_tokens: int = SPLIT_TOKENS,
) -> torch.Tensor:
    """Attention of the absorbed queries q_lat [T,H,Dc] ‖ q_pe [T,H,R] over row t's first
    kv_lens[t] tokens of pages [NB,bs,Dc+R] (block table blocks [T,W]); the values are the
    latents. Returns the latent output [T,H,Dc] fp32 (zeros for a row with no keys)."""
    T, H, DC = q_lat.shape
    R = q_pe.shape[-1]
    bs = pages.shape[1]
    exact = pages.dtype == torch.float32 or interpreting()
    # the interpreter cannot multiply bf16 blocks (tl.dot): there every product runs in fp32
    qdt = torch.float32 if exact else pages.dtype
    q_lat, q_pe = q_lat.to(qdt), q_pe.to(qdt)
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 or R == 0 else q_pe.contiguous()
    blocks = blocks if blocks.stride(-1) == 1 else blocks.contiguous()
    if pages.stride(-1) != 1:
        raise ValueError("mla decode kernel: pages need a unit stride in their last dim")
    split, ns = split_size(blocks.shape[1] * bs, split_tokens)
    out = torch.empty(T, H, DC, dtype=torch.float32, device=q_lat.device)
    if T == 0:
        return out
    o_part = torch.empty(T, ns, H, DC, dtype=torch.float32, device=q_lat.device)
    lse_part = torch.empty(T, ns, H, dtype=torch.float32, device=q_lat.device)
    q_r = q_pe if R else q_lat          # never read without a rope part
    meta = split_meta(DC, R, exact)
    _split_kernel[(T, ns, triton.cdiv(H, _BLOCK_H))](
        q_lat, q_r, pages, blocks, kv_lens, o_part, lse_part,
        q_lat.stride(0), q_lat.stride(1), q_r.stride(0), q_r.stride(1),
        pages.stride(0), pages.stride(1), blocks.stride(0),
        H, DC, R, bs, split, ns, float(scale), **meta,
    )
    _merge_kernel[(T, H)](o_part, lse_part, kv_lens, out, H, DC, split, ns, **merge_meta(DC))
    return out


def mla_decode_split_k_triton(
    q_nope: torch.Tensor, q_pe: torch.Tensor, pages: torch.Tensor, blocks: torch.Tensor,
    kv_lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
    split_tokens: int = SPLIT_TOKENS,
) -> torch.Tensor:
    """`mla_decode_split_k`'s contract: q_nope [T,H,N], q_pe [T,H,R], pages [NB,bs,Dc+R],
    blocks [T,W], kv_lens [T], w_uk [H,N,Dc], w_uv [H,Vd,Dc] -> [T,H,Vd] in q_nope's dtype."""
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    o = mla_paged_attention_triton(q_lat, q_pe, pages, blocks, kv_lens, scale, split_tokens)
    return torch.einsum("thc,hvc->thv", o.to(q_nope.dtype), w_uv)
