"""Verification of drafts on the logits' device: rejection.verify without a read-back before
the one copy of the results, vectorised over the requests (rows padded to the most drafts).

The same tokens as the reference (rejection.verify): the same processing (penalties at each
position see the drafts before it, logit_bias, grammar masks, temperature, top-k/top-p/min-p),
the same acceptance test u · q(d) < p(d), the same residual max(p - q, 0) renormalised (p where
it is all zero) or bonus distribution, the same inverse-CDF draw, and the same uniforms: each
random request draws torch.rand(n) then torch.rand(1) from its own host stream, in request
order, exactly as the reference does, and they reach the device with the other per-row lists.

Legend: R verify rows, N most drafts of a row, P positions (sum of drafts + 1), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.device_sampling import LogprobParts, constrain, wanted_logprobs
from kdaserve.engine.penalties import Penalties, device_tensor
from kdaserve.engine.sampler import SamplingRow, _filter, draw_rows
from kdaserve.engine.spec.block_verify import block_accept
from kdaserve.engine.spec.rejection import VerifyRow


@dataclass
class VerifyDraw:
    """Each row's new tokens, left on the device: tokens [R, N+1] (the first counts[r] stand:
    accepted drafts, then the corrected or bonus token), counts [R], logprobs at [R, N+1]."""

    tokens: torch.Tensor
    counts: torch.Tensor
    logprobs: LogprobParts | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.counts] + (self.logprobs.tensors() if self.logprobs else [])


def _host_uniforms(rows: list[VerifyRow], random: list[int], n: list[int], N: int
                   ) -> torch.Tensor:
    """[len(random), N+1] float32: each random row's acceptance uniforms (its n, padded) and,
    in the last column, the uniform of its final draw; drawn as rejection.verify draws them."""
    out = []
    for r in random:
        gen = rows[r].row.generator
        acc = torch.rand(n[r], generator=gen) if n[r] else torch.zeros(0)
        fin = torch.rand(1, generator=gen)
        out.append(torch.cat([acc, torch.zeros(N - n[r]), fin]))
    return torch.stack(out)


def verify_on_device(logits: torch.Tensor, rows: list[VerifyRow]) -> VerifyDraw:
    """logits [P, V]: each request's positions back to back (rejection.verify's layout)."""
    logits = logits.float()
    dev, V = logits.device, logits.shape[-1]
    n = [len(v.drafts) for v in rows]
    N = max(n)
    starts = [sum(m + 1 for m in n[:r]) for r in range(len(rows))]
    pos_rows = [SamplingRow(v.row.request_id, v.row.params, v.row.prompt_token_ids,
                            v.row.output_token_ids + v.drafts[:j], v.row.generator,
                            None if v.bitmasks is None else v.bitmasks[j])
                for v in rows for j in range(len(v.drafts) + 1)]
    k_lp = wanted_logprobs(pos_rows)
    raw = logits.log_softmax(-1) if k_lp is not None else None
    pen = Penalties.build([v.row for v in rows], V, dev)
    if pen is not None:
        logits = pen.positions([v.drafts for v in rows]).apply(logits)
    logits = constrain(logits, pos_rows)
    # per row, per draft slot j: the draft (0 past the end), the position it is checked at
    drafts = device_tensor([v.drafts + [0] * (N + 1 - len(v.drafts)) for v in rows],
                           torch.long, dev)                                   # [R, N+1]
    at = device_tensor([[starts[r] + min(j, n[r]) for j in range(N + 1)]
                        for r in range(len(rows))], torch.long, dev)          # [R, N+1]
    has = torch.arange(N + 1, device=dev)[None] < device_tensor(n, torch.long, dev)[:, None]
    target = logits.argmax(-1)[at]                                           # greedy [R, N+1]
    ok = has & (drafts == target)
    last = target
    random = [r for r, v in enumerate(rows) if v.row.params.temperature > 0]
    if random:
        ok_r, last_r = _accept_random(logits, rows, random, n, N, starts, drafts, at, has)
        sel = device_tensor(random, torch.long, dev)
        ok = ok.index_put((sel,), ok_r)
        last = last.index_put((sel,), last_r)
    a = ok[:, :N].long().cumprod(1).sum(1)                                   # accepted [R]
    tokens = drafts.scatter(1, a[:, None], last.gather(1, a[:, None]))
    parts = LogprobParts.of(raw, at, tokens, k_lp) if raw is not None else None
    return VerifyDraw(tokens, a + 1, parts)


def _accept_random(logits: torch.Tensor, rows: list[VerifyRow], random: list[int],
                   n: list[int], N: int, starts: list[int], drafts: torch.Tensor,
                   at: torch.Tensor, has: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The random rows' acceptance [Rr, N+1] (False from column n) and their final token
    [Rr, N+1] (the same in every column: only column a is read)."""
    dev = logits.device
    pos = [starts[r] + j for r in random for j in range(n[r] + 1)]
    prow = [rows[r].row for r in random for _ in range(n[r] + 1)]
    temps = device_tensor([r.params.temperature for r in prow], torch.float32, dev)
    pidx = device_tensor(pos, torch.long, dev)
    probs = _filter(logits[pidx] / temps[:, None], prow, sort_all=True).softmax(-1)   # [Pr,V]
    base = [0]
    for r in random:
        base.append(base[-1] + n[r] + 1)
    # rows of `probs` at each (random row, j)
    p_at = device_tensor([[base[m] + min(j, n[r]) for j in range(N + 1)]
                          for m, r in enumerate(random)], torch.long, dev)    # [Rr, N+1]
    sel = device_tensor(random, torch.long, dev)
    d, hs = drafts[sel], has[sel]
    p_d = probs[p_at, d]                                                      # [Rr, N+1]
    with_q = [m for m, r in enumerate(random) if rows[r].draft_probs is not None and n[r]]
    q_d = torch.ones_like(p_d)
    q_rows = None
    if with_q:
        qs = [rows[random[m]].draft_probs[: n[random[m]]] for m in with_q]
        Q = torch.cat(qs).to(dev, torch.float32, non_blocking=True)          # [Dq, V]
        q_base = [0]
        for m in with_q:
            q_base.append(q_base[-1] + n[random[m]])
        q_at = device_tensor([[q_base[i] + min(j, n[random[m]] - 1) for j in range(N + 1)]
                              for i, m in enumerate(with_q)], torch.long, dev)
        qsel = device_tensor(with_q, torch.long, dev)
        q_d = q_d.index_put((qsel,), Q[q_at, d[qsel]])
        q_rows = (qsel, q_at, Q)
    u = _host_uniforms(rows, random, n, N)
    u = u.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else u
    if rows[random[0]].block and N:     # the method is the engine's: every row alike
        return _accept_block(probs, p_at, d, q_rows, random, n, N, u, dev)
    ok = hs & (u * q_d < p_d)
    a = ok[:, :N].long().cumprod(1).sum(1)
    p_a = probs[p_at.gather(1, a[:, None])[:, 0]]                             # [Rr, V]
    # q at the first rejected draft: the proposer's probabilities, or a point mass on it
    q_a = torch.zeros_like(p_a).scatter_(1, d.gather(1, a[:, None]), 1.0)
    if q_rows is not None:
        qsel, q_at, Q = q_rows
        q_a = q_a.index_put((qsel,), Q[q_at.gather(1, a[qsel][:, None])[:, 0]])
    residual = (p_a - q_a).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    rejected = a < device_tensor([n[r] for r in random], torch.long, dev)
    dist = torch.where(rejected[:, None], torch.where(total > 0, residual / total, p_a), p_a)
    last = draw_rows(dist, u[:, N])
    return ok, last[:, None].expand(-1, N + 1)


def _accept_block(probs, p_at, d, q_rows, random, n, N, u, dev):
    """Block verification (spec/block_verify.py) of the random rows, in the token form's
    return shape: acceptance [Rr, N+1] True for the τ accepted drafts, the final token."""
    Rr = len(random)
    P = probs[p_at]                                                         # [Rr, N+1, V]
    Q = torch.nn.functional.one_hot(d[:, :N], P.shape[-1]).to(P.dtype)      # point masses
    if q_rows is not None:
        qsel, q_at, Qp = q_rows
        Q = Q.index_put((qsel,), Qp[q_at[:, :N]])
    nr = device_tensor([n[r] for r in random], torch.long, dev)
    tau, last = block_accept(P, Q, d[:, :N], nr, u[:, :N], u[:, N])
    ok = torch.arange(N + 1, device=dev)[None] < tau[:, None]
    return ok, last[:, None].expand(Rr, N + 1)
