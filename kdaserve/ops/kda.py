"""Kimi Delta Attention: the gated delta rule with a per-key-channel decay.

Per head, with state S [K, V] (fp32):
    S' = Diag(exp g_t) S_{t-1};   S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;   o_t = S_t^T q_t

q and k arrive L2-normalised and q already scaled; g is the log decay (<= 0).

Legend: B sequences, L padded length, N chunks, C chunk size, H heads, K key dim, V value dim.
"""

from __future__ import annotations

import torch

__all__ = ["kda_chunk", "kda_recurrent", "kda_recurrent_slots", "kda_step"]

# bytes of pairwise-decay temporaries per slice of chunks in kda_chunk (fits in L2/L3)
_INTRA_BYTES = 2 << 20


def kda_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q,k,g [B,H,K], v [B,H,V], beta [B,H], state [B,H,K,V] -> o [B,H,V].

    With inplace the state tensor is updated in place (the caller owns it, e.g. a gathered copy
    of the slots): decode is memory-bound on the state, so each pass over it counts.
    """
    B, H, K, V = state.shape
    s = state.mul_(g.exp().unsqueeze(-1)) if inplace else state * g.exp().unsqueeze(-1)
    kv = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = (v - kv) * beta.unsqueeze(-1)
    s.view(B * H, K, V).baddbmm_(k.reshape(B * H, K, 1), delta.reshape(B * H, 1, V))
    o = torch.einsum("bhk,bhkv->bhv", q, s)
    return o, s


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Step-by-step form. q,k,g [B,L,H,K], v [B,L,H,V], beta [B,L,H], state [B,H,K,V].

    Returns o [B,L,H,V], the final state, and (with keep_states) the state after every
    position [B,L,H,K,V]: speculative verification commits the one after the last accepted token.
    """
    outs, kept = [], []
    s = state
    for t in range(q.shape[1]):
        o, s = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o)
        if keep_states:
            kept.append(s)
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o, s, (torch.stack(kept, 1) if keep_states and kept else None)


