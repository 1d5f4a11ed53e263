"""The routed experts of a MoE layer as two grouped Triton GEMMs over slots sorted by expert.

The fast form of SparseMoE's routed sum (the oracle: moe_backends.reference): for every token
t, sum_k weights[t,k] · expert_{ids[t,k]}(x[t]). One (token, expert) pair is a slot; slots are
sorted by expert on the device (kdaserve/ops/gpu/moe_tiles.py) and cut into tiles of BLOCK_M
slots of one expert each. Kernel 1 runs each tile through its expert's w1|w3 with the GLU
activation fused (h = act(x w1ᵀ, x w3ᵀ), [N, I] in sorted order); kernel 2 runs h through w2,
scales each slot by its routing weight and writes it at the slot's own row (unsorted, [N, W]
in x's dtype); the combine is a sum over the k slots of each token, in a fixed order: deterministic,
no atomics. Nothing reads a count back to the host and the grid is sized from shapes alone
(tiles past the last expert's exit at once), so a decode step stays capturable in a CUDA graph.

Two weight forms, chosen by the arguments: plain stacks (w13 [E, 2I, W], w2 [E, W, I], any
strides, bf16/fp16/fp32) and MXFP4 (uint8 packed [E, R, C/2] + E8M0 scales [E, R, C/32],
kdaserve/ops/mxfp4.py), decoded to the activation dtype inside the kernels, tile by tile.

Legend: T tokens, k experts per token, N = T*k slots, E experts, I expert width, W input width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kdaserve.ops.activation import GLUActivation
from kdaserve.ops.gpu import interpreting
from kdaserve.ops.gpu.moe_tiles import slot_tiles


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert: [E, R, C] plain, or MXFP4 packed [E, R, C/2] uint8 with
    scales [E, R, C/32] uint8 (then `scale` is set)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.weight.shape[1]

    def pointers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight, self.weight if self.scale is None else self.scale

    def strides(self) -> tuple[int, ...]:
        """Weight strides, then scale strides (0 when plain)."""
        ss = (0, 0, 0) if self.scale is None else self.scale.stride()
        return (*self.weight.stride(), *ss)


@triton.jit
def _e2m1_e8m0(byte, col, scale):
    """MXFP4 to fp32: the nibble of `byte` holding column `col` (the even column in the low
    nibble) times 2^(scale - 127)."""
    code = (byte.to(tl.int32) >> ((col % 2) * 4)) & 15
    m = code & 7
    # E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}: 2^(m/2 - 1) · (1 + (m odd) / 2) from m = 2
    normal = tl.exp2(((m >> 1) - 1).to(tl.float32)) * (1.0 + 0.5 * (m & 1).to(tl.float32))
    mag = tl.where(m < 2, 0.5 * m.to(tl.float32), normal)
    val = tl.where(code >= 8, -mag, mag)
    s = scale.to(tl.int32)
    mult = tl.where(s > 0, s << 23, 0x400000).to(tl.float32, bitcast=True)   # 0: 2^-127
    return val * mult


@triton.jit
def _weight_tile(w_ptr, s_ptr, e, rows, cols, mask, sw_e, sw_r, sw_c, ss_e, ss_r, ss_c,
                 MXFP4: tl.constexpr, DTYPE: tl.constexpr):
    """Expert e's weight at [rows, cols] ([BN, BK]) in DTYPE."""
    if MXFP4:
        byte = tl.load(w_ptr + e * sw_e + rows[:, None] * sw_r + (cols[None, :] // 2) * sw_c,
                       mask=mask, other=0)
        sc = tl.load(s_ptr + e * ss_e + rows[:, None] * ss_r + (cols[None, :] // 32) * ss_c,
                     mask=mask, other=127)
        w = _e2m1_e8m0(byte, cols[None, :], sc).to(DTYPE)
    else:
        w = tl.load(w_ptr + e * sw_e + rows[:, None] * sw_r + cols[None, :] * sw_c,
                    mask=mask, other=0.0).to(DTYPE)
    return w


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, order_ptr, t_exp_ptr, t_start_ptr, t_end_ptr,
                    top_k, W, I, sx_t, sx_w, sw_e, sw_r, sw_c, ss_e, ss_r, ss_c, sh_n,
                    beta, linear_beta,
                    MXFP4: tl.constexpr, SITU: tl.constexpr, CLIP_UP: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(t_exp_ptr + pid_m).to(tl.int64)
    if e < 0:                                   # past the last expert's tiles
        return
    start = tl.load(t_start_ptr + pid_m)
    end = tl.load(t_end_ptr + pid_m)
    dtype = h_ptr.dtype.element_ty
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    tok = (tl.load(order_ptr + offs_m, mask=m_mask, other=0) // top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, W, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < W
        a = tl.load(x_ptr + tok[:, None] * sx_t + offs_k[None, :] * sx_w,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(dtype)
        wmask = n_mask[:, None] & k_mask[None, :]
        wg = _weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, wmask, sw_e, sw_r, sw_c,
                          ss_e, ss_r, ss_c, MXFP4, dtype)
        wu = _weight_tile(w_ptr, s_ptr, e, offs_n + I, offs_k, wmask, sw_e, sw_r, sw_c,
                          ss_e, ss_r, ss_c, MXFP4, dtype)
        if UPCAST:      # the interpreter's bf16 dot is wrong; the values are the same
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision=PRECISION)
    # the projections round to the activation dtype first, as the torch form's matmul does
    g = acc_g.to(dtype).to(tl.float32)
    u = acc_u.to(dtype).to(tl.float32)
    if SITU:
        act = beta * _tanh(g / beta) * tl.sigmoid(g)
        if CLIP_UP:
            u = linear_beta * _tanh(u / linear_beta)
    else:
        act = g * tl.sigmoid(g)
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * sh_n + offs_n[None, :],
             (act * u).to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, s_ptr, y_ptr, order_ptr, rw_ptr, t_exp_ptr, t_start_ptr,
                 t_end_ptr, I, W, sh_n, sw_e, sw_r, sw_c, ss_e, ss_r, ss_c, sy_n,
                 MXFP4: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(t_exp_ptr + pid_m).to(tl.int64)
    if e < 0:
        return
    start = tl.load(t_start_ptr + pid_m)
    end = tl.load(t_end_ptr + pid_m)
    dtype = h_ptr.dtype.element_ty
    offs_m = start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    slot = tl.load(order_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        a = tl.load(h_ptr + offs_m[:, None].to(tl.int64) * sh_n + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wd = _weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, n_mask[:, None] & k_mask[None, :],
                          sw_e, sw_r, sw_c, ss_e, ss_r, ss_c, MXFP4, dtype)
        if UPCAST:
            a, wd = a.to(tl.float32), wd.to(tl.float32)
        acc = tl.dot(a, tl.trans(wd), acc, input_precision=PRECISION)
    rw = tl.load(rw_ptr + slot, mask=m_mask, other=0.0)
    y = acc.to(dtype).to(tl.float32) * rw[:, None]
    tl.store(y_ptr + slot[:, None] * sy_n + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def _blocks(n_slots: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from shapes alone: small M tiles for decode."""
    block_m = 16 if n_slots <= 64 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return block_m, 64, block_k


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: ExpertWeights,
              w2: ExpertWeights, act: GLUActivation) -> torch.Tensor:
    """x [T, W], weights [T, k] (any float), ids [T, k] -> sum_k weights · expert(x) [T, W]
    in x's dtype. w13: [E, 2I, W] (w1 rows then w3 rows), w2: [E, W, I]."""
    T, k = ids.shape
    W = x.shape[1]
    E, I = w13.weight.shape[0], w13.rows // 2
    if T == 0:
        return torch.zeros_like(x)
    if (w13.scale is None) != (w2.scale is None):
        raise ValueError("w13 and w2 must both be MXFP4 or both plain")
    N = T * k
    block_m, block_n, block_k = _blocks(N, x.dtype)
    tiles = slot_tiles(ids, E, block_m)
    mx = w13.scale is not None
    # fp32 stays fp32 (no tf32); under the interpreter 16-bit dots run on fp32 copies
    upcast = interpreting() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    h = torch.empty(N, I, dtype=x.dtype, device=x.device)                 # [N, I] sorted
    situ = act.kind == "situ"
    lb = act.linear_beta
    grid1 = (tiles.count, triton.cdiv(I, block_n))
    _gate_up_kernel[grid1](
        x, *w13.pointers(), h, tiles.order, tiles.expert, tiles.start, tiles.end,
        k, W, I, *x.stride(), *w13.strides(), h.stride(0), float(act.beta), float(lb or 1.0),
        MXFP4=mx, SITU=situ, CLIP_UP=lb is not None, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    # [N, W] by slot, in x's dtype (a prefill chunk of 8k tokens, top-8, W 2,304 holds 300 MB
    # of it in bf16); the combine sums the k rows in fp32
    y = torch.empty(N, W, dtype=x.dtype, device=x.device)
    rw = weights.reshape(-1).to(torch.float32)
    grid2 = (tiles.count, triton.cdiv(W, block_n))
    _down_kernel[grid2](
        h, *w2.pointers(), y, tiles.order, rw, tiles.expert, tiles.start, tiles.end,
        I, W, h.stride(0), *w2.strides(), y.stride(0), MXFP4=mx, PRECISION=precision, UPCAST=upcast,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y.view(T, k, W).sum(1, dtype=torch.float32).to(x.dtype)
