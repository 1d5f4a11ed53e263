"""Async scheduling: the scheduler plans step N+1 while step N still runs.

When step N is handed to the runner, each request that samples in it is advanced as if its
token were known: its computed count moves on and a PENDING token stands at the end of its
output (`dispatched`). Step N+1 then schedules that request's decode row with the PENDING
token as input, which the runner reads from what it sampled itself (engine/runner.py): the
scheduler never waits for step N's tokens to plan N+1. When step N's result arrives, the oldest
PENDING token of each request becomes the sampled one and the stop checks run (`resolve`); a
request that stopped there had its step N+1 row computed for nothing, and is finished anyway.

A request sits out a lookahead step (`may_look_ahead` false, it runs the step after, its token
known by then) when the step would:
- take a prefix-cache snapshot at a block boundary: its hash needs the PENDING token's value;
- pass its max_tokens or the model length (the last token is never computed twice);
- constrain its tokens with a grammar (the masks follow each sampled token).
Speculative decoding and worker processes keep the synchronous loop (engine/core.py).
"""

from __future__ import annotations

from kdaserve.engine import step_results
from kdaserve.engine.prompt_logprobs import record
from kdaserve.engine.stop_conditions import append_tokens
from kdaserve.outputs import ModelRunnerOutput, SchedulerOutput
from kdaserve.request import PENDING, Request, RequestStatus


def may_look_ahead(req: Request, block_size: int, prefix_caching: bool,
                   max_model_len: int) -> bool:
    """Whether a request with tokens in flight may run this step too."""
    if req.num_pending == 0:
        return True
    if req.sampling_params.guided is not None:
        return False
    if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_model_len:
        return False
    return not (prefix_caching and (req.num_computed_tokens + 1) % block_size == 0)


def dispatched(requests: dict[str, Request], out: SchedulerOutput) -> None:
    """Step `out` is running: advance its requests as its result would."""
    for seq in out.sequences:
        req = requests.get(seq.request_id)
        if req is None:
            continue
        req.num_computed_tokens += len(seq.token_ids)
        if seq.sample:
            req.output_token_ids.append(PENDING)
            req.num_pending += 1


def resolve(req: Request, tokens: list, max_model_len: int) -> RequestStatus | None:
    """Step N's sampled token (none: the row sat the step out) takes the place of the
    request's oldest PENDING one, with the stop checks of a synchronous step."""
    first = len(req.output_token_ids) - req.num_pending
    younger = req.output_token_ids[first + 1:]
    del req.output_token_ids[first:]
    req.num_pending = 0
    status = append_tokens(req, tokens, max_model_len) if tokens else None
    if status is None:
        req.output_token_ids += younger
        req.num_pending = len(younger)
    return status


def strip_pending(req: Request) -> None:
    """A failed step: the tokens in flight will never come (the request is recomputed)."""
    if req.num_pending:
        del req.output_token_ids[len(req.output_token_ids) - req.num_pending:]
        req.num_pending = 0


def settle_results(scheduler, out: SchedulerOutput, result: ModelRunnerOutput
                   ) -> list[Request]:
    """`Scheduler.update` for a step whose counts `dispatched` already advanced."""
    touched = []
    if result.cache.dropped_snapshots:
        scheduler.cache.drop_snapshots(result.cache.dropped_snapshots)
    reloaded = step_results.settle_cache_ops(scheduler, result)
    for seq in out.sequences:
        req = scheduler.requests.get(seq.request_id)
        if req is None:                                  # aborted or finished meanwhile
            continue
        if seq.request_id in result.prompt_logprobs:
            record(req, *result.prompt_logprobs[seq.request_id])
        if not seq.sample:
            step_results.commit(scheduler, req)
            continue
        tokens = [] if seq.request_id in reloaded else result.sampled.get(seq.request_id, [])
        status = resolve(req, tokens, scheduler.config.max_model_len)
        step_results.commit(scheduler, req)
        touched.append(req)
        if status is not None:
            scheduler.finish(req.request_id, status)
    return touched
