"""What the engine process says, routed to whom it concerns (AsyncEngine's reader).

Each request's deltas go to its stream; a stream's first delta releases it from the waiting
bounds (it no longer waits for a first token); the replies to asks (stats snapshots, hit
queries) go to the future waiting on their token; a dead engine fails every stream and every
ask at once. Lives in the server's event loop: nothing here blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from kdaserve.engine.engine_errors import EngineError
from kdaserve.engine.waiting_bounds import WaitingBounds
from kdaserve.engine.wire import (
    AddFailed,
    DeltaBatch,
    Fatal,
    Heartbeat,
    HoldReply,
    Reply,
    StatsReply,
)
from kdaserve.outputs import RequestDelta

logger = logging.getLogger("kdaserve")


@dataclass
class Stream:
    queue: asyncio.Queue[RequestDelta | BaseException] = field(default_factory=asyncio.Queue)
    started: bool = False          # got its first delta (no longer counts as waiting)


class EngineReplies:
    def __init__(self, bounds: WaitingBounds) -> None:
        self.bounds = bounds
        self.streams: dict[str, Stream] = {}
        self._waiters: dict[int, asyncio.Future[Any]] = {}   # replies by token
        self._tokens = itertools.count()
        self.fatal: str | None = None     # the engine's last words, when it sent any

    def expect(self) -> tuple[int, asyncio.Future[Any]]:
        """A token for an ask and the future its reply will complete."""
        token = next(self._tokens)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiters[token] = fut
        return token, fut

    def forget(self, token: int) -> None:
        self._waiters.pop(token, None)

    def fail_all(self, exc: BaseException) -> None:
        for stream in self.streams.values():
            stream.queue.put_nowait(exc)
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(exc)

    def dispatch(self, msg: Reply) -> None:
        if isinstance(msg, DeltaBatch):
            for delta in msg.deltas:
                stream = self.streams.get(delta.request_id)
                if stream is None:      # aborted on our side; the engine has dropped it too
                    continue
                if not stream.started:
                    stream.started = True
                    self.bounds.release(delta.request_id)
                stream.queue.put_nowait(delta)
        elif isinstance(msg, AddFailed):
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                exc = ValueError(msg.message) if msg.invalid_input else EngineError(msg.message)
                stream.queue.put_nowait(exc)
        elif isinstance(msg, (StatsReply, HoldReply)):
            fut = self._waiters.get(msg.token)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats if isinstance(msg, StatsReply) else msg)
        elif isinstance(msg, Fatal):
            self.fatal = msg.message
        elif isinstance(msg, Heartbeat):
            pass
        else:
            logger.error("unexpected engine message %r", msg)
