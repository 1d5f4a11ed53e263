"""The OpenAI-compatible HTTP API over an `AsyncEngine`.

A request is submitted to the engine and its first delta awaited before any response byte is
sent, so input errors the engine finds become a 400 even for streams. From then on a client
that goes away (non-stream or stream) cancels its handler, which aborts the engine request and
returns its pages and slot to the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kdaserve.engine.async_engine import AsyncEngine, EngineDeadError, EngineError, QueueFullError
from kdaserve.outputs import RequestDelta
from kdaserve.request import SamplingParams
from kdaserve.server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
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
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
)
from kdaserve.tokenizer import Tokenizer

logger = logging.getLogger("kdaserve")

DEFAULT_MAX_BODY_BYTES = 16 << 20
OPEN_PATHS = frozenset({"/health", "/metrics"})   # reachable without the API key

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error", 500: "internal_error",
                503: "service_unavailable_error"}
_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


# ---- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.error_type,
                                             param=self.param, code=self.code))

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def _engine_error(exc: Exception) -> APIError:
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    return APIError(500, str(exc), code="engine_error")


class _ClientGone(Exception):
    """The client disconnected before the response; nobody will read what we send."""


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        why = errors[0].get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {why}").response()

    def where(err: Mapping[str, Any]) -> str:
        return ".".join(str(p) for p in err.get("loc", ()) if p != "body")

    message = "; ".join(f"{where(e) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:5])
    param = where(errors[0]) if errors else None
    return APIError(400, message or "invalid request", param=param or None).response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return APIError(exc.status_code, message).response(headers=exc.headers)


async def _on_client_gone(request: Request, exc: _ClientGone) -> Response:
    return Response(status_code=499)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, "internal server error").response()


# ---- middleware --------------------------------------------------------------------------------
class _AuthMiddleware:
    """Bearer-token check for everything but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):
                err = APIError(401, "missing or invalid API key", code="invalid_api_key")
                await err.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for bodies over the limit, by Content-Length and by the bytes actually received."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        too_big = APIError(413, f"the request body is larger than {self.max_bytes} bytes",
                           code="request_too_large")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await APIError(400, "invalid Content-Length").response()(scope, receive, send)
                return
            if declared > self.max_bytes:
                await too_big.response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return                       # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_big.response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# ---- helpers -----------------------------------------------------------------------------------
