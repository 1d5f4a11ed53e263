"""KDA decode on the state slots in one Triton kernel: the fast form of
`kdaserve.ops.kda.kda_recurrent_slots` (same arguments, same result).

One program per (row, head, V tile) holds its [K, V-tile] slice of the fp32 state in registers
for all L positions of the row: the state is read from its slot once and written back once,
which is the whole memory traffic of a decode step's KDA layer. The columns of the state are
independent in the delta rule (each needs all of k, q and one column), so tiling V needs no
communication between programs; K is whole in every program.

Graph safety: the grid comes from shapes only, the slot of each row is read inside the kernel,
and nothing is read back to the host, so the launch can be captured in a CUDA graph whose
slot buffer is rewritten between replays. A negative slot marks a padding row of a padded
batch: it reads and writes no state and its outputs are zeros.

Legend: B rows, L positions per row, H heads, K key dim, V value dim, S state slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# columns of the state per program: at K = 128 and 4 warps, [128, 16] compiles for sm_90 to
# 112 registers (144 keeping states) without spills; [128, 32] spills when keeping states.
# It also makes 256 programs at batch 1 for 32 heads of 128 columns: every SM busy.
_BLOCK_V = 16


@triton.jit
def _kda_decode_kernel(
    store, slots, q, k, v, g, beta, o, kept,
    s_ss, s_sh, s_sk,                 # store [S,H,K,V] strides (V stride 1)
    q_sb, q_sl, q_sh,                 # q [B,L,H,K] strides (K stride 1); k, g share them
    k_sb, k_sl, k_sh,
    g_sb, g_sl, g_sh,
    v_sb, v_sl, v_sh,                 # v [B,L,H,V] (V stride 1)
    b_sb, b_sl, b_sh,                 # beta [B,L,H]
    L, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, KEEP: tl.constexpr,
):
    i_bh = tl.program_id(0)       # rows x heads on axis 0: the only axis without a 65535 cap
    i_v = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    slot_in = tl.load(slots + i_b).to(tl.int64)
    live = slot_in >= 0
    slot = tl.maximum(slot_in, 0)     # a padding row's addresses stay in bounds; its loads are off

    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk = ok < K
    mv = ov < V
    mkv = mk[:, None] & mv[None, :]
    # the row's mask as a block (Triton's interpreter refuses a scalar & a block)
    mkv_live = mkv & (tl.zeros([BK, BV], dtype=tl.int64) + slot_in >= 0)
    p_s = store + slot * s_ss + i_h * s_sh + ok[:, None] * s_sk + ov[None, :]
    s = tl.load(p_s, mask=mkv_live, other=0.0).to(tl.float32)                # [BK, BV]

    for t in range(L):
        q_t = tl.load(q + i_b * q_sb + t * q_sl + i_h * q_sh + ok, mask=mk, other=0.0)
        k_t = tl.load(k + i_b * k_sb + t * k_sl + i_h * k_sh + ok, mask=mk, other=0.0)
        g_t = tl.load(g + i_b * g_sb + t * g_sl + i_h * g_sh + ok, mask=mk, other=0.0)
        v_t = tl.load(v + i_b * v_sb + t * v_sl + i_h * v_sh + ov, mask=mv, other=0.0)
        b_t = tl.load(beta + i_b * b_sb + t * b_sl + i_h * b_sh).to(tl.float32)
        q_t, k_t = q_t.to(tl.float32), k_t.to(tl.float32)
        s = s * tl.exp(g_t.to(tl.float32))[:, None]
        # delta rule: the value the state already predicts for k_t is replaced by v_t
        pred = tl.sum(k_t[:, None] * s, 0)                                          # [BV]
        delta = (v_t.to(tl.float32) - pred) * b_t
        s = s + k_t[:, None] * delta[None, :]
        o_t = tl.sum(q_t[:, None] * s, 0)
        # where, not a product: a padding row's inputs may hold anything, NaN included
        o_t = tl.where(live, o_t, 0.0)
        row = ((i_b * L + t) * H + i_h).to(tl.int64)   # kept: B·L·H·K·V may pass 2^31
        tl.store(o + row * V + ov, o_t, mask=mv)
        if KEEP:
            tl.store(kept + row * K * V + ok[:, None] * V + ov[None, :],
                     tl.where(live, s, 0.0), mask=mkv)
    tl.store(p_s, s, mask=mkv_live)


def launch_meta(K: int, V: int, keep_states: bool) -> dict[str, int | bool]:
    """The kernel's compile-time parameters for these sizes (tests compile them for sm_90)."""
    return dict(BK=triton.next_power_of_2(K), BV=min(_BLOCK_V, triton.next_power_of_2(V)),
                KEEP=keep_states, num_warps=4)


def kda_recurrent_slots_triton(
    store: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, keep_states: bool = False,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """store [S,H,K,V] fp32 updated in place at `slots` [B] (negative: padding row, skipped);
    q,k,g [B,L,H,K], v [B,L,H,V], beta [B,L,H], bf16 or fp32 (computed in fp32). Returns
    o [B,L,H,V] fp32 and with keep_states the state after every position [B,L,H,K,V] fp32.
    `scratch` is not needed (no gather): accepted for the reference's signature."""
    del scratch
    B, L, H, K = q.shape
    V = v.shape[-1]
    if store.dtype != torch.float32 or store.stride(-1) != 1:
        raise ValueError("kda decode kernel: the state store must be fp32 with unit V stride")
    q, k, g, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, g, v))
    o = torch.empty(B, L, H, V, dtype=torch.float32, device=q.device)
    kept = (torch.empty(B, L, H, K, V, dtype=torch.float32, device=q.device)
            if keep_states else None)
    if B == 0 or L == 0:
        return o, kept
    meta = launch_meta(K, V, keep_states)
    grid = (B * H, triton.cdiv(V, meta["BV"]))
    _kda_decode_kernel[grid](
        store, slots, q, k, v, g, beta, o, kept if kept is not None else o,
        store.stride(0), store.stride(1), store.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        g.stride(0), g.stride(1), g.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2),
        L, H, K, V, **meta,
    )
    return o, kept
