"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", 2024):
the drafted block is accepted or cut by one joint rule instead of draft by draft.

For drafts X_1..X_n drawn from the draft's q, with the target's p at each position:
    w_0 = 1,   w_i = min(w_{i-1} · p_i(X_i) / q_i(X_i), 1)
    h_i = Σ_x max(w_i p_{i+1}(x) − q_{i+1}(x), 0) / (that sum + 1 − w_i)   for i < n,   h_n = w_n
The block is cut after τ = the largest i with η_i ≤ h_i (0 if none), for uniforms η_1..η_n, and
one token follows: from p_{n+1} when τ = n, else from max(w_τ p_{τ+1} − q_{τ+1}, 0)
renormalised. The emitted tokens are distributed as the target's own samples, and the expected
number accepted is at least token-by-token verification's on the same drafts (the paper's
theorems; tests/engine/test_block_verify.py checks both empirically). With one draft the two
rules are the same. Greedy rows are verified by exact match either way (spec/rejection.py).

The same uniforms as token verification, in the same order (n for the drafts, then one for the
final draw), so the host and device forms draw identical tokens. Everything is vectorised over
rows and runs on any device without reading a tensor back.

Legend: R rows, N most drafts of a row, V vocabulary.
"""

from __future__ import annotations

import torch

from kdaserve.engine.sampler import draw_rows


def block_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, n: torch.Tensor,
                 eta: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p [R, N+1, V]: the target's distribution after 0..N drafts; q [R, N, V]: the draft's
    distribution each draft was drawn from; drafts [R, N] (anything past a row's n); n [R];
    eta [R, N] (past n: unused); u [R]. Returns (accepted drafts τ [R], the token after them
    [R])."""
    R, N = drafts.shape
    dev = p.device
    rows = torch.arange(R, device=dev)
    if N == 0:
        return torch.zeros(R, dtype=torch.long, device=dev), draw_rows(p[:, 0], u)
    d = drafts[..., None]
    ratio = p[:, :N].gather(2, d)[..., 0] / q.gather(2, d)[..., 0].clamp(min=1e-30)   # [R, N]
    w = [torch.ones(R, device=dev)]
    for i in range(N):                  # w_i = min(w_{i-1} ratio_i, 1): N is a handful
        w.append(torch.minimum(w[-1] * ratio[:, i], torch.ones_like(w[-1])))
    W = torch.stack(w, 1)                                                   # [R, N+1]
    j = torch.arange(N, device=dev)
    # h_i for i = 1..N-1 from the residual mass at position i (p after i drafts, q of draft i+1)
    mass = (W[:, 1:N, None] * p[:, 1:N] - q[:, 1:N]).clamp(min=0).sum(-1)    # [R, N-1]
    denom = mass + 1 - W[:, 1:N]
    h = torch.where(denom > 0, mass / denom.clamp(min=1e-30), torch.zeros_like(mass))
    h = torch.cat([h, torch.zeros(R, 1, device=dev)], 1)                   # [R, N]: i = j+1
    h = torch.where(j[None] + 1 == n[:, None], W[:, 1:], h)                 # h_n = w_n
    stop = (j[None] < n[:, None]) & (eta <= h)
    tau = (stop.long() * (j[None] + 1)).amax(1)                             # the largest i
    p_tau = p[rows, tau]                                                    # [R, V]
    q_tau = q[rows, tau.clamp(max=N - 1)]
    resid = (W[rows, tau][:, None] * p_tau - q_tau).clamp(min=0)
    total = resid.sum(-1, keepdim=True)
    dist = torch.where((tau == n)[:, None], p_tau,
                       torch.where(total > 0, resid / total.clamp(min=1e-30), p_tau))
    return tau, draw_rows(dist, u)
