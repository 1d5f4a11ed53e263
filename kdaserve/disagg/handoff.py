"""Which cache operations a request's transfer needs, for the scheduler (torch-free).

- Before a prefill instance computes a prompt, the decode instance that will continue it
  answers the hit query (`hold`): how many leading tokens of the prompt it holds (its own
  prefix-cache hit, pinned under the transfer id until the import takes it; cache/holds.py).
  The prefill instance is told that count (`held_tokens`) and sends only the tokens after
  it: the pushes and the last part start there (`start`), in any block size of its own.
- While a prefill instance computes a prompt in chunks, each step pushes the blocks the steps
  before it completed (`push_op`: push mode, the network busy while the next chunk computes).
- A prefill instance's request that ended by length (it computed the prompt and its first
  token, as the proxy asked with max_tokens = 1) pushes the prompt's cache: `send_op`, built
  from the blocks and slot it held, just before the scheduler frees them. One that ended
  otherwise (a stop, an abort, an error) sends nothing: there is nothing to continue.
- A decode instance's request that imports is admitted with its prompt already computed and
  the prefill instance's first token as its first output: `receive_op` fills the blocks and
  the slot it was given before the step computes that token, all but the blocks of a prefix
  hit on the decode instance (decode-side prefix caching: whatever the two block sizes, the
  hit is in this instance's blocks, and the transfer's state replaces the hit's snapshot).
"""

from __future__ import annotations

from typing import Protocol

from kdaserve.cache.ops import PushBlocks, ReceiveRequest, SendRequest
from kdaserve.config import KVTransferConfig
from kdaserve.disagg.wire import token_hash
from kdaserve.request import Request, RequestStatus, SamplingParams, SamplingParamsError


class _Holds(Protocol):
    def block_ids(self, request_id: str) -> list[int]: ...

    def slot(self, request_id: str) -> int: ...


def imports(req: Request) -> bool:
    kt = req.sampling_params.kv_transfer
    return kt is not None and kt.is_import


def exports(req: Request) -> bool:
    kt = req.sampling_params.kv_transfer
    return kt is not None and kt.is_export


def start(req: Request) -> tuple[int, int]:
    """Where an export's sending starts: (tokens, parts) as if the tokens the decode instance
    holds had been pushed already."""
    kt = req.sampling_params.kv_transfer
    return (kt.held_tokens if kt is not None else 0), 0


def send_op(req: Request, cache: _Holds, pushed: tuple[int, int] | None = None
            ) -> SendRequest | None:
    """`pushed`: (tokens, parts) already pushed while the prompt was computed (or held on
    the decode side)."""
    kt = req.sampling_params.kv_transfer
    if kt is None or not kt.is_export or req.status != RequestStatus.FINISHED_LENGTH:
        return None
    n = req.num_prompt_tokens
    if req.num_computed_tokens < n or not req.output_token_ids:
        return None
    rid = req.request_id
    return SendRequest(rid, kt.transfer_id, kt.peer, tuple(cache.block_ids(rid)),
                       cache.slot(rid), n, token_hash(req.prompt_token_ids),
                       req.output_token_ids[0], *(pushed or start(req)),
                       draft_token_ids=tuple(req.spec_token_ids),
                       held_tokens=kt.held_tokens)


def push_op(req: Request, block_ids: list[int], block_size: int,
            pushed: tuple[int, int] | None) -> PushBlocks | None:
    """Push mode: the prompt's blocks written by earlier steps and not pushed yet (up to a
    block boundary; the last, partial block goes with the states)."""
    kt = req.sampling_params.kv_transfer
    if kt is None or not kt.is_export:
        return None
    done = min(req.num_computed_tokens, req.num_prompt_tokens) // block_size * block_size
    begin, part = pushed or start(req)
    if done <= begin or req.num_computed_tokens >= req.num_prompt_tokens:
        return None
    return PushBlocks(req.request_id, kt.transfer_id, kt.peer,
                      tuple(block_ids[begin // block_size:done // block_size]), begin, done,
                      part, kt.held_tokens)


def receive_op(req: Request, block_ids: list[int], slot: int, held_tokens: int = 0
               ) -> ReceiveRequest:
    """`held_tokens`: a prefix hit on this instance (blocks it already holds, shared); the
    transfer's state, taken at the end of the prompt, replaces the hit's snapshot."""
    kt = req.sampling_params.kv_transfer
    assert kt is not None and kt.first_token_id is not None
    return ReceiveRequest(req.request_id, kt.transfer_id, tuple(block_ids), slot,
                          req.num_prompt_tokens, token_hash(req.prompt_token_ids),
                          kt.first_token_id, held_tokens)


def check_request(params: SamplingParams, config: KVTransferConfig | None,
                  vocab_size: int, num_prompt_tokens: int) -> list[int]:
    """A request's kv_transfer_params against this instance's role; the output tokens it
    starts with (an import: the prefill instance's first token). ValueError (HTTP 400)."""
    kt = params.kv_transfer
    assert kt is not None
    role = config.role if config is not None else None
    if kt.hold:
        raise SamplingParamsError("kv_transfer_params with 'hold' is the hit query: a decode "
                                  "instance's server answers it, no request runs",
                                  "kv_transfer_params")
    if kt.held_tokens >= num_prompt_tokens:
        raise SamplingParamsError("kv_transfer_params.held_tokens must be less than the "
                                  f"prompt's {num_prompt_tokens} tokens", "kv_transfer_params")
    if kt.is_export and role != "prefill":
        raise SamplingParamsError("kv_transfer_params with 'peer' (export) needs a prefill "
                                  f"instance (serve --role prefill); this one is "
                                  f"{role or 'colocated'}", "kv_transfer_params")
    if kt.is_import:
        if role != "decode":
            raise SamplingParamsError("kv_transfer_params with 'first_token_id' (import) needs "
                                      "a decode instance (serve --role decode); this one is "
                                      f"{role or 'colocated'}", "kv_transfer_params")
        if not 0 <= kt.first_token_id < vocab_size:
            raise SamplingParamsError(f"kv_transfer_params.first_token_id must be in [0, "
                                      f"{vocab_size})", "kv_transfer_params")
        if params.max_tokens is not None and params.max_tokens < 2:
            raise SamplingParamsError("an imported request continues after its first token: "
                                      "max_tokens must be at least 2", "max_tokens")
        if params.prompt_logprobs is not None:
            raise SamplingParamsError("prompt_logprobs cannot be computed from an imported "
                                      "cache", "prompt_logprobs")
        if params.logprobs is not None:     # the first token's were the prefill side's
            raise SamplingParamsError("logprobs are not served on an imported request (the "
                                      "proxy sends such requests whole)", "logprobs")
        return [kt.first_token_id]
    return []