def kda_recurrent_slots(
    store: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor, keep_states: bool = False,
    scratch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode rows against the engine's state slots: store [S,H,K,V] fp32 is read at `slots` [B]
    and updated in place. q,k,g [B,L,H,K], v [B,L,H,V], beta [B,L,H]. Returns o [B,L,H,V] and
    (with keep_states) the state after every position [B,L,H,K,V] (speculative rollback).

    `scratch` [>=B,H,K,V] receives the gathered states (no fresh allocation per layer). The
    compiled CPU kernel (`ops/csrc/kda_cpu.c`) does the same without the gather and scatter.
    """
    B, L = q.shape[:2]
    out = scratch[:B] if scratch is not None else None
    s0 = torch.index_select(store, 0, slots, out=out) if out is not None else store[slots]
    if L == 1 and not keep_states:
        o, s = kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], s0, inplace=True)
        o, kept = o[:, None], None
    else:
        o, s, kept = kda_recurrent(q, k, v, g, beta, s0, keep_states=keep_states)
    store.index_copy_(0, slots, s)
    return o, kept


def kda_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk_size: int, keep_chunk_states: bool = False, sub_chunk: int = 4,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked form over padded sequences. q,k,g [B,L,H,K], v [B,L,H,V], beta [B,L,H],
    state [B,H,K,V] fp32; L must be a multiple of chunk_size.

    Inside a chunk the pseudo-values u solve (I + A) u = beta (v - (exp(G) k) S0) with
    A[t,s] = beta_t sum_i k_t,i k_s,i exp(G_t,i - G_s,i) (s < t), G the in-chunk cumulative
    decay. The decay differences are never formed as exp(-G): within a sub-chunk they are
    taken pairwise, across sub-chunks they factor through the cumulative decay at a sub-chunk
    boundary between s and t, where both factors are <= 1. So no overflow for any g.
    Padding rows with k = v = g = beta = 0 leave the state untouched.

    Returns o [B,L,H,V], final state [B,H,K,V], and with keep_chunk_states the state at the end
    of every chunk [B,N,H,K,V] (prefix-cache snapshots at chunk-aligned boundaries).
    """
    B, L, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    if L % C:
        raise ValueError(f"kda_chunk: length {L} is not a multiple of chunk size {C}")
    N = L // C
    dt = torch.float32

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B,L,H,*] -> [B,H,N,C,*]
        return x.to(dt).reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = beta.to(dt).reshape(B, N, C, H).permute(0, 3, 1, 2).unsqueeze(-1)  # [B,H,N,C,1]
    c = sub_chunk if C % sub_chunk == 0 else C
    # The intra-chunk part is independent per chunk; its pairwise-decay temporaries hold c*K
    # floats per position, so chunks go through it a few at a time, keeping them in cache
    # (one pass over a whole prompt batch would allocate tens of MB per op).
    step = max(1, _INTRA_BYTES // (B * H * C * c * K * 4))
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.clone().fill_diagonal_(False)
    eye = torch.eye(C, dtype=dt, device=q.device)

    s = state.to(dt)
    outs, kept = [], []
    for n0 in range(0, N, step):
        sl = slice(n0, min(N, n0 + step))
        qs, ks, vs, bs = q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl]
        gc = g[:, :, sl].cumsum(-2)                                           # [B,H,n,C,K]
        a, qk = _chunk_scores(qs, ks, gc, c)
        a = (a * bs).masked_fill(~strict, 0.0)
        qk = qk.masked_fill(~incl, 0.0)
        lower = a + eye
        u0 = torch.linalg.solve_triangular(lower, bs * vs, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(lower, bs * (gc.exp() * ks), upper=False,
                                          unitriangular=True)
        qd = qs * gc.exp()
        g_end = gc[..., -1:, :]                                               # [B,H,n,1,K]
        k_end = (ks * (g_end - gc).exp()).transpose(-1, -2)                   # [B,H,n,K,C]
        decay_end = g_end.squeeze(-2).exp().unsqueeze(-1)                     # [B,H,n,K,1]
        for i in range(u0.shape[2]):
            u = u0[:, :, i] - w[:, :, i] @ s                                  # [B,H,C,V]
            outs.append(qd[:, :, i] @ s + qk[:, :, i] @ u)
            s = decay_end[:, :, i] * s + k_end[:, :, i] @ u
            if keep_chunk_states:
                kept.append(s)
    o = torch.stack(outs, 2) if outs else v.new_zeros(B, H, 0, C, V)          # [B,H,N,C,V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, L, H, V)
    return o, s, (torch.stack(kept, 1) if keep_chunk_states and kept else None)


def _chunk_scores(q: torch.Tensor, k: torch.Tensor, gc: torch.Tensor, c: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i x_t,i k_s,i exp(G_t,i - G_s,i) for x = k and x = q, for s <= t (else 0).

    q, k, gc [B,H,N,C,K] -> two [B,H,N,C,C]. Sub-chunks of c positions: pairwise decay
    inside (a [c,c,K] tensor each), a matmul through the boundary decay across.
    """
    B, H, N, C, K = k.shape
    m = C // c
    gs = gc.view(B, H, N, m, c, K)
    ks, qs = k.view(B, H, N, m, c, K), q.view(B, H, N, m, c, K)
    incl = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    dec = (gs.unsqueeze(-2) - gs.unsqueeze(-3)).masked_fill(~incl[:, :, None], float("-inf")).exp()
    a_in = (ks.unsqueeze(-2) * dec * ks.unsqueeze(-3)).sum(-1)                # [B,H,N,m,c,c]
    qk_in = (qs.unsqueeze(-2) * dec * ks.unsqueeze(-3)).sum(-1)
    if m == 1:
        return a_in.view(B, H, N, C, C), qk_in.view(B, H, N, C, C)
    # boundary decay before sub-chunk i: G at the end of sub-chunk i-1 (0 before the chunk)
    gb = torch.cat([torch.zeros_like(gs[:, :, :, :1, -1]), gs[:, :, :, :-1, -1]], 3)  # [..,m,K]
    to_b = (gs - gb.unsqueeze(-2)).exp()                                      # [..,m,c,K] <= 1
    pos = torch.arange(C, device=k.device)
    before = pos[None, :] < (torch.arange(m, device=k.device) * c)[:, None]   # [m, C]
    from_b = (gb.unsqueeze(-2) - gc.unsqueeze(3))                             # [..,m,C,K]
    from_b = from_b.masked_fill(~before[:, :, None], float("-inf")).exp()
    k_src = k.unsqueeze(3) * from_b                                           # [..,m,C,K]
    a_x = (ks * to_b) @ k_src.transpose(-1, -2)                               # [..,m,c,C]
    qk_x = (qs * to_b) @ k_src.transpose(-1, -2)
    eye = torch.eye(m, dtype=k.dtype, device=k.device)[:, None, :, None]      # [m,1,m,1]
    a = a_x.view(B, H, N, m, c, m, c) + a_in.unsqueeze(-2) * eye
    qk = qk_x.view(B, H, N, m, c, m, c) + qk_in.unsqueeze(-2) * eye
    return a.reshape(B, H, N, C, C), qk.reshape(B, H, N, C, C)
