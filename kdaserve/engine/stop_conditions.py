"""When a request stops, checked after each token it is given: EOS (unless ignored), a stop
token id, max_tokens, or the model's length. Stop strings are the engine core's (they need
the detokenizer)."""

from __future__ import annotations

from collections.abc import Sequence

from kdaserve.outputs import SampledToken
from kdaserve.request import Request, RequestStatus


def append_tokens(req: Request, tokens: Sequence[SampledToken], max_model_len: int
                  ) -> RequestStatus | None:
    """Append a step's sampled tokens (one, or accepted drafts and a correction) to the
    request's output, stopping at the first that ends it: a stop inside an accepted run drops
    the tokens after it. Returns the status it finishes with (None: go on)."""
    for token in tokens:
        req.output_token_ids.append(token.token_id)
        if token.top_logprobs is not None:
            req.output_logprobs.append(token.top_logprobs)
        status = stop_status(req, max_model_len)
        if status is not None:
            return status
    return None


def stop_status(req: Request, max_model_len: int) -> RequestStatus | None:
    """The status the request finishes with after its last output token (None: go on);
    sets `req.stop_reason` for a stop token."""
    sp = req.sampling_params
    last = req.output_token_ids[-1]
    n_out = len(req.output_token_ids)
    if n_out >= sp.min_tokens:
        if not sp.ignore_eos and last in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if last in sp.stop_token_ids:
            req.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if n_out >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
