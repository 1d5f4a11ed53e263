"""vLLM's `prompt_logprobs` extra on the HTTP API: each prompt token's log-probability and the
top-N alternatives at its position, as vLLM returns them (a list over prompt positions, None
for the first, each a dict token id (str) -> {logprob, rank, decoded_token}).

The engine computes them only for requests that ask (engine/prompt_logprobs.py). Streams do not
carry them (as vLLM): such a request is refused with a 400 before it starts.
"""

from __future__ import annotations

from collections.abc import Callable

from kdaserve.server.protocol_responses import PromptLogprob

PromptLogprobs = list[dict[str, PromptLogprob] | None]


def format_prompt_logprobs(token_ids: list[int], lps: list[dict[int, float] | None] | None,
                           top_n: int, decode: Callable[[int], str]) -> PromptLogprobs:
    """lps[i]: token id -> logprob at prompt position i: the top_n alternatives, plus the prompt's
    own token when it is not among them. Ranks are 1-based among the alternatives; a prompt
    token outside them has none here (its rank in the whole vocabulary is not computed)."""
    out: PromptLogprobs = []
    for i, tid in enumerate(token_ids):
        entry = lps[i] if lps is not None and i < len(lps) else None
        if entry is None:
            out.append(None)
            continue
        top = sorted(entry, key=lambda t: -entry[t])[:top_n]   # the engine may hold more
        rank = {t: r + 1 for r, t in enumerate(top)}
        first = [tid] if tid in entry else []       # the prompt's token leads, as vLLM's
        out.append({str(t): PromptLogprob(logprob=entry[t], rank=rank.get(t),
                                          decoded_token=decode(t))
                    for t in first + [t for t in top if t != tid]})
    return out
