"""The speculative verifier `rejection.verify`, checked against the distribution it must keep.

Random rows (temperature > 0): on a 6-token vocabulary with fixed target logits per position,
drafts drawn from a draft distribution q != p (and the n-gram point mass, draft_probs=None),
tens of thousands of verifications; a chi-square goodness-of-fit test says the token emitted at
position j (whenever the run reaches it: the first token, the second given the first draft was
accepted, the bonus token after all drafts) is distributed as the target p_j, including with
temperature and top-k, and the acceptance rate at position 0 is sum_i min(p_i, q_i). Negative
controls show the test has power: sampling straight from q, or resampling a rejection from p
instead of the residual max(p - q, 0), are rejected by the same test.

Greedy rows (temperature 0): exact-match acceptance: the longest prefix of drafts equal to the
target's argmax is accepted, then the argmax at the first mismatch (or the bonus position);
penalties at position j see the drafts before it; logprobs are the raw model's; rows of several
requests (greedy, random, no drafts) packed back to back keep their offsets.

The chi-square p-value is computed with torch (the regularised upper incomplete gamma), so the
test needs no scipy.
"""

from __future__ import annotations

import math

import pytest
import torch

from kdaserve.engine.sampler import SamplingRow
from kdaserve.engine.spec.rejection import VerifyRow, verify
from kdaserve.request import SamplingParams

V = 6
# fixed target logits for positions 0, 1, 2 (k = 2 drafts + the bonus position)
LOGITS = torch.tensor([
    [1.2, 0.4, -0.3, 0.9, -1.0, 0.1],
    [-0.5, 1.0, 0.7, -0.2, 0.3, -1.2],
    [0.2, -0.8, 1.1, 0.6, -0.4, 0.5],
])
# draft distributions for positions 0, 1: different from the targets, overlapping enough that
# most drafts are accepted (the bonus position then gets thousands of samples)
Q = torch.tensor([
    [0.30, 0.10, 0.05, 0.25, 0.10, 0.20],
    [0.05, 0.30, 0.30, 0.10, 0.20, 0.05],
])
K = Q.shape[0]
ALPHA = 1e-3        # goodness of fit: pass when the p-value is above this (fixed seeds)
POWER = 1e-6        # negative controls must fall below this


