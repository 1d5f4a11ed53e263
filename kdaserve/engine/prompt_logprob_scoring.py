"""The runner's half of prompt logprobs (see prompt_logprobs.py for what they are): which
rows of a step's forward score prompt tokens, and their logprobs and top-k from the logits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kdaserve.engine.prompt_logprobs import wants_prompt_logprobs
from kdaserve.outputs import ScheduledSequence
from kdaserve.request import Request


@dataclass(frozen=True)
class PromptRows:
    """A chunk's prompt positions whose logits score prompt tokens: forward offsets `at` of
    `request_id`, scoring prompt tokens start+1 .. start+len(at)."""

    request_id: str
    start: int
    at: range
    next_tokens: list[int]
    k: int


def plan_rows(seqs: list[ScheduledSequence], starts: list[int],
              requests: Mapping[str, Request]) -> list[PromptRows]:
    """For each sequence of the step (forward offsets `starts`) that wants prompt logprobs and
    computes prompt positions before the last one: the rows to score."""
    rows = []
    for s, pos in zip(seqs, starts):
        req = requests.get(s.request_id)
        if req is None or not wants_prompt_logprobs(req) or s.num_draft_tokens:
            continue
        last = req.num_prompt_tokens - 1           # position P-1 predicts the first output
        n = min(len(s.token_ids), last - s.context_len)
        if n <= 0:
            continue
        c = s.context_len
        rows.append(PromptRows(s.request_id, c, range(pos, pos + n),
                               req.prompt_token_ids[c + 1: c + 1 + n],
                               req.sampling_params.prompt_logprobs or 0))
    return rows


def score(logits: torch.Tensor, rows: list[PromptRows]) -> dict[str, tuple[int, list[dict]]]:
    """logits [sum of len(r.at), V]: the rows' logits in order. Returns per request the
    position of its first scored prompt token and one {token: logprob} entry per token, the
    token's own logprob first, then the top-k of its position."""
    out: dict[str, tuple[int, list[dict]]] = {}
    at = 0
    for r in rows:
        n = len(r.at)
        lp = logits[at: at + n].float().log_softmax(-1)
        at += n
        own = lp.gather(1, torch.tensor(r.next_tokens)[:, None])[:, 0].tolist()
        entries = [{t: v} for t, v in zip(r.next_tokens, own)]
        if r.k:
            top = lp.topk(r.k, -1)
            for e, ids, vals in zip(entries, top.indices.tolist(), top.values.tolist()):
                for t, v in zip(ids, vals):
                    e.setdefault(t, v)
        out[r.request_id] = (r.start + 1, entries)
    return out
