"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

A sampled row draws one uniform from its own request's stream and takes the token at that
point of its processed distribution's CDF, so its token depends only on its own probabilities
and its own stream: a seeded request is reproducible whatever its batch mates are. On CPU the
compiled sampler (kdaserve/ops/sample_kernel.py) does the work for the batch; the torch form
here is its reference and serves everything else (logit_bias, grammar masks, other devices).

Legend: S rows to sample, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdaserve.engine.penalties import Penalties, device_tensor, penalised
from kdaserve.ops.sample_kernel import sample_rows_kernel
from kdaserve.outputs import SampledToken
from kdaserve.request import SamplingParams
from kdaserve.structured import bitmask as token_bitmask


@dataclass
class SamplingRow:
    """What the sampler needs of one request for one step."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    bitmask: torch.Tensor | None = None     # [W] int32: the tokens a grammar allows here


def _penalise(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    pen = Penalties.build(rows, logits.shape[-1])
    return logits if pen is None else pen.apply(logits)


def _constrain(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, then the grammar masks (structured outputs), where a row has them."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    masked = [i for i, r in enumerate(rows) if r.bitmask is not None]
    if not biased and not masked:
        return logits
    logits = logits.clone()
    V = logits.shape[-1]
    for i in biased:    # ids past the vocabulary are refused at the API edge; ignored here
        items = [(t, b) for t, b in rows[i].params.logit_bias.items() if 0 <= t < V]
        if items:
            ids, bias = zip(*items)
            logits[i, list(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if len(masked) == len(rows):
        token_bitmask.apply_(logits, torch.stack([r.bitmask for r in rows]))
    elif masked:
        sub = logits[masked]
        logits[masked] = token_bitmask.apply_(sub, torch.stack([rows[i].bitmask
                                                                for i in masked]))
    return logits


def _top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                  ) -> list[tuple[float | None, dict[int, float] | None]]:
    want = [r.params.logprobs for r in rows]
    if all(w is None for w in want):
        return [(None, None)] * len(rows)
    k = max(w or 0 for w in want)
    top = logprobs.topk(k, -1) if k else None
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    out = []
    for i, w in enumerate(want):
        if w is None:
            out.append((None, None))
            continue
        d = {int(tokens[i]): chosen[i]}
        if w and top is not None:
            for tid, lp in zip(top.indices[i, :w].tolist(), top.values[i, :w].tolist()):
                d.setdefault(tid, lp)
        out.append((chosen[i], d))
    return out


def sample(logits: torch.Tensor, rows: list[SamplingRow], fast: bool = True
           ) -> list[SampledToken]:
    """logits [S, V] (any float dtype) -> one token per row. fast: through the compiled
    sampler where it applies (CPU logits, no logit_bias or grammar mask); the torch form
    below is its reference."""
    logits = logits.float()
    wants_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = logits.log_softmax(-1) if wants_logprobs else None
    kernel = sample_rows_kernel() if fast and logits.device.type == "cpu" else None
    # greedy rows without penalties are an argmax: torch's is quicker than the call
    if kernel is not None and not any(r.params.logit_bias or r.bitmask is not None
                                      for r in rows) \
            and any(r.params.temperature > 0 or penalised(r.params) for r in rows):
        tokens = _sample_compiled(kernel, logits, rows)
    else:
        tokens = _sample_torch(logits, rows)
    if raw_logprobs is None:
        return [SampledToken(t) for t in tokens.tolist()]
    lps = _top_logprobs(raw_logprobs, tokens, rows)
    return [SampledToken(int(t), lp, top) for t, (lp, top) in zip(tokens.tolist(), lps)]


def _uniform(row: SamplingRow) -> float:
    """The row's uniform for its draw, from its own stream (one per sampled token)."""
    return float(torch.rand(1, generator=row.generator))


