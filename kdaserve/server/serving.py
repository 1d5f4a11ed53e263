"""What every OpenAI endpoint shares: the engine, the tokenizer (off the event loop), the
request checks, starting and collecting runs, and the tokenizer endpoints. The completions and
chat endpoints extend it (serving_completions.py, serving_chat.py).

A request is submitted to the engine and its first delta awaited before any response byte is
sent, so input errors the engine finds become a 400 even for streams. From then on a client
that goes away (non-stream or stream) cancels its handler, which aborts the engine request and
returns its pages and slot to the pool.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kdaserve.engine.async_engine import AsyncEngine
from kdaserve.engine.engine_errors import EngineError
from kdaserve.image_io import ImageLimits
from kdaserve.request import SamplingParams
from kdaserve.server.chat_plan import ChatPlan
from kdaserve.server.errors import APIError, ServerDrainingError, bad_request, engine_error
from kdaserve.server.guards import ServerLimits, check_sequences, check_text, check_token_ids
from kdaserve.server.image_decoding import ImageDecoder
from kdaserve.server.metrics import ServerMetrics
from kdaserve.server.prompt_logprobs import format_prompt_logprobs
from kdaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kdaserve.server.protocol_responses import DetokenizeResponse, TokenizeResponse
from kdaserve.server.runs import (
    Choice,
    EventStream,
    Prompt,
    Run,
    all_or_none,
    sse,
    unless_disconnected,
)
from kdaserve.structured.compiler import validate as validate_grammar
from kdaserve.tokenizer import Tokenizer
from kdaserve.user_text import SpecialTextGuard
from kdaserve.vision_input import VisionInput

logger = logging.getLogger("kdaserve")


class ServingBase:
    """The state and steps the endpoints share; one instance serves them all (app.py's
    OpenAIServing)."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, defaults: Mapping[str, Any], metrics: ServerMetrics,
                 limits: ServerLimits | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, vision: VisionInput | None = None,
                 image_limits: ImageLimits | None = None, strict_schemas: bool = True) -> None:
        self.engine = engine
        self.strict_schemas = strict_schemas    # a JSON schema's objects closed unless it says
        self.vision = vision                    # None: a text-only model
        self.image_limits = image_limits or ImageLimits()
        self.images = ImageDecoder(self.image_limits)   # its own pool, not the tokenizer's
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        # special tokens' text: dropped from what parsers leave (they need them kept to see
        # their markers)
        self.specials = [tokenizer.decode([i], skip_special_tokens=False)
                         for i in sorted(tokenizer.special_token_ids)]
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.defaults = dict(defaults)
        self.metrics = metrics
        self.limits = limits or ServerLimits()
        # special tokens typed in user text stay text (kdaserve/user_text.py)
        self.guard = None if self.limits.allow_special_tokens else SpecialTextGuard(self.specials)
        self.draining = False
        self.active: set[str] = set()          # engine request ids of runs in flight
        self._token_text: dict[int, str] = {}
        # tokenizing and chat templating run here, off the event loop (HF tokenizers and
        # tiktoken release the GIL while they work)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kdaserve-tokenize")

    async def _off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, param: str, add_special_tokens: bool,
                     rendered: bool = False) -> list[int]:
        """rendered: a chat template's output (its control tokens are real; the user strings
        in it were marked by `user_messages`); otherwise user text."""
        check_text(text, param, self.max_model_len, self.limits)
        guarded = self.guard is not None
        return await self._off_loop(self.tokenizer.encode, text,
                                    add_special_tokens=add_special_tokens,
                                    specials=rendered or not guarded,
                                    marked=rendered and guarded)

    def user_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages with special tokens' text marked, before anything (image markers, the
        template) adds real ones."""
        return self.guard.mark(messages) if self.guard is not None else messages

    async def render_chat(self, messages: list[dict[str, Any]],
                          add_generation_prompt: bool, **template_kwargs: Any) -> str:
        try:
            text = await self._off_loop(self.tokenizer.apply_chat_template, messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        check_text(text, "messages", self.max_model_len, self.limits)
        return text

    # ---- shared ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(400, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                logprobs: int | None, plan: ChatPlan | None = None) -> SamplingParams:
        try:
            guided = (plan.guided if plan is not None
                      else req.guided_decoding(self.strict_schemas))
            params = req.sampling_params(max_tokens, logprobs, self.defaults, guided)
        except ValueError as exc:
            raise bad_request(exc) from None
        if guided is not None:        # grammar errors the engine would find, answered here
            guided.field = ("tools" if plan and plan.forced_calls else req.guided_field()) or ""
            try:
                validate_grammar(guided)
            except ValueError as exc:
                raise APIError(400, str(exc), param=guided.field or None) from None
        if plan is not None and plan.keeps_special_tokens:
            params.skip_special_tokens = False
        vocab = self.engine.info.vocab_size if self.engine.info else self.tokenizer.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab})",
                           param="logit_bias")
        return params

    def _check_fits(self, prompt_len: int, max_tokens: int, what: str) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400, f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but {prompt_len + max_tokens} were requested ({prompt_len} in the {what}, "
                f"{max_tokens} for the completion); shorten the {what} or lower max_tokens",
                param="max_tokens", code="context_length_exceeded")

    async def _answer_hold(self, prompts: list[Prompt], params: SamplingParams
                           ) -> Response | None:
        """Disaggregation's hit query (kv_transfer_params.hold, from `kdaserve proxy`): the
        leading tokens of the request's prompt this decode instance holds, pinned for the
        import that follows; None for any other request. A prompt with images, or several
        prompts, hold nothing (the import finds its own hit; the whole prompt travels)."""
        kt = params.kv_transfer
        if kt is None or not kt.hold:
            return None
        held = 0
        if len(prompts) == 1 and not prompts[0].media:
            try:
                held = await self.engine.hold_prefix(kt.transfer_id, prompts[0].token_ids)
            except ValueError as exc:
                raise APIError(400, str(exc), param="kv_transfer_params") from None
            except EngineError as exc:
                raise engine_error(exc) from None
        return JSONResponse({"transfer_id": kt.transfer_id, "held_tokens": held})

    async def _start(self, request: Request, request_id: str, prompts: list[Prompt],
                     params: SamplingParams, stream: bool) -> list[Run]:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        check_sequences(len(prompts), params.n, self.limits)
        timeout = self.limits.request_timeout_s
        deadline = time.monotonic() + timeout if timeout else None
        runs = [Run(self.engine, f"{request_id}-{i}", p, params, self.metrics.timer(),
                    group=request_id, deadline=deadline, stream_text=stream)
                for i, p in enumerate(prompts)]
        self.active.update(r.request_id for r in runs)
        try:
            await unless_disconnected(request, all_or_none(r.start() for r in runs))
        except BaseException as exc:
            await self._close(runs)
            if isinstance(exc, (ValueError, EngineError)):
                err = engine_error(exc)
                field = params.guided.field if params.guided is not None else ""
                if field and err.status == 400 and str(exc).startswith(f"{field}: "):
                    err.param = field           # the grammar's budget, checked in the engine
                raise err from None
            raise
        return runs

    async def end_all(self, why: str) -> None:
        """End every run in flight with an error (their streams send an error event)."""
        for rid in list(self.active):
            await self.engine.abort(rid, ServerDrainingError(why))

    async def _close(self, runs: list[Run]) -> None:
        self.active.difference_update(r.request_id for r in runs)
        for run in runs:
            with suppress(Exception):
                await run.close()

    async def _collect(self, request: Request, runs: list[Run]) -> list[list[Choice]]:
        try:
            return await unless_disconnected(request, all_or_none(r.collect() for r in runs))
        except (ValueError, EngineError) as exc:
            raise engine_error(exc) from None
        finally:
            await self._close(runs)

    def _stream(self, body: AsyncIterator[str]) -> StreamingResponse:
        return EventStream(body, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _error_event(exc: Exception) -> str:
        err = engine_error(exc) if isinstance(exc, (ValueError, EngineError)) else APIError(
            500, "internal server error")
        if err.status == 500:
            logger.error("stream failed: %s", exc)
        return sse(err.body())

    def token_text(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    @staticmethod
    def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not supported with stream",
                           param="prompt_logprobs")

    def _prompt_logprobs(self, req: CompletionRequest | ChatCompletionRequest, prompt: Prompt,
                         lps: list[dict[int, float] | None] | None):
        if req.prompt_logprobs is None:
            return None
        return format_prompt_logprobs(prompt.token_ids, lps, req.prompt_logprobs,
                                      lambda t: self.tokenizer.decode([t]))

    # ---- tokenizer endpoints ---------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if req.messages is not None:
            text = await self.render_chat(self.user_messages(req.messages),
                                          req.add_generation_prompt)
            ids = await self.encode(text, "messages", add_special_tokens=False, rendered=True)
        else:
            ids = await self.encode(req.prompt or "", "prompt", req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        check_token_ids(req.tokens, self.tokenizer.vocab_size, "tokens")
        if len(req.tokens) > self.max_model_len * 4:
            raise APIError(400, f"at most {self.max_model_len * 4} tokens can be detokenized",
                           param="tokens")
        text = await self._off_loop(self.tokenizer.decode, req.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