async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`; if the client disconnects first, cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise _ClientGone()
    return task.result()


async def _all_or_none(aws: Iterable[Awaitable[T]]) -> list[T]:
    """gather(), but a failure cancels (and waits for) the others before it propagates."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _json(body: BaseModel, status: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


class _EventStream(StreamingResponse):
    """SSE response that stops its body as soon as the client disconnects, whatever the ASGI
    spec version (Starlette only listens for that below 2.4), and always closes the body so the
    engine request is aborted."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass                  # the connection is gone
                    except Exception:
                        logger.exception("stream failed")
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None = None


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, d: RequestDelta) -> None:
        self.text += d.new_text
        self.token_ids += d.new_token_ids
        self.logprobs += d.new_logprobs or []
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class _Run:
    """One engine request: a prompt and its n completions."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt: _Prompt,
                 params: SamplingParams, timer: RequestTimer) -> None:
        self.prompt = prompt
        self.n = params.n
        self._gen = engine.generate(request_id, prompt.token_ids, params)
        self._first: RequestDelta | None = None
        self._timer = timer
        self._reasons: list[str] = []
        self._accepted = False

    async def start(self) -> None:
        """Submit, and wait for the first delta (input errors raise here)."""
        self._first = await self._gen.__anext__()
        self._accepted = True

    async def next(self) -> RequestDelta | None:
        """The next delta, or None once all n completions finished."""
        if self._first is not None:
            d, self._first = self._first, None
        else:
            try:
                d = await self._gen.__anext__()
            except StopAsyncIteration:
                return None
        self._timer.on_tokens(d.index, len(d.new_token_ids))
        if d.finished:
            self._reasons.append(d.finish_reason or "stop")
            if len(self._reasons) == self.n:
                self._timer.finished(self._reasons)
        return d

    async def close(self) -> None:
        if self._accepted and len(self._reasons) < self.n:
            self._timer.aborted()
        await self._gen.aclose()

    async def collect(self) -> list[_Choice]:
        choices = [_Choice() for _ in range(self.n)]
        while (d := await self.next()) is not None:
            choices[d.index].add(d)
        return choices


async def _merge(runs: list[_Run]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(run index, delta) from all runs, in arrival order."""
    if len(runs) == 1:
        while (d := await runs[0].next()) is not None:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | Exception | None]] = asyncio.Queue()

    async def pump(i: int, run: _Run) -> None:
        try:
            while (d := await run.next()) is not None:
                queue.put_nowait((i, d))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        live = len(runs)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the endpoints' logic ----------------------------------------------------------------------
class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int, defaults: Mapping[str, Any], metrics: ServerMetrics) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.defaults = dict(defaults)
        self.metrics = metrics
        self._token_text: dict[int, str] = {}

    # ---- shared ---------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(400, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def _params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                logprobs: int | None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, self.defaults)
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    def _check_fits(self, prompt_len: int, max_tokens: int, what: str) -> None:
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(
                400, f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but {prompt_len + max_tokens} were requested ({prompt_len} in the {what}, "
                f"{max_tokens} for the completion); shorten the {what} or lower max_tokens",
                param="max_tokens", code="context_length_exceeded")

    async def _start(self, request: Request, request_id: str, prompts: list[_Prompt],
                     params: SamplingParams) -> list[_Run]:
        runs = [_Run(self.engine, f"{request_id}-{i}", p, params, self.metrics.timer())
                for i, p in enumerate(prompts)]
        try:
            await _unless_disconnected(request, _all_or_none(r.start() for r in runs))
        except BaseException as exc:
            await self._close(runs)
            if isinstance(exc, (ValueError, EngineError)):
                raise _engine_error(exc) from None
            raise
        return runs

    async def _close(self, runs: list[_Run]) -> None:
        for run in runs:
            with suppress(Exception):
                await run.close()

    async def _collect(self, request: Request, runs: list[_Run]) -> list[list[_Choice]]:
        try:
            return await _unless_disconnected(request, _all_or_none(r.collect() for r in runs))
        except (ValueError, EngineError) as exc:
            raise _engine_error(exc) from None
        finally:
            await self._close(runs)

    def _stream(self, body: AsyncIterator[str]) -> StreamingResponse:
        return _EventStream(body, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _error_event(exc: Exception) -> str:
        err = _engine_error(exc) if isinstance(exc, (ValueError, EngineError)) else APIError(
            500, "internal server error")
        if err.status == 500:
            logger.error("stream failed: %s", exc)
        return _sse(err.body())

    def token_text(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"token_id:{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    # ---- completions -----------------------------------------------------------------------------
    def _completion_prompts(self, prompt: Any) -> list[_Prompt]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt must not be empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                p = _Prompt(self.tokenizer.encode(item, add_special_tokens=True), item)
            else:
                p = _Prompt(list(item))
            if not p.token_ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            prompts.append(p)
        return prompts

    def _echo_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.token_ids)

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, float]],
                             offset: int, as_ids: bool) -> tuple[CompletionLogprobs, int]:
        out = CompletionLogprobs()
        for tid, entry in zip(token_ids, lps):
            text = self.token_text(tid, as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(entry.get(tid))
            out.top_logprobs.append({self.token_text(t, as_ids): lp for t, lp in entry.items()})
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported", param="echo")
        prompts = self._completion_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.defaults.get(
            "max_tokens", 16)
        params = self._params(req, max_tokens, req.logprobs)
        for p in prompts:
            self._check_fits(len(p.token_ids), max_tokens, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        runs = await self._start(request, request_id, prompts, params)
        if req.stream:
            return self._stream(self._completion_events(req, request_id, runs))
        results = await self._collect(request, runs)
        choices = []
        for i, (run, outs) in enumerate(zip(runs, results)):
            prefix = self._echo_text(run.prompt) if req.echo else ""
            for j, c in enumerate(outs):
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._completion_logprobs(c.token_ids, c.logprobs, len(prefix),
                                                      req.return_tokens_as_token_ids)
                choices.append(CompletionChoice(
                    index=i * run.n + j, text=prefix + c.text, logprobs=lp,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    token_ids=c.token_ids if req.return_token_ids else None))
        usage = UsageInfo.of(sum(len(r.prompt.token_ids) for r in runs),
                             sum(len(c.token_ids) for outs in results for c in outs))
        return _json(CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                        usage=usage))

    async def _completion_events(self, req: CompletionRequest, request_id: str,
                                 runs: list[_Run]) -> AsyncIterator[str]:
        created = int(time.time())
        n = runs[0].n
        offsets = [0] * (len(runs) * n)
        generated = 0

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return _sse(CompletionChunk(id=request_id, created=created, model=self.model_name,
                                        choices=choices, usage=usage))

        deltas = _merge(runs)
        try:
            if req.echo:
                for i, run in enumerate(runs):
                    text = self._echo_text(run.prompt)
                    for j in range(n):
                        offsets[i * n + j] = len(text)
                        yield chunk([CompletionChoice(index=i * n + j, text=text)])
            async for i, d in deltas:
                index = i * n + d.index
                generated += len(d.new_token_ids)
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
        yield _DONE

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
        try:
            text = self.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        prompt = _Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)
        if not prompt.token_ids:
            raise APIError(400, "the rendered messages have no tokens", param="messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested is None:       # as much as fits, or the model's default if smaller
            self._check_fits(len(prompt.token_ids), 1, "messages")
            room = self.max_model_len - len(prompt.token_ids)
            requested = min(self.defaults.get("max_tokens", room), room)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, requested, k)
        self._check_fits(len(prompt.token_ids), requested, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        runs = await self._start(request, request_id, [prompt], params)
        if req.stream:
            return self._stream(self._chat_events(req, request_id, runs[0]))
        [outs] = await self._collect(request, runs)
        choices = [ChatChoice(
            index=j, message=ChatMessage(content=c.text),
            logprobs=ChatLogprobs(content=self._chat_logprobs(
                c.token_ids, c.logprobs, k, req.return_tokens_as_token_ids))
            if k is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            token_ids=c.token_ids if req.return_token_ids else None) for j, c in enumerate(outs)]
        usage = UsageInfo.of(len(prompt.token_ids), sum(len(c.token_ids) for c in outs))
        return _json(ChatCompletionResponse(id=request_id, model=self.model_name,
                                            choices=choices, usage=usage))

    async def _chat_events(self, req: ChatCompletionRequest, request_id: str,
                           run: _Run) -> AsyncIterator[str]:
        created = int(time.time())
        k = (req.top_logprobs or 0) if req.logprobs else None
        generated = 0

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return _sse(ChatCompletionChunk(id=request_id, created=created,
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
                if not (d.new_text or d.finished or lp):
                    continue
                yield chunk([ChatStreamChoice(
                    index=d.index, delta=DeltaMessage(content=d.new_text or None), logprobs=lp,
                    finish_reason=d.finish_reason if d.finished else None,
                    stop_reason=d.stop_reason if d.finished else None,
                    token_ids=d.new_token_ids if req.return_token_ids else None)])
            if req.include_usage:
                yield chunk([], UsageInfo.of(len(run.prompt.token_ids), generated))
        except Exception as exc:
            yield self._error_event(exc)
        finally:
            await run.close()
        yield _DONE

    # ---- tokenizer endpoints ---------------------------------------------------------------------
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if req.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    req.messages, add_generation_prompt=req.add_generation_prompt)
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[0]}", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens,
                                                               skip_special_tokens=False))


# ---- the app -------------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, tokenizer: Tokenizer, served_model_name: str,
              max_model_len: int, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              generation_defaults: Mapping[str, Any] | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """`generation_defaults` (SamplingParams names) fill fields a request leaves out."""
    metrics = metrics or ServerMetrics()
    serving = OpenAIServing(engine, tokenizer, served_model_name, max_model_len,
                            generation_defaults or {}, metrics)
    app = FastAPI(title="kdaserve", docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(_ClientGone, _on_client_gone)
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key)   # outermost: runs first

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList(data=[ModelCard(id=served_model_name,
                                               max_model_len=max_model_len)]))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = None
        if engine.is_alive:
            with suppress(EngineError, asyncio.TimeoutError):
                stats = await engine.stats()
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return _json(serving.tokenize(body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return _json(serving.detokenize(body))

    return app