def _sample_compiled(kernel, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    V = logits.shape[-1]
    ps = [r.params for r in rows]
    return kernel(
        logits, [p.temperature for p in ps], [p.top_k or V for p in ps],
        [p.top_p for p in ps], [p.min_p for p in ps],
        [_uniform(r) if r.params.temperature > 0 else 0.0 for r in rows],
        [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in ps],
        [((r.prompt_token_ids if r.params.repetition_penalty != 1.0 else ()),
          r.output_token_ids) if penalised(r.params) else None for r in rows])


def _sample_torch(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    logits = _constrain(_penalise(logits, rows), rows)
    greedy_tok = logits.argmax(-1)
    tokens = greedy_tok
    if any(r.params.temperature > 0 for r in rows):
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        random_rows = (temps > 0).nonzero().flatten()
        tokens = greedy_tok.clone()
        idx = random_rows
        sub = logits[idx] / temps[idx, None]
        sub = _filter(sub, [rows[i] for i in idx.tolist()])
        u = torch.tensor([_uniform(rows[i]) for i in idx.tolist()], dtype=torch.float32)
        tokens[idx] = draw_rows(sub.softmax(-1), u)
    return tokens


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [R, V] (weights >= 0, any total) for its uniform u [R] in
    [0, 1): the inverse CDF at (1 - u) · total, never a zero-mass token. One uniform per
    draw from the request's own stream (a draw per vocabulary entry, as an exponential race
    takes, costs ~80 us a row at vocab 4,096)."""
    cdf = probs.cumsum(-1)
    x = (1.0 - u)[:, None] * cdf[:, -1:]                # in (0, total]
    return torch.searchsorted(cdf, x).clamp(max=cdf.shape[-1] - 1)[:, 0]


def _filter(logits: torch.Tensor, rows: list[SamplingRow], sort_all: bool = False
            ) -> torch.Tensor:
    """top-k, top-p and min-p, each applied only where set (batched). sort_all: the nucleus
    from one full sort, never reading a tensor back (the device form); else from the best
    candidates first (exact either way)."""
    V = logits.shape[-1]
    ks = [r.params.top_k or V for r in rows]
    ps = [r.params.top_p for r in rows]
    mins = [r.params.min_p for r in rows]
    dev = logits.device
    if any(k < V for k in ks) or any(p < 1 for p in ps):
        top_k, top_p = device_tensor(ks, torch.long, dev), device_tensor(ps, torch.float32, dev)
        logits = (_top_k_top_p_sorted if sort_all else _top_k_top_p)(logits, top_k, top_p)
    if any(m > 0 for m in mins):
        probs = logits.softmax(-1)
        limit = probs.max(-1, keepdim=True).values * device_tensor(mins, torch.float32, dev)[
            :, None]
        logits = logits.masked_fill(probs < limit, float("-inf"))
    return logits


# candidates looked at before sorting the whole vocabulary (a full sort of 163,840 logits per
# row is the sampled step's largest cost; the nucleus at usual temperatures is far smaller):
# rows whose nucleus is not inside the first count try the next
TOP_CANDIDATES = (256, 4096)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                 ) -> torch.Tensor:
    """Keeps each row's top_k tokens and its nucleus: the tokens whose strictly larger tokens
    hold less than top_p of the mass. Exact: a row is settled from its best K candidates when
    those already hold top_p of the mass or include all its top_k; K grows through
    TOP_CANDIDATES, then the whole vocabulary (a sort)."""
    V = logits.shape[-1]
    out = torch.full_like(logits, float("-inf"))
    todo = torch.arange(logits.shape[0])
    for K in [k for k in TOP_CANDIDATES if k < V] + [V]:
        rows = logits[todo]
        if K < V:
            vals, order = rows.topk(K, -1)
        else:
            vals, order = rows.sort(-1, descending=True)
        probs = _sorted_probs(rows, vals)
        k, p = top_k[todo], top_p[todo]
        done = (probs.sum(-1) >= p) | (k <= K) if K < V else torch.ones_like(p, dtype=torch.bool)
        if bool(done.any()):
            out[todo[done]] = _keep(rows[done], vals[done], order[done], probs[done], k[done],
                                    p[done])
        todo = todo[~done]
        if not len(todo):
            break
    return out


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    """The same set as _top_k_top_p from one sort of the whole vocabulary: shapes fixed, no
    read-back (a GPU sorts 163,840 logits a row quickly)."""
    vals, order = logits.sort(-1, descending=True)
    return _keep(logits, vals, order, _sorted_probs(logits, vals), top_k, top_p)


def _sorted_probs(rows: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Probabilities of the sorted values, as softmax computes them (max subtracted, then
    normalised over the whole row): boundaries agree whatever the number of candidates."""
    mx = vals[:, :1]
    return (vals - mx).exp() / (rows - mx).exp().sum(-1, keepdim=True)


def _keep(rows: torch.Tensor, vals: torch.Tensor, order: torch.Tensor, probs: torch.Tensor,
          k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """rows with only the kept candidates: within top k, and mass strictly above < top p."""
    drop = torch.arange(vals.shape[-1], device=vals.device)[None] >= k[:, None]
    drop |= probs.cumsum(-1) - probs >= p[:, None]
    drop[:, 0] = False
    return torch.full_like(rows, float("-inf")).scatter(
        1, order, vals.masked_fill(drop, float("-inf")))
