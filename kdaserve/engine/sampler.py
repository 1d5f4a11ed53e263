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


def penalised(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


@dataclass
class Penalties:
    """Repetition, frequency and presence penalties of the penalised rows of a logits batch,
    as [P, V] state: built once from each row's history, then advanced token by token (the
    drafts of speculative decoding), so that penalising another position costs a few vector
    ops instead of rebuilding its history. Repetition divides positive logits (multiplies
    negative ones) of tokens seen in prompt or output; frequency and presence subtract
    count-proportional and flat amounts for tokens of the output."""

    index: torch.Tensor        # [P] the penalised rows' numbers in the logits batch
    seen: torch.Tensor         # [P, V] bool
    counts: torch.Tensor       # [P, V] float32
    rep: torch.Tensor          # [P, 1]
    freq: torch.Tensor         # [P, 1]
    pres: torch.Tensor         # [P, 1]

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab: int) -> Penalties | None:
        pen = [i for i, r in enumerate(rows) if penalised(r.params)]
        if not pen:
            return None
        counts = torch.zeros(len(pen), vocab)
        seen = torch.zeros(len(pen), vocab, dtype=torch.bool)
        for n, i in enumerate(pen):
            out = torch.tensor(rows[i].output_token_ids, dtype=torch.long).clamp(max=vocab - 1)
            counts[n] = torch.bincount(out, minlength=vocab).to(counts)
            if rows[i].params.repetition_penalty != 1.0:
                prompt = torch.tensor(rows[i].prompt_token_ids, dtype=torch.long)
                seen[n, prompt.clamp(max=vocab - 1)] = True
        seen |= counts > 0

        def col(name: str) -> torch.Tensor:
            return torch.tensor([[float(getattr(rows[i].params, name))] for i in pen])

        return cls(torch.tensor(pen), seen, counts, col("repetition_penalty"),
                   col("frequency_penalty"), col("presence_penalty"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A penalised copy of logits [S, V] (float32)."""
        logits = logits.clone()
        sub = logits[self.index]
        sub = torch.where(self.seen, torch.where(sub > 0, sub / self.rep, sub * self.rep), sub)
        logits[self.index] = sub - (self.freq * self.counts
                                    + self.pres * (self.counts > 0).to(sub))
        return logits

    def advance(self, tokens: torch.Tensor) -> None:
        """Each row of the batch appended tokens[row] to its output."""
        t = tokens[self.index].clamp(max=self.counts.shape[-1] - 1)
        rows = torch.arange(len(self.index))
        self.counts[rows, t] += 1
        self.seen[rows, t] = True

    def positions(self, drafts: list[list[int]]) -> Penalties:
        """The state at every verified position: row i becomes len(drafts[i]) + 1 rows, where
        row j has also seen drafts[i][:j] (positions packed back to back, as in verify)."""
        starts, pos = [], 0
        for d in drafts:
            starts.append(pos)
            pos += len(d) + 1
        idx, src, counts, seen = [], [], [], []
        for n, i in enumerate(self.index.tolist()):
            d = drafts[i]
            k = len(d) + 1
            extra = torch.zeros(k, self.counts.shape[-1])
            if d:
                hot = torch.zeros(len(d), self.counts.shape[-1])
                hot[torch.arange(len(d)), torch.tensor(d).clamp(max=hot.shape[-1] - 1)] = 1
                extra[1:] = hot.cumsum(0)
            c = self.counts[n] + extra
            counts.append(c)
            seen.append(self.seen[n] | (extra > 0))
            idx += range(starts[i], starts[i] + k)
            src += [n] * k
        s = torch.tensor(src)
        return Penalties(torch.tensor(idx), torch.cat(seen), torch.cat(counts),
                         self.rep[s], self.freq[s], self.pres[s])


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
        # inverse CDF: one uniform per row from that request's own stream (a draw per vocab
        # entry, as an exponential race takes, cost ~80 us a row at vocab 4,096)
        cdf = sub.softmax(-1).cumsum(-1)
        u = torch.tensor([_uniform(rows[i]) for i in idx.tolist()], dtype=torch.float32)
        x = (1.0 - u)[:, None] * cdf[:, -1:]            # in (0, total]: never a zero-mass token
        tokens[idx] = torch.searchsorted(cdf, x).clamp(max=cdf.shape[-1] - 1)[:, 0]
    return tokens


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """top-k, top-p and min-p, each applied only where set (batched)."""
    V = logits.shape[-1]
    top_k = torch.tensor([r.params.top_k or V for r in rows])
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float32)
    if bool((top_k < V).any()) or bool((top_p < 1).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        limit = probs.max(-1, keepdim=True).values * min_p[:, None]
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
        # as softmax computes it (max subtracted, then normalised): boundaries agree with a sort
        mx = vals[:, :1]
        probs = (vals - mx).exp() / (rows - mx).exp().sum(-1, keepdim=True)
        k, p = top_k[todo], top_p[todo]
        done = (probs.sum(-1) >= p) | (k <= K) if K < V else torch.ones_like(p, dtype=torch.bool)
        if bool(done.any()):
            drop = torch.arange(K)[None] >= k[done][:, None]
            pr = probs[done]
            drop |= pr.cumsum(-1) - pr >= p[done][:, None]          # mass strictly above
            drop[:, 0] = False
            kept = torch.full_like(rows[done], float("-inf")).scatter(
                1, order[done], vals[done].masked_fill(drop, float("-inf")))
            out[todo[done]] = kept
        todo = todo[~done]
        if not len(todo):
            break
    return out
