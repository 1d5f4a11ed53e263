"""The OpenAI-compatible HTTP API over an `AsyncEngine`.

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
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kdaserve.engine.async_engine import AsyncEngine, EngineError
from kdaserve.image_io import ImageError, ImageLimits, check_count, load_image
from kdaserve.request import SamplingParams
from kdaserve.server.chat_output import ChatDelta, ChatOutput
from kdaserve.server.chat_plan import ChatPlan, plan_chat
from kdaserve.server.errors import (
    APIError,
    ServerDrainingError,
    engine_error,
    install_error_handlers,
)
from kdaserve.server.guards import ServerLimits, check_sequences, check_text, check_token_ids
from kdaserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kdaserve.server.middleware import DEFAULT_MAX_BODY_BYTES, AuthMiddleware, BodyLimitMiddleware
from kdaserve.server.prompt_logprobs import format_prompt_logprobs
from kdaserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from kdaserve.server.runs import (
    DONE,
    Choice,
    EventStream,
    Prompt,
    Run,
    all_or_none,
    json_response,
    merge,
    sse,
    unless_disconnected,
)
from kdaserve.structured.compiler import validate as validate_grammar
from kdaserve.tokenizer import Tokenizer
from kdaserve.vision_input import VisionInput, split_chat_images

__all__ = ["DEFAULT_MAX_BODY_BYTES", "APIError", "OpenAIServing", "build_app"]

logger = logging.getLogger("kdaserve")

# ---- the endpoints' logic ----------------------------------------------------------------------
class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, defaults: Mapping[str, Any], metrics: ServerMetrics,
                 limits: ServerLimits | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, vision: VisionInput | None = None,
                 image_limits: ImageLimits | None = None) -> None:
        self.engine = engine
        self.vision = vision                    # None: a text-only model
        self.image_limits = image_limits or ImageLimits()
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
        self.draining = False
        self.active: set[str] = set()          # engine request ids of runs in flight
        self._token_text: dict[int, str] = {}
        # tokenizing and chat templating run here, off the event loop (HF tokenizers and
        # tiktoken release the GIL while they work)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kdaserve-tokenize")

    async def _off_loop(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(fn, *args, **kwargs))

    async def encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        check_text(text, param, self.max_model_len, self.limits)
        return await self._off_loop(self.tokenizer.encode, text,
                                    add_special_tokens=add_special_tokens)

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

    async def _chat_images(self, messages: list[dict[str, Any]]
                           ) -> tuple[list[dict[str, Any]], list[Any]]:
        """image_url parts -> the model's image marker in the text, and the decoded images
        (each refusal a 400 that names the limit)."""
        try:
            messages, refs = split_chat_images(
                messages, self.vision.marker if self.vision is not None else None)
            if not refs:
                return messages, []
            check_count(len(refs), self.image_limits)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        images = []
        for i, j, url in refs:
            try:
                images.append(await self._off_loop(load_image, url, self.image_limits))
            except ImageError as exc:
                raise APIError(400, f"messages[{i}].content[{j}]: {exc}",
                               param="messages", code="invalid_image") from None
        return messages, images

    # ---- shared ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(400, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                logprobs: int | None, plan: ChatPlan | None = None) -> SamplingParams:
        try:
            guided = plan.guided if plan is not None else req.guided_decoding()
            params = req.sampling_params(max_tokens, logprobs, self.defaults, guided)
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0].rstrip(":")) from None
        if guided is not None:        # grammar errors the engine would find, answered here
            try:
                validate_grammar(guided)
            except ValueError as exc:
                raise APIError(400, str(exc), param="tools" if plan and plan.forced_calls
                               else req.guided_field()) from None
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
                raise engine_error(exc) from None
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

    # ---- completions -----------------------------------------------------------------------------
    async def _completion_prompts(self, prompt: Any, n: int) -> list[Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        check_sequences(len(items), n, self.limits)      # before tokenizing any of them
        prompts = []
        vocab = self.engine.info.vocab_size if self.engine.info else self.tokenizer.vocab_size
        for item in items:
            if isinstance(item, str):
                p = Prompt(await self.encode(item, "prompt", add_special_tokens=True), item)
            else:
                check_token_ids(item, vocab, "prompt")
                p = Prompt(list(item))
            if not p.token_ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            prompts.append(p)
        return prompts

    def _echo_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids)

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float] | None],
                             offset: int, as_ids: bool, out: CompletionLogprobs | None = None,
                             ) -> tuple[CompletionLogprobs, int]:
        """Appends to `out` (a new one if None). An entry None (the prompt's first token,
        which nothing predicts) gives a None logprob, as in OpenAI's echo."""
        out = out if out is not None else CompletionLogprobs()
        for tid, entry in zip(token_ids, lps):
            text = self.token_text(tid, as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(tid) if entry is not None else None)
            out.top_logprobs.append(None if entry is None else
                                    {self.token_text(t, as_ids): lp for t, lp in entry.items()})
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

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

    def _echo_logprobs(self, prompt: Prompt, lps: list[dict[int, float] | None] | None,
                       as_ids: bool) -> tuple[CompletionLogprobs, int]:
        """The prompt's tokens with their logprobs (echo with logprobs)."""
        return self._completion_logprobs(prompt.token_ids, lps or [None], 0, as_ids)

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        prompts = await self._completion_prompts(req.prompt, req.n)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.defaults.get(
            "max_tokens", 16)
        self._check_prompt_logprobs(req)
        params = self._params(req, max_tokens, req.logprobs)
        echo_lps = req.echo and req.logprobs is not None
        if echo_lps:          # the prompt's logits are computed for this request only
            params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
        for p in prompts:
            self._check_fits(len(p.token_ids), max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        runs = await self._start(request, request_id, prompts, params, bool(req.stream))
        if req.stream:
            return self._stream(self._completion_events(req, request_id, runs))
        results = await self._collect(request, runs)
        choices = []
        for i, (run, outs) in enumerate(zip(runs, results)):
            prefix = self._echo_text(run.prompt) if req.echo else ""
            for j, c in enumerate(outs):
                lp = None
                if req.logprobs is not None:
                    as_ids = req.return_tokens_as_token_ids
                    head, _ = self._echo_logprobs(run.prompt, c.prompt_logprobs, as_ids) \
                        if echo_lps else (None, 0)
                    lp, _ = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix),
                                                      as_ids, head)
                choices.append(CompletionChoice(
                    index=i * run.n + j, text=prefix + c.text, logprobs=lp,
                    prompt_logprobs=self._prompt_logprobs(req, run.prompt, c.prompt_logprobs),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    token_ids=c.token_ids if req.return_token_ids else None))
        usage = UsageInfo.of(sum(len(r.prompt.token_ids) for r in runs),
                             sum(len(c.token_ids) for outs in results for c in outs))
        return json_response(CompletionResponse(id=request_id, model=self.model_name,
                                                choices=choices, usage=usage))

    async def _completion_events(self, req: CompletionRequest, request_id: str,
                                 runs: list[Run]) -> AsyncIterator[str]:
        created = int(time.time())
        n = runs[0].n
        offsets = [0] * (len(runs) * n)
        generated = 0

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(CompletionChunk(id=request_id, created=created, model=self.model_name,
                                        choices=choices, usage=usage))

        deltas = merge(runs)
        # with logprobs the echo waits for the prompt's logprobs (in the first delta)
        echo_lps = req.echo and req.logprobs is not None
        try:
            if req.echo and not echo_lps:
                for i, run in enumerate(runs):
                    text = self._echo_text(run.prompt)
                    for j in range(n):
                        offsets[i * n + j] = len(text)
                        yield chunk([CompletionChoice(index=i * n + j, text=text)])
            async for i, d in deltas:
                index = i * n + d.index
                generated += len(d.new_token_ids)
                if echo_lps and d.prompt_logprobs is not None:
                    text = self._echo_text(runs[i].prompt)
                    lp, _ = self._echo_logprobs(runs[i].prompt, d.prompt_logprobs,
                                                req.return_tokens_as_token_ids)
                    offsets[index] = len(text)
                    yield chunk([CompletionChoice(index=index, text=text, logprobs=lp)])
                lp = None
                if req.logprobs is not None and d.new_token_ids:
                    lp, offsets[index] = self._completion_logprobs(
                        d.new_token_ids, d.new_logprobs or [], offsets[index],
                        req.return_tokens_as_token_ids)
                if not (d.new_text or d.finished or lp):
                    continue
                yield chunk([CompletionChoice(
                    index=index, text=d.new_text, logprobs=lp,
                    finish_reason=d.finish_reason if d.finished else None,
                    stop_reason=d.stop_reason if d.finished else None,
                    token_ids=d.new_token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield chunk([], UsageInfo.of(sum(len(r.prompt.token_ids) for r in runs),
                                             generated))
        except Exception as exc:
            yield self._error_event(exc)
        finally:
            await deltas.aclose()
            await self._close(runs)
        yield DONE

    # ---- chat completions ------------------------------------------------------------------------
    def _chat_logprobs(self, token_ids: list[int], lps: list[dict[int, float]], k: int,
                       as_ids: bool) -> list[ChatTokenLogprob]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            text = self.token_text(tid, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}

        out = []
        for tid, lp in zip(token_ids, lps):
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
            out.append(ChatTokenLogprob(**entry(tid, lp[tid]),
                                        top_logprobs=[TopLogprob(**entry(t, v)) for t, v in top]))
        return out

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        check_sequences(1, req.n, self.limits)
        try:
            plan = plan_chat(req, self.tool_call_parser, self.reasoning_parser)
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0].rstrip(":")) from None
        messages, images = await self._chat_images(req.messages)
        text = await self.render_chat(messages, req.add_generation_prompt,
                                      **plan.template_kwargs)
        prompt = Prompt(await self.encode(text, "messages", add_special_tokens=False), text)
        if images:
            try:
                ids, media = await self._off_loop(self.vision.expand, prompt.token_ids, images)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
            prompt = Prompt(ids, text, media)
        if not prompt.token_ids:
            raise APIError(400, "the rendered messages have no tokens", param="messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested is None:       # the default, or what fits if less
            self._check_fits(len(prompt.token_ids), 1, "messages")
            room = self.max_model_len - len(prompt.token_ids)
            requested = min(self.defaults.get("max_tokens", self.limits.default_max_tokens),
                            room)
        k = (req.top_logprobs or 0) if req.logprobs else None
        self._check_prompt_logprobs(req)
        params = self._params(req, requested, k, plan)
        self._check_fits(len(prompt.token_ids), requested, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        runs = await self._start(request, request_id, [prompt], params, bool(req.stream))
        if req.stream:
            return self._stream(self._chat_events(req, request_id, runs[0], plan))
        [outs] = await self._collect(request, runs)
        choices = []
        for j, c in enumerate(outs):
            reasoning, content, calls = plan.output(text, self.specials, eager=False).whole(
                c.text)
            message = ChatMessage(
                content=content if content or not calls else None,
                reasoning_content=reasoning if reasoning and plan.include_reasoning else None,
                tool_calls=[ToolCallOut(id=tc.id, function=FunctionCall(
                    name=tc.name, arguments=tc.arguments)) for tc in calls])
            choices.append(ChatChoice(
                index=j, message=message,
                logprobs=ChatLogprobs(content=self._chat_logprobs(
                    c.token_ids, c.logprobs, k, req.return_tokens_as_token_ids))
                if k is not None else None,
                finish_reason=plan.finish_reason(c.finish_reason, len(calls)),
                stop_reason=c.stop_reason,
                token_ids=c.token_ids if req.return_token_ids else None))
        usage = UsageInfo.of(len(prompt.token_ids), sum(len(c.token_ids) for c in outs))
        return json_response(ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage,
            prompt_logprobs=self._prompt_logprobs(req, prompt, outs[0].prompt_logprobs)))

    def _chat_delta(self, plan: ChatPlan, out: ChatOutput, text: str,
                    final: bool) -> DeltaMessage | None:
        d = out.feed(text) if text else None
        if final:
            last = out.finish()
            d = last if d is None else ChatDelta(d.reasoning + last.reasoning,
                                                 d.content + last.content, d.calls + last.calls)
        if d is None or not d:
            return None
        calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                               function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                 for c in d.calls]
        reasoning = d.reasoning if plan.include_reasoning else ""
        if not (d.content or reasoning or calls):
            return None
        return DeltaMessage(content=d.content or None, reasoning_content=reasoning or None,
                            tool_calls=calls or None)

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str,
                           run: Run, plan: ChatPlan) -> AsyncIterator[str]:
        created = int(time.time())
        k = (req.top_logprobs or 0) if req.logprobs else None
        generated = 0
        outputs = [plan.output(run.prompt.text or "", self.specials, eager=True)
                   for _ in range(run.n)]

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created,
                                            model=self.model_name, choices=choices, usage=usage))

        try:
            for j in range(run.n):
                yield chunk([ChatStreamChoice(index=j,
                                              delta=DeltaMessage(role="assistant", content=""))])
            while (d := await run.next()) is not None:
                generated += len(d.new_token_ids)
                lp = None
                if k is not None and d.new_token_ids:
                    lp = ChatLogprobs(content=self._chat_logprobs(
                        d.new_token_ids, d.new_logprobs or [], k, req.return_tokens_as_token_ids))
                out = outputs[d.index]
                delta = self._chat_delta(plan, out, d.new_text, d.finished)
                if not (delta or d.finished or lp):
                    continue
                yield chunk([ChatStreamChoice(
                    index=d.index, delta=delta or DeltaMessage(), logprobs=lp,
                    finish_reason=plan.finish_reason(d.finish_reason, out.num_calls)
                    if d.finished else None,
                    stop_reason=d.stop_reason if d.finished else None,
                    token_ids=d.new_token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield chunk([], UsageInfo.of(len(run.prompt.token_ids), generated))
        except Exception as exc:
            yield self._error_event(exc)
        finally:
            await self._close([run])
        yield DONE

    # ---- tokenizer endpoints ---------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if req.messages is not None:
            text = await self.render_chat(req.messages, req.add_generation_prompt)
            ids = await self.encode(text, "messages", add_special_tokens=False)
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


# ---- the app -------------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              generation_defaults: Mapping[str, Any] | None = None,
              metrics: ServerMetrics | None = None, limits: ServerLimits | None = None,
              public_metrics: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, vision: VisionInput | None = None,
              image_limits: ImageLimits | None = None) -> FastAPI:
    """`generation_defaults` (SamplingParams names) fill fields a request leaves out. With an
    API key every endpoint but /health needs it; `public_metrics` exempts /metrics too."""
    metrics = metrics or ServerMetrics()
    limits = limits or ServerLimits()
    serving = OpenAIServing(engine, tokenizer, served_model_name, max_model_len,
                            generation_defaults or {}, metrics, limits,
                            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                            vision=vision, image_limits=image_limits)
    app = FastAPI(title="kdaserve", docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        open_paths = {"/health", "/metrics"} if public_metrics else {"/health"}
        app.add_middleware(AuthMiddleware, api_key=api_key,   # outermost: runs first
                           open_paths=frozenset(open_paths))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response(ModelList(data=[ModelCard(id=served_model_name,
                                               max_model_len=max_model_len)]))

    def engine_stalled() -> bool:
        return engine.seconds_since_heartbeat() > limits.health_timeout_s

    @app.get("/health")
    async def health() -> Response:
        """200 only while the engine process runs and its loop reports in (a stalled or
        stopped engine turns this to 503 within --health-timeout) and no drain is under way."""
        if not engine.is_alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if engine_stalled():
            raise APIError(503, f"the engine has not reported for "
                           f"{engine.seconds_since_heartbeat():.1f} s", code="engine_stalled")
        if serving.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = None
        if engine.is_alive and not engine_stalled():
            with suppress(EngineError, asyncio.TimeoutError):
                stats = await asyncio.wait_for(engine.stats(), limits.health_timeout_s)
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return json_response(await serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return json_response(await serving.detokenize(body))

    return app
