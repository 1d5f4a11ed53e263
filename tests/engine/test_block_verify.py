"""Block verification (kdaserve/engine/spec/block_verify.py) keeps the target's distribution and
accepts at least as many drafts as token-by-token verification on the same drafts: many draws
on an 8-token vocabulary with fixed target and draft distributions (position- and
last-token-dependent), chi-square against the exact joint of the first two tokens."""

from __future__ import annotations

import pytest
import torch

from kdaserve.engine.sampler import draw_rows
from kdaserve.engine.spec.block_verify import block_accept

V, K, R = 8, 3, 40000          # vocabulary, drafts per block, parallel sequences


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p and q [position, last token (V: none yet), V]: a draft that is close but not equal."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(K + 2, V + 1, V, generator=g) * 1.5
    p = logits.softmax(-1)
    q = (logits * 0.6 + torch.randn(K + 2, V + 1, V, generator=g) * 0.8).softmax(-1)
    return p, q


def _token_accept(p, q, d, eta, u):
    """Token-by-token rejection sampling (Leviathan et al.), vectorised: the textbook rule."""
    rows = torch.arange(d.shape[0])
    ok = eta * q.gather(2, d[..., None])[..., 0] < p[:, :K].gather(2, d[..., None])[..., 0]
    a = ok.long().cumprod(1).sum(1)
    p_a, q_a = p[rows, a], q[rows, a.clamp(max=K - 1)]
    resid = (p_a - q_a).clamp(min=0)
    dist = torch.where((a == K)[:, None], p_a, resid / resid.sum(-1, keepdim=True))
    return a, draw_rows(dist, u)


def _block(seq, q_tab, gen):
    """One block for every row: drafts from q, the target's p at each position."""
    length = (seq >= 0).sum(1)
    last = torch.where(length > 0, seq.gather(1, (length - 1).clamp(min=0)[:, None])[:, 0],
                       torch.full_like(length, V))
    drafts, qs, ps, prev = [], [], [], last
    for i in range(K + 1):
        ps.append(P[(length + i).clamp(max=K + 1), prev])
        if i == K:
            break
        qd = q_tab[(length + i).clamp(max=K + 1), prev]
        x = draw_rows(qd, torch.rand(R, generator=gen))
        drafts.append(x)
        qs.append(qd)
        prev = x
    return torch.stack(ps, 1), torch.stack(qs, 1), torch.stack(drafts, 1)


P, Q = _tables(0)


def _first_two(accept, seed: int) -> tuple[torch.Tensor, float]:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.full((R, 2), -1)
    accepted = []
    while (seq < 0).any():
        p, q, d = _block(seq, Q, gen)
        eta, u = torch.rand(R, K, generator=gen), torch.rand(R, generator=gen)
        tau, y = accept(p, q, d, eta, u)
        accepted.append(tau.float().mean().item())
        length = (seq >= 0).sum(1)
        for j in range(2):             # the accepted drafts, then y, into the free places
            src = j - length
            tok = torch.where(src < tau, d.gather(1, src.clamp(0, K - 1)[:, None])[:, 0], y)
            seq[:, j] = torch.where((src >= 0) & (src <= tau), tok, seq[:, j])
    return seq, accepted[0]


def _chi2_pvalue(seq: torch.Tensor) -> float:
    want = (P[0, V][:, None] * P[1, :V]).reshape(-1) * R        # exact joint of t1, t2
    got = torch.bincount(seq[:, 0] * V + seq[:, 1], minlength=V * V).double()
    big = want >= 5                                            # pool the sparse cells
    exp = torch.cat([want[big], want[~big].sum()[None]]).double()
    obs = torch.cat([got[big], got[~big].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(exp) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _block_rule(p, q, d, eta, u):
    return block_accept(p, q, d, torch.full((d.shape[0],), K), eta, u)


@pytest.mark.parametrize("rule", [_block_rule, _token_accept], ids=["block", "token"])
def test_the_emitted_tokens_follow_the_target(rule):
    seq, _ = _first_two(rule, seed=1)
    assert _chi2_pvalue(seq) > 1e-3


def test_block_accepts_at_least_as_many_as_token_on_the_same_drafts():
    gen = torch.Generator().manual_seed(7)
    seq = torch.full((R, 2), -1)
    p, q, d = _block(seq, Q, gen)
    eta, u = torch.rand(R, K, generator=gen), torch.rand(R, generator=gen)
    tau_b, _ = _block_rule(p, q, d, eta, u)
    tau_t, _ = _token_accept(p, q, d, eta, u)
    mean_b, mean_t = tau_b.float().mean().item(), tau_t.float().mean().item()
    print(f"mean accepted: block {mean_b:.4f}, token {mean_t:.4f}")
    assert mean_b >= mean_t


def test_one_draft_is_token_verification_and_ragged_rows():
    """With one draft the rules coincide: the same accept decision and token for the same
    uniforms. Rows with fewer drafts than the widest (n < N) use only theirs."""
    gen = torch.Generator().manual_seed(3)
    p, q, d = _block(torch.full((R, 2), -1), Q, gen)
    eta, u = torch.rand(R, K, generator=gen), torch.rand(R, generator=gen)
    n1 = torch.ones(R, dtype=torch.long)
    tau_b, y_b = block_accept(p, q, d, n1, eta, u)
    tau_w, y_w = block_accept(p[:, :2], q[:, :1], d[:, :1], n1, eta[:, :1], u)
    assert torch.equal(tau_b, tau_w) and torch.equal(y_b, y_w)
    ok = eta[:, 0] * q[:, 0].gather(1, d[:, :1])[:, 0] < p[:, 0].gather(1, d[:, :1])[:, 0]
    assert torch.equal(tau_b, ok.long())
    none = torch.zeros(R, dtype=torch.long)
    tau0, y0 = block_accept(p, q, d, none, eta, u)
    assert not tau0.any() and torch.equal(y0, draw_rows(p[:, 0], u))


def test_the_check_catches_a_rule_that_is_off():
    """The same check fails a rule that keeps every draft (the draft's distribution, not the
    target's): the test can fail."""
    def keep_all(p, q, d, eta, u):
        return torch.full((d.shape[0],), K), draw_rows(p[:, K], u)
    seq, _ = _first_two(keep_all, seed=1)
    assert _chi2_pvalue(seq) < 1e-6
