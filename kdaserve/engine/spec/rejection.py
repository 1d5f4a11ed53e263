"""Verification of drafts against the target: exact match when greedy, rejection sampling else
(token by token, below, or the whole block at once: spec/block_verify.py).

For a draft d_j proposed with probability q_j(d_j) and target probability p_j (after penalties,
temperature, top-k/top-p/min-p), d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)).
At the first rejection the token is drawn from max(p_j - q_j, 0) renormalised; when every draft
is accepted a bonus token is drawn from the target at the position after the last draft. The
emitted tokens are then distributed exactly as the target's own samples (Leviathan et al.,
Chen et al. 2023). A model-free proposer (n-gram) is a point mass: q_j = one-hot(d_j).

Legend: P verified positions of one request (drafts + 1), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.sampler import (
    Penalties,
    SamplingRow,
    _constrain,
    _filter,
    _top_logprobs,
    draw_rows,
)
from kdaserve.engine.spec.block_verify import block_accept
from kdaserve.ops.sample_kernel import row_probs_kernel
from kdaserve.outputs import SampledToken


@dataclass
class VerifyRow:
    """One request's verification: its sampling state, drafts, and the drafts' probabilities
    [len(drafts), V] (None: proposed deterministically, a point mass)."""

    row: SamplingRow
    drafts: list[int]
    draft_probs: torch.Tensor | None = None
    bitmasks: torch.Tensor | None = None    # [len(drafts) + 1, W]: the grammar's masks
    block: bool = False          # block verification (spec/block_verify.py), else token by token


def target_probs(logits: torch.Tensor, rows: list[SamplingRow], fast: bool = True
                 ) -> torch.Tensor:
    """The distribution each row samples from: [S, V] -> [S, V] (temperature > 0 rows only).
    fast: compiled on CPU (ops/csrc/sample_probs.h); the torch form is its reference."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32,
                         device=logits.device)
    x = logits / temps[:, None]
    kernel = row_probs_kernel() if fast and x.device.type == "cpu" else None
    if kernel is not None:
        V = x.shape[-1]
        return kernel(x, [r.params.top_k or V for r in rows], [r.params.top_p for r in rows],
                      [r.params.min_p for r in rows])
    return _filter(x, rows).softmax(-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs [V] (any total): one uniform from the request's stream and the
    inverse CDF, as the sampler's plain steps draw, so the device form (spec/
    device_rejection.py) draws the same token from the same stream."""
    return int(draw_rows(probs[None], torch.rand(1, generator=generator))[0])


def verify(logits: torch.Tensor, rows: list[VerifyRow]) -> list[list[SampledToken]]:
    """logits [sum(len(drafts) + 1), V]: each request's positions back to back. Returns each
    request's new tokens: its accepted drafts then one corrected or bonus token."""
    logits = logits.float()
    raw_logprobs = logits.log_softmax(-1)
    pos_rows = [SamplingRow(v.row.request_id, v.row.params, v.row.prompt_token_ids,
                            v.row.output_token_ids + v.drafts[:j], v.row.generator,
                            None if v.bitmasks is None else v.bitmasks[j])
                for v in rows for j in range(len(v.drafts) + 1)]
    # a grammar's mask at position j assumes drafts < j accepted: used only if they are
    pen = Penalties.build([v.row for v in rows], logits.shape[-1])
    if pen is not None:  # each position's history: the row's, then the drafts before it
        logits = pen.positions([v.drafts for v in rows]).apply(logits)
    logits = _constrain(logits, pos_rows)
    greedy = logits.argmax(-1).tolist()
    random_pos = [i for i, r in enumerate(pos_rows) if r.params.temperature > 0]
    probs = {}
    if random_pos:
        idx = torch.tensor(random_pos)
        p = target_probs(logits[idx], [pos_rows[i] for i in random_pos])
        probs = {i: p[j] for j, i in enumerate(random_pos)}
    out_pos, out_tok, counts = [], [], []
    start = 0
    for v in rows:
        n = len(v.drafts)
        if v.row.params.temperature == 0:
            tokens = _accept_greedy(greedy[start:start + n + 1], v.drafts)
        else:
            tokens = _accept_random([probs[start + j] for j in range(n + 1)], v)
        out_pos.extend(range(start, start + len(tokens)))
        out_tok.extend(tokens)
        counts.append(len(tokens))
        start += n + 1
    lps = _top_logprobs(raw_logprobs[torch.tensor(out_pos)], torch.tensor(out_tok),
                        [pos_rows[i] for i in out_pos])
    result, k = [], 0
    for m in counts:
        result.append([SampledToken(out_tok[k + i], *lps[k + i]) for i in range(m)])
        k += m
    return result


def _accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return target[: a + 1]


def _accept_random(p: list[torch.Tensor], v: VerifyRow) -> list[int]:
    """p: the target distribution at each of the len(drafts) + 1 positions."""
    n = len(v.drafts)
    gen = v.row.generator
    if n and v.block:
        q = (v.draft_probs[:n].float() if v.draft_probs is not None else
             torch.nn.functional.one_hot(torch.tensor(v.drafts), p[0].shape[-1]).float())
        eta = torch.rand(n, generator=gen)
        tau, last = block_accept(torch.stack(p)[None], q[None], torch.tensor([v.drafts]),
                                 torch.tensor([n]), eta[None], torch.rand(1, generator=gen))
        return v.drafts[:int(tau[0])] + [int(last[0])]
    if n:
        d = torch.tensor(v.drafts)
        p_d = torch.stack([p[j][v.drafts[j]] for j in range(n)])
        q_d = (v.draft_probs[torch.arange(n), d] if v.draft_probs is not None
               else torch.ones(n))
        u = torch.rand(n, generator=gen)
        ok = (u * q_d < p_d).tolist()
        a = ok.index(False) if False in ok else n
    else:
        a = 0
    if a < n:
        q = (v.draft_probs[a] if v.draft_probs is not None
             else torch.nn.functional.one_hot(torch.tensor(v.drafts[a]), p[a].shape[-1]).float())
        residual = (p[a] - q).clamp(min=0)
        total = residual.sum()
        # p == q up to rounding: any token of p is then a correct draw
        last = _draw(residual / total if total > 0 else p[a], gen)
    else:
        last = _draw(p[n], gen)
    return v.drafts[:a] + [last]
