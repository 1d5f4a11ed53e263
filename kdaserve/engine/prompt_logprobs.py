"""Logprobs of the prompt's own tokens (vLLM's `prompt_logprobs`, the completions API's `echo`
with `logprobs`): the logits at prompt position p score prompt token p + 1.

Only requests that ask for them get logits at prompt positions, a prefill chunk at a time (so
at most a chunk × vocab of them per step); every other request still gets logits only where it
samples. Entries are indexed by prompt position: entry 0 is None (nothing predicts the first
token), entry i holds token i's logprob and the top-k of that position. A request that asks
for them skips prefix-cache hits (the cached positions would have no logits), as in vLLM.

This half is the request's side (the scheduler's): whether a request wants them and storing a
chunk's entries; plain Python, as the scheduler imports no torch. The runner's half, which
rows to score and scoring them, is prompt_logprob_scoring.py.
"""

from __future__ import annotations

from kdaserve.request import Request

# Prompt tokens scored per step, all requests together: each costs a logits row (vocab wide,
# plus its top-k), so without a cap a few echo requests of long prompts fill every step with
# scoring while the others' tokens wait. Chunks of such prompts are cut to what is left.
TOKENS_PER_STEP = 512


def wants_prompt_logprobs(req: Request) -> bool:
    return req.sampling_params.prompt_logprobs is not None


def leader_done(req: Request, requests: dict[str, Request]) -> bool:
    """Whether req may start: its prompt leader (if any) has computed the prompt, or is
    gone. A request's n sequences score their common prompt once, in the first one."""
    leader = requests.get(req.prompt_leader) if req.prompt_leader else None
    return leader is None or leader.num_computed_tokens >= leader.num_prompt_tokens


def chunk(req: Request, n: int, left: list[int]) -> int:
    """The tokens of req's next chunk given this step's scoring room `left` ([tokens], taken
    from as chunks are planned); 0: it waits for the next step. A request that scores no
    prompt tokens (or only decodes) is not cut."""
    if n <= 1 or not wants_prompt_logprobs(req):
        return n
    n = min(n, left[0])
    left[0] -= n
    return n


def record(req: Request, first: int, entries: list[dict]) -> None:
    """Store a chunk's entries at their prompt positions (a recomputed chunk, after a
    preemption, overwrites what it computed before)."""
    lst = req.prompt_logprobs
    if not lst:
        lst.append(None)
    del lst[first:]
    lst.extend(entries)
