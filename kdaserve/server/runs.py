"""One HTTP request's engine runs: submit, wait for the first delta, stream or collect, close;
and the helpers that tie them to the client's connection."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kdaserve.engine.async_engine import AsyncEngine
from kdaserve.engine.engine_errors import RequestTimeoutError
from kdaserve.outputs import RequestDelta
from kdaserve.request import SamplingParams
from kdaserve.server.errors import ClientGone
from kdaserve.server.metrics import RequestTimer

logger = logging.getLogger("kdaserve")
T = TypeVar("T")
DONE = "data: [DONE]\n\n"


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def all_or_none(aws: Iterable[Awaitable[T]]) -> list[T]:
    """gather(), but a failure cancels (and waits for) the others before it propagates."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# Characters that SSE does not treat as line ends but many line splitters do (Python's
# str.splitlines, httpx's iter_lines): escaped inside the JSON strings where they can occur.
_LINE_BREAK_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                     "\u2029": "\\u2029"})


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json().translate(_LINE_BREAK_ESCAPES)}\n\n"


def json_response(body: BaseModel, status: int = 200) -> Response:
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


class EventStream(StreamingResponse):
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
class Prompt:
    token_ids: list[int]
    text: str | None = None
    media: list = field(default_factory=list)     # MediaItems (kdaserve/media.py)


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, d: RequestDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.new_text
        self.token_ids += d.new_token_ids
        self.logprobs += d.new_logprobs or []
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class Run:
    """One engine request: a prompt and its n completions. `group` is the fairness unit
    (the HTTP request); past `deadline` (time.monotonic()) the run is aborted and raises
    RequestTimeoutError."""

    def __init__(self, engine: AsyncEngine, request_id: str, prompt: Prompt,
                 params: SamplingParams, timer: RequestTimer, group: str | None = None,
                 deadline: float | None = None, stream_text: bool = True) -> None:
        self.prompt = prompt
        self.n = params.n
        self.request_id = request_id
        self._gen = engine.generate(request_id, prompt.token_ids, params, group=group,
                                    media=prompt.media, stream_text=stream_text)
        self._first: RequestDelta | None = None
        self._timer = timer
        self._reasons: list[str] = []
        self._accepted = False
        self._deadline = deadline

    async def _anext(self) -> RequestDelta:
        if self._deadline is None:
            return await self._gen.__anext__()
        left = self._deadline - time.monotonic()
        try:
            return await asyncio.wait_for(self._gen.__anext__(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(
                "the request ran past the server's request timeout and was aborted") from None

    async def start(self) -> None:
        """Submit, and wait for the first delta (input errors raise here)."""
        self._first = await self._anext()
        self._accepted = True

    async def next(self) -> RequestDelta | None:
        """The next delta, or None once all n completions finished."""
        if self._first is not None:
            d, self._first = self._first, None
        else:
            try:
                d = await self._anext()
            except StopAsyncIteration:
                return None
        self._timer.on_tokens(d.index, len(d.new_token_ids))
        if d.finished:
            self._reasons.append(d.finish_reason or "stop")
            self._timer.acceptance(d.acceptance_length)
            if len(self._reasons) == self.n:
                self._timer.finished(self._reasons)
        return d

    async def close(self) -> None:
        if self._accepted and len(self._reasons) < self.n:
            self._timer.aborted()
        await self._gen.aclose()

    async def collect(self) -> list[Choice]:
        choices = [Choice() for _ in range(self.n)]
        while (d := await self.next()) is not None:
            choices[d.index].add(d)
        return choices


async def merge(runs: list[Run]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(run index, delta) from all runs, in arrival order."""
    if len(runs) == 1:
        while (d := await runs[0].next()) is not None:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, RequestDelta | Exception | None]] = asyncio.Queue()

    async def pump(i: int, run: Run) -> None:
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