def _target(logits: torch.Tensor, temperature: float, top_k: int,
            top_p: float = 1.0) -> torch.Tensor:
    """The distribution a plain sample would use, computed independently of the package:
    top-k, or top-p (the smallest set of most likely tokens whose mass reaches top_p)."""
    z = logits.double() / temperature
    if top_k:
        kth = z.topk(top_k, -1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    p = z.softmax(-1)
    if top_p < 1:
        for row in p:
            keep, mass = [], 0.0
            for i in row.argsort(descending=True).tolist():
                if mass >= top_p:
                    break
                keep.append(i)
                mass += float(row[i])
            cut = torch.ones_like(row, dtype=torch.bool)
            cut[keep] = False
            row[cut] = 0
            row /= row.sum()
    return p


def _chi2_pvalue(tokens: list[int], p: torch.Tensor) -> float:
    """Goodness of fit of the observed tokens to p [V]; tokens of probability 0 must not occur."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=V).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside the target's support: {counts}"
    n = counts.sum()
    exp = n * p[support]
    assert exp.min() >= 5, "too few samples for the chi-square approximation"
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    # chi-square survival function: the regularised upper incomplete gamma Q(dof/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _verify_many(logits: torch.Tensor, params: SamplingParams, drafts: torch.Tensor,
                 q: torch.Tensor | None, seed: int, per_call: int = 250) -> list[list[int]]:
    """One verification per column of drafts [K, N], packed per_call requests a call."""
    gen = torch.Generator().manual_seed(seed)
    n_pos, n = drafts.shape[0] + 1, drafts.shape[1]
    out: list[list[int]] = []
    cols = drafts.t().tolist()
    for start in range(0, n, per_call):
        chunk = cols[start:start + per_call]
        rows = [VerifyRow(SamplingRow(f"r{start + i}", params, [0], [], gen), d, q)
                for i, d in enumerate(chunk)]
        res = verify(logits[:n_pos].repeat(len(chunk), 1), rows)
        out.extend([t.token_id for t in ts] for ts in res)
    return out


def _at(outs: list[list[int]], j: int) -> list[int]:
    """The tokens emitted at position j, by the runs that reached it."""
    return [o[j] for o in outs if len(o) > j]


@pytest.mark.parametrize("temperature,top_k,top_p",
                         [(1.0, 0, 1.0), (0.7, 4, 1.0), (0.5, 0, 0.9), (1.3, 0, 0.75)])
def test_random_draft_keeps_target_distribution(temperature, top_k, top_p):
    n = 20_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    p = _target(LOGITS, temperature, top_k, top_p)
    g = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(Q[j], n, replacement=True, generator=g)
                          for j in range(K)])                              # [K, N] d_j ~ q_j
    outs = _verify_many(LOGITS, params, drafts, Q, seed=12)
    assert all(1 <= len(o) <= K + 1 for o in outs)
    # accepted drafts are the drafts themselves
    assert all(o[:-1] == d[:len(o) - 1] for o, d in zip(outs, drafts.t().tolist()))
    for j in range(K + 1):           # first token; second given the first accepted; the bonus
        toks = _at(outs, j)
        assert len(toks) > 2000
        assert _chi2_pvalue(toks, p[j]) > ALPHA, f"position {j}"
    # acceptance at position 0 ~ Binomial(n, sum min(p, q))
    acc = sum(len(o) > 1 for o in outs)
    rate = float(torch.minimum(p[0], Q[0].double()).sum())
    z = (acc - n * rate) / math.sqrt(n * rate * (1 - rate))
    assert abs(z) < 4, (acc / n, rate)


@pytest.mark.parametrize("top_k,which", [(0, "argmax"), (0, "unlikely"), (4, "outside")])
def test_point_mass_draft_keeps_target_distribution(top_k, which):
    """The n-gram proposer's drafts: fixed tokens, draft_probs None (q = one-hot)."""
    n = 12_000
    params = SamplingParams(temperature=1.0, top_k=top_k)
    p = _target(LOGITS, 1.0, top_k)
    pick = {"argmax": lambda r: int(r.argmax()), "unlikely": lambda r: int(r.argmin()),
            "outside": lambda r: int(r.argmin())}[which]            # argmin is cut by top-k 4
    fixed = [pick(p[j]) for j in range(K)]
    if which == "outside":
        assert all(float(p[j, d]) == 0 for j, d in enumerate(fixed))
    drafts = torch.tensor(fixed)[:, None].expand(K, n)
    outs = _verify_many(LOGITS, params, drafts, None, seed=21 + top_k)
    for j in range(K + 1):
        toks = _at(outs, j)
        if which == "outside" and j > 0:
            assert not toks           # a draft of probability 0 is never accepted
        elif len(toks) >= 500:        # an unlikely draft is rarely accepted: few runs reach j
            assert _chi2_pvalue(toks, p[j]) > ALPHA, f"position {j}"
        else:
            assert which == "unlikely" and j > 0
    acc = sum(len(o) > 1 for o in outs)
    rate = float(p[0, fixed[0]])                                   # min(1, p(d) / 1)
    if rate == 0:
        assert acc == 0
    else:
        z = (acc - n * rate) / math.sqrt(n * rate * (1 - rate))
        assert abs(z) < 4, (acc / n, rate)


def test_chi_square_has_power():
    """The same test rejects sampling from q, and a verifier that resamples a rejection from p
    (instead of the residual max(p - q, 0)); both are plausible bugs of the real one."""
    n = 24_000
    p = _target(LOGITS, 1.0, 0)[0]
    q = Q[0].double()
    g = torch.Generator().manual_seed(31)
    from_q = torch.multinomial(q, n, replacement=True, generator=g).tolist()
    assert _chi2_pvalue(from_q, p) < POWER
    d = torch.multinomial(q, n, replacement=True, generator=g)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    accept = u * q[d] < p[d]
    resampled = torch.multinomial(p, n, replacement=True, generator=g)
    naive = torch.where(accept, d, resampled).tolist()
    assert _chi2_pvalue(naive, p) < POWER
    # and the correct construction, done by hand with the same draws, passes
    residual = (p - q).clamp(min=0)
    fixed = torch.multinomial(residual / residual.sum(), n, replacement=True, generator=g)
    assert _chi2_pvalue(torch.where(accept, d, fixed).tolist(), p) > ALPHA


# ---- greedy: exact match ---------------------------------------------------------------------

def _greedy_row(drafts, **kw) -> VerifyRow:
    return VerifyRow(SamplingRow("g", SamplingParams(temperature=0.0, **kw), [0], [], None),
                     list(drafts))


def _one_hot_logits(argmax: list[int], noise_seed: int = 0) -> torch.Tensor:
    """[len(argmax), V] logits with the given argmax per position (clear margin)."""
    g = torch.Generator().manual_seed(noise_seed)
    x = torch.randn(len(argmax), V, generator=g)
    x[torch.arange(len(argmax)), torch.tensor(argmax)] = x.max() + 1.0
    return x


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_greedy_accepts_matching_prefix(accepted):
    k = 4
    target = [3, 1, 4, 1, 5]                                      # argmax at positions 0..k
    drafts = target[:accepted] + [(t + 1) % V for t in target[accepted:k]]
    logits = _one_hot_logits(target, noise_seed=accepted)
    out = verify(logits, [_greedy_row(drafts)])
    assert [t.token_id for t in out[0]] == target[:accepted + 1]


def test_greedy_mismatch_then_matches_still_stops():
    """Drafts after the first mismatch are never accepted, even when they match the argmax."""
    target = [2, 0, 5, 3]
    out = verify(_one_hot_logits(target), [_greedy_row([2, 1, 5])])
    assert [t.token_id for t in out[0]] == [2, 0]


def test_greedy_no_drafts_is_plain_argmax():
    logits = _one_hot_logits([4])
    assert [t.token_id for t in verify(logits, [_greedy_row([])])[0]] == [4]


def test_greedy_penalties_see_earlier_drafts():
    """Position j is penalised with the request's output plus drafts[:j]."""
    logits = torch.zeros(3, V)
    logits[0, 3] = 3.0
    logits[1, 3], logits[1, 4] = 2.0, 1.5        # 3 wins unless penalised for draft 0 == 3
    logits[2, 2] = 1.0
    plain = verify(logits, [_greedy_row([3, 3])])[0]
    assert [t.token_id for t in plain] == [3, 3, 2]
    pen = verify(logits, [_greedy_row([3, 3], presence_penalty=1.0)])[0]
    assert [t.token_id for t in pen] == [3, 4]


def test_greedy_logprobs_are_the_raw_models():
    target = [1, 2, 3]
    logits = _one_hot_logits(target, noise_seed=5)
    out = verify(logits, [_greedy_row([1, 0], logprobs=2)])[0]
    lp = logits.log_softmax(-1)
    assert [t.token_id for t in out] == [1, 2]
    for j, t in enumerate(out):
        assert t.logprob == pytest.approx(float(lp[j, t.token_id]), abs=1e-6)
        top = lp[j].topk(2).indices.tolist()
        assert set(t.top_logprobs) == {t.token_id, *top}


def test_packed_rows_keep_their_offsets():
    """Several requests back to back: greedy, random with top_k=1 (deterministic), no drafts,
    a point mass and a drawn draft; each gets exactly the tokens its own positions decide."""
    gen = torch.Generator().manual_seed(0)
    det = SamplingParams(temperature=0.8, top_k=1)               # p is one-hot on the argmax
    specs = [  # (argmax per position, drafts, params, draft probs)
        ([1, 2, 3, 4], [1, 2, 0], SamplingParams(temperature=0.0), None),
        ([5], [], det, None),
        ([0, 4, 2], [0, 4], det, None),                           # all accepted: the bonus
        ([3, 3, 1], [3, 5], det, torch.full((2, V), 1.0 / V)),    # rejected at position 1
        ([2, 0], [1], SamplingParams(temperature=0.0), None),
    ]
    logits = torch.cat([_one_hot_logits(a, noise_seed=i) for i, (a, *_) in enumerate(specs)])
    rows = [VerifyRow(SamplingRow(f"r{i}", sp, [0], [], gen), d, q)
            for i, (_, d, sp, q) in enumerate(specs)]
    out = verify(logits, rows)
    want = [[1, 2, 3], [5], [0, 4, 2], [3, 3], [2]]
    assert [[t.token_id for t in ts] for ts in out] == want
