"""A request's intake (EngineCore.add_request): its checks, which raise ValueError before
anything is queued (the server answers 400), then its n completions as scheduler requests, each
with its detokenizer and tracking. The completions of one request that asks for prompt
logprobs, and live requests scoring the same prompt (engine/prompt_sharing.py), share one
scoring: the first (the leader) scores it and the others take its result."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kdaserve.detokenizer import IncrementalDetokenizer
from kdaserve.media import MediaItem, check_media
from kdaserve.request import Request, SamplingParams, child_seed

if TYPE_CHECKING:
    from kdaserve.engine.core import EngineCore


def add_request(core: EngineCore, request_id: str, prompt_token_ids: list[int],
                params: SamplingParams, priority: int, arrival_time: float | None,
                cache_salt: str | None, extra_keys: tuple, group: str | None,
                media: Sequence[MediaItem], stream_text: bool) -> None:
    """As EngineCore.add_request says."""
    if core.tracker.has_request(request_id):
        raise ValueError(f"duplicate request id {request_id!r}")
    if params.stop and core.tokenizer is None:
        raise ValueError("stop strings need a tokenizer; this model directory has none")
    vocab = core.model_config.vocab_size
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if params.logit_bias and any(t >= vocab for t in params.logit_bias):
        raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
    if media:
        _check_media(core, media, prompt_token_ids)
        extra_keys = tuple(extra_keys) + tuple(m.placed_key() for m in media)
    if params.guided is not None:    # compiled (and cached) now: a bad spec is a 400
        core.executor.validate_guided(params.guided)
    first_output: list[int] = []
    drafts: list[int] = []
    if params.kv_transfer is not None:
        from kdaserve.disagg.handoff import check_request

        first_output = check_request(params, core.config.kv_transfer, vocab,
                                     len(prompt_token_ids))
        if first_output and core.transfer is not None:   # an import: drafts came along?
            drafts = core.transfer.arrived_drafts(params.kv_transfer.transfer_id)
    children = []
    # the request that scores the prompt for the others (the first of the n, or a live
    # request scoring the same prompt: prompt_sharing.py); the rest wait and take it
    key = ((tuple(prompt_token_ids), params.prompt_logprobs, cache_salt, tuple(extra_keys))
           if params.prompt_logprobs is not None and not media and params.kv_transfer is None
           else None)
    leader = core.tracker.scores.leader(key) if key is not None else None
    for i in range(params.n):
        child_params = params
        cid = request_id if params.n == 1 else f"{request_id}#{i}"
        follows = leader is not None
        if params.n > 1 or follows:
            seed = (params.seed if params.n == 1 or params.seed is None
                    else child_seed(params.seed, i))
            shared = {"prompt_logprobs": None} if follows else {}
            child_params = SamplingParams(**{**params.__dict__, "n": 1, "seed": seed,
                                             **shared})
        if params.prompt_logprobs is not None and leader is None:
            leader = cid
        req = Request(cid, list(prompt_token_ids), child_params, eos_token_ids=core.eos_ids,
                      output_token_ids=list(first_output), spec_token_ids=list(drafts),
                      priority=priority,
                      arrival_time=arrival_time or time.monotonic(),
                      cache_salt=cache_salt, extra_keys=tuple(extra_keys),
                      media=tuple(media), group=group or request_id,
                      prompt_leader=leader if follows else None)
        core.scheduler.add_request(req)  # validates; the first failure raises before any
        children.append(cid)
        detok = None
        if core.tokenizer is not None:
            detok = IncrementalDetokenizer(
                core.tokenizer, prompt_token_ids, child_params.skip_special_tokens,
                child_params.stop, child_params.include_stop_str_in_output,
                defer=not stream_text)
        core.tracker.track(cid, request_id, i, detok, leader, follows,
                           params.prompt_logprobs, key)
    core.tracker.group(request_id, children)


def _check_media(core: EngineCore, media: Sequence[MediaItem], prompt: list[int]) -> None:
    if core.vision_config is None:
        raise ValueError("this model has no vision tower; images are not supported")
    check_media(media, prompt, core.model_config.media_placeholder_token_id,
                core.vision_config.merge_size)
