"""`AsyncEngine`: the server's client of the engine process (engine_process.py), in the
server's event loop.

The child and its pipes: engine_child.py; its replies routed to streams and asks:
engine_replies.py. Here: the lifecycle, the bounds on what waits for a first token, requests
and asks sent, and what the engine's death means for every request in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import zmq

from kdaserve.config import EngineConfig
from kdaserve.engine.engine_child import EngineChild
from kdaserve.engine.engine_errors import (
    EngineDeadError,
    EngineError,
    EngineStartupError,
)
from kdaserve.engine.engine_replies import EngineReplies, Stream
from kdaserve.engine.waiting_bounds import (
    DEFAULT_MAX_QUEUED_TOKENS,
    DEFAULT_MAX_WAITING,
    WaitingBounds,
)
from kdaserve.engine.wire import (
    AbortCmd,
    AddCmd,
    Command,
    EngineInfo,
    EngineStatsSnapshot,
    HoldCmd,
    HoldReply,
    Reply,
    ShutdownCmd,
    StartupFailed,
    StatsCmd,
)
from kdaserve.media import MediaItem, MediaWire
from kdaserve.outputs import RequestDelta
from kdaserve.request import SamplingParams

logger = logging.getLogger("kdaserve")

_REPLY_TIMEOUT_S = 30.0


class AsyncEngine:
    """Client of an `EngineCore` running in a child process.

    `max_waiting` bounds the sequences (n per prompt) that were accepted but have produced no
    token yet, `max_queued_tokens` their prompt tokens; a request beyond either is refused with
    `QueueFullError` instead of queueing without limit. `on_dead` is called (in the event loop)
    if the engine process dies while serving. `last_heartbeat` is when the engine last said
    anything (it reports at least every engine_process.HEARTBEAT_S while its loop runs).
    """

    def __init__(self, config: EngineConfig, *, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
                 startup_timeout_s: float = 1800.0, log_level: int | None = None,
                 on_dead: Any = None) -> None:
        self.config = config
        self.bounds = WaitingBounds(max_waiting, max_queued_tokens)
        self.on_dead = on_dead
        self.last_heartbeat = time.monotonic()
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level if log_level is not None else logger.getEffectiveLevel()
        self.info: EngineInfo | None = None
        self._replies = EngineReplies(self.bounds)
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._encoder = msgspec.msgpack.Encoder()
        self._dead: str | None = None          # why the engine is gone, once it is
        self._died = False                     # it ended without being asked to
        self._closing = False
        self._child = EngineChild()
        self._reader: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Spawn the engine and wait until it has loaded the model."""
        if self._child.proc is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        # a daemonic process may not start the workers of a parallel layout; those die with
        # the engine process (PDEATHSIG), which exits when the server goes
        self._child.spawn(self._encoder.encode(self.config), self.log_level,
                          self.config.parallel.executor == "uni", self._on_exit)
        try:
            first = await self._first_reply()
        except BaseException:
            await self.shutdown()
            raise
        if isinstance(first, StartupFailed):
            await self.shutdown()
            raise EngineStartupError(first.message)
        if not isinstance(first, EngineInfo):
            await self.shutdown()
            raise EngineStartupError(f"unexpected first message from the engine: {first!r}")
        self.info = first
        self._reader = asyncio.get_running_loop().create_task(
            self._read_loop(), name="kdaserve-engine-reader")
        return first

    async def _first_reply(self) -> Reply:
        frame = await self._child.first_frame(self.startup_timeout_s)
        if frame is None:
            if self._child.exited is not None and self._child.exited.done():
                code = self._child.proc.exitcode if self._child.proc else None
                raise EngineStartupError(f"engine process exited during startup (code {code})")
            raise EngineStartupError(
                f"engine did not become ready within {self.startup_timeout_s:.0f} s")
        return self._decoder.decode(frame)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process and release sockets; pending requests get EngineDeadError."""
        if self._closing:
            return
        self._closing = True

        def ask() -> None:
            try:
                self._send(ShutdownCmd())
            except EngineError:
                pass
        await self._child.stop(timeout_s, ask)
        if self._child.proc is not None:
            self._on_exit()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self._child.close()

    def _on_exit(self) -> None:
        """The child process ended (its sentinel became readable) or we are shutting down."""
        self._child.mark_exited()
        if self._dead is not None:
            return
        if self._closing:
            why = "the engine was shut down"
        else:
            why = f"the engine process exited (code {self._child.proc.exitcode})"
            if self._replies.fatal:
                why += f": {self._replies.fatal}"
            if self.info is not None:     # during start() the caller gets the reason instead
                logger.error("%s", why)
            self._died = True
        self._dead = why
        self._replies.fail_all(EngineDeadError(why))
        if not self._closing and self.info is not None and self.on_dead is not None:
            self.on_dead(why)

    @property
    def died(self) -> bool:
        """The engine process ended without being asked to."""
        return self._died

    @property
    def is_alive(self) -> bool:
        return self.info is not None and self._dead is None

    @property
    def max_model_len(self) -> int:
        if self.info is None:
            raise RuntimeError("the engine has not started")
        return self.info.max_model_len

    @property
    def num_waiting(self) -> int:
        """Sequences accepted and still without a first token."""
        return self.bounds.num_waiting

    def seconds_since_heartbeat(self) -> float:
        return time.monotonic() - self.last_heartbeat

    # ---- messages ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.info is None:
            raise EngineError("the engine has not started")

    def _send(self, msg: Command) -> None:
        try:
            self._child.send(self._encoder.encode(msg))
        except zmq.ZMQError as exc:   # no peer (it died) or the socket is closed
            raise EngineDeadError(self._dead or f"cannot reach the engine: {exc}") from None

    async def _read_loop(self) -> None:
        assert self._child.out is not None
        while True:
            try:
                frame = await self._child.out.recv()
            except zmq.ZMQError:
                return
            try:
                msg = self._decoder.decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropping an undecodable engine message: %s", exc)
                continue
            self.last_heartbeat = time.monotonic()
            self._replies.dispatch(msg)

    # ---- requests --------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       group: str | None = None, media: Sequence[MediaItem] = (),
                       stream_text: bool = True) -> AsyncIterator[RequestDelta]:
        """Submit a request and yield its deltas until all `params.n` completions finished.

        Input errors surface as ValueError on the first iteration; leaving the loop early (or
        being cancelled) aborts the request in the engine. A completion the engine failed
        raises EngineError with its reason.
        """
        self._check_alive()
        if request_id in self._replies.streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.bounds.admit(request_id, params.n, len(prompt_token_ids))
        stream = self._replies.streams[request_id] = Stream()
        remaining = params.n
        try:
            self._send(AddCmd(request_id, list(prompt_token_ids),
                              msgspec.Raw(self._encoder.encode(params)), priority, group,
                              [MediaWire.of(m) for m in media], stream_text))
            while remaining:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    remaining = 0       # the engine holds nothing for it any more
                    raise item
                if item.finished:
                    remaining -= 1
                if item.error is not None:
                    raise EngineError(f"the engine failed this request: {item.error}")
                yield item
        finally:
            del self._replies.streams[request_id]
            self.bounds.release(request_id)
            if remaining and self._dead is None:
                self._send(AbortCmd([request_id]))

    async def abort(self, request_id: str, error: EngineError | None = None) -> None:
        """Stop a request; its `generate` iterator ends with `error` (default: an
        EngineError saying it was aborted) if still read."""
        stream = self._replies.streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(error or EngineError(f"request {request_id!r} was aborted"))
        if self._dead is None and self.info is not None:
            self._send(AbortCmd([request_id]))

    async def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's counters (see EngineStatsSnapshot for the keys)."""
        snapshot: EngineStatsSnapshot = await self._ask(StatsCmd)
        return msgspec.structs.asdict(snapshot)

    async def hold_prefix(self, transfer_id: str, prompt_token_ids: list[int]) -> int:
        """Disaggregation's hit query (EngineCore.hold_prefix): the leading tokens of the
        prompt this decode instance holds, pinned under `transfer_id`. ValueError when this
        is no decode instance."""
        reply: HoldReply = await self._ask(
            lambda token: HoldCmd(token, transfer_id, list(prompt_token_ids)))
        if reply.error:
            raise ValueError(reply.error)
        return reply.held_tokens

    async def _ask(self, command: Callable[[int], Command]) -> Any:
        """Send command(token) and wait for the reply carrying that token."""
        self._check_alive()
        token, fut = self._replies.expect()
        try:
            self._send(command(token))
            return await asyncio.wait_for(fut, _REPLY_TIMEOUT_S)
        finally:
            self._replies.forget(token)
