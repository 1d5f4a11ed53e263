"""The engine core in a child process, driven from the server's event loop over ZeroMQ.

Two PUSH/PULL pipes on ipc:// sockets in a private temp dir: commands flow to the child, results
flow back. Every message is a typed msgspec Struct encoded with msgpack (no pickle on the wire).

The child blocks on its command socket while it has no work and otherwise alternates between
draining commands and running one engine step, sending each step's deltas as one message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import msgspec
import zmq
import zmq.asyncio

from kdaserve.config import EngineConfig
from kdaserve.media import MediaItem, MediaWire
from kdaserve.outputs import RequestDelta
from kdaserve.request import SamplingParams

logger = logging.getLogger("kdaserve")

DEFAULT_MAX_WAITING = 1024     # sequences accepted but without a first token yet
DEFAULT_MAX_QUEUED_TOKENS = 1 << 20    # their prompt tokens
_IDLE_POLL_MS = 250           # how often an idle child checks that its parent is still there
HEARTBEAT_S = 0.5             # the child reports at least this often while it is healthy
_STATS_TIMEOUT_S = 30.0


class EngineError(RuntimeError):
    """The engine could not serve a request for a reason other than the request's input."""


class EngineStartupError(EngineError):
    """The engine process failed to load the model (the message is the child's error)."""


class EngineDeadError(EngineError):
    """The engine process is gone; no request can be served any more."""


class QueueFullError(EngineError):
    """Too many sequences (or prompt tokens) are waiting for their first token; try again
    later."""


class RequestTimeoutError(EngineError):
    """The request ran past its server-side deadline and was aborted."""


# ---- wire messages: server -> engine ---------------------------------------------------------
class AddCmd(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: msgspec.Raw            # an encoded SamplingParams, decoded (validated) by the child
    priority: int = 0
    group: str | None = None       # fairness unit (one HTTP request's prompts share it)
    media: list[MediaWire] = []    # images, their placeholder runs expanded in the prompt
    stream_text: bool = True       # False: the text is read once the request ends


class AbortCmd(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StatsCmd(msgspec.Struct, tag="stats"):
    token: int


class ShutdownCmd(msgspec.Struct, tag="shutdown"):
    pass


Command = Union[AddCmd, AbortCmd, StatsCmd, ShutdownCmd]


# ---- wire messages: engine -> server ---------------------------------------------------------
class EngineInfo(msgspec.Struct, tag="ready"):
    """What the child reports once the model is loaded."""

    max_model_len: int
    vocab_size: int
    plan: str
    num_blocks: int
    block_size: int
    num_state_slots: int


class StartupFailed(msgspec.Struct, tag="startup_failed"):
    message: str


class DeltaBatch(msgspec.Struct, tag="deltas"):
    deltas: list[RequestDelta]


class AddFailed(msgspec.Struct, tag="add_failed"):
    request_id: str
    message: str
    invalid_input: bool            # True: the request was bad (HTTP 400); False: an engine bug


class EngineStatsSnapshot(msgspec.Struct):
    num_running: int
    num_waiting: int
    cache_usage: float
    num_free_blocks: int
    num_free_slots: int
    num_blocks: int
    all_free: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    state_snapshots: int
    state_snapshot_bytes: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    steps: int
    spec_verifications: int = 0    # decode rows that verified drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # adaptive speculation's decisions (kdaserve.engine.spec.adaptive.decisions); {} when off
    spec_adaptive: dict[str, float] = {}
    # offload tiers: tier name -> counters (see kdaserve.engine.tier_transfer.offload_stats)
    offload: dict[str, dict[str, float]] = {}


class StatsReply(msgspec.Struct, tag="stats_reply"):
    token: int
    stats: EngineStatsSnapshot


class Fatal(msgspec.Struct, tag="fatal"):
    message: str


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    """The loop is alive and stepping (sent between steps and while idle)."""


Reply = Union[EngineInfo, StartupFailed, DeltaBatch, AddFailed, StatsReply, Fatal, Heartbeat]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---- the child process -----------------------------------------------------------------------
def _engine_process(config_msg: bytes, cmd_addr: str, out_addr: str, log_level: int) -> None:
    """Entry point of the engine process (spawned, so it starts from a fresh interpreter)."""
    # Ctrl-C or a SIGTERM to the process group reaches the server too, which then shuts us down
    # once its open requests are done; if the server dies instead, the loop notices and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    ctx = zmq.Context()
    cmds = ctx.socket(zmq.PULL)
    cmds.setsockopt(zmq.RCVHWM, 0)
    cmds.connect(cmd_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        try:
            from kdaserve.engine.core import EngineCore  # torch is imported here, in the child

            core = EngineCore(msgspec.msgpack.decode(config_msg, type=EngineConfig))
        except Exception as exc:
            logger.error("engine failed to start: %s", _describe(exc))
            out.send(encoder.encode(StartupFailed(_describe(exc))))
            raise SystemExit(1) from None
        plan = core.plan
        out.send(encoder.encode(EngineInfo(
            max_model_len=core.max_model_len, vocab_size=core.model_config.vocab_size,
            plan=plan.describe(), num_blocks=plan.num_blocks, block_size=plan.block_size,
            num_state_slots=plan.num_state_slots)))
        try:
            _EngineLoop(core, cmds, out, encoder).run()
        except Exception as exc:
            logger.error("engine loop failed:\n%s", traceback.format_exc())
            out.send(encoder.encode(Fatal(_describe(exc))))
            raise SystemExit(1) from None
        try:      # a clean shutdown: the device cache goes to the offload tiers (disk persists)
            core.close()
        except Exception:
            logger.exception("flushing the cache to the offload tiers at shutdown failed")
        finally:
            core.shutdown()          # worker processes of a parallel layout
    finally:
        cmds.close(linger=0)
        out.close(linger=5000)     # deliver the last message even if we exit right after
        ctx.term()


class _EngineLoop:
    def __init__(self, core: Any, cmds: zmq.Socket, out: zmq.Socket,
                 encoder: msgspec.msgpack.Encoder) -> None:
        self.core = core
        self.cmds = cmds
        self.out = out
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(Command)
        self.parent = os.getppid()
        self._last_sent = 0.0

    def run(self) -> None:
        while True:
            if os.getppid() != self.parent:
                logger.warning("the server process is gone; the engine exits")
                return
            if time.monotonic() - self._last_sent >= HEARTBEAT_S:
                self._send(Heartbeat())
            if not self.core.has_unfinished() and not self.cmds.poll(_IDLE_POLL_MS):
                continue
            if not self._drain():
                return
            if self.core.has_unfinished():
                deltas = self.core.step()
                if deltas:
                    self._send(DeltaBatch(deltas))

    def _send(self, msg: Reply) -> None:
        self.out.send(self.encoder.encode(msg))
        self._last_sent = time.monotonic()

    def _drain(self) -> bool:
        """Handle every queued command; False once told to shut down."""
        while True:
            try:
                frame = self.cmds.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                cmd = self.decoder.decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropping an undecodable command: %s", exc)
                continue
            if isinstance(cmd, ShutdownCmd):
                return False
            self._handle(cmd)

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AddCmd):
            self._add(cmd)
        elif isinstance(cmd, AbortCmd):
            for rid in cmd.request_ids:
                self.core.abort(rid)
        elif isinstance(cmd, StatsCmd):
            self._send(StatsReply(cmd.token, self._stats()))

    def _add(self, cmd: AddCmd) -> None:
        try:
            params = msgspec.msgpack.decode(cmd.params, type=SamplingParams)
            self.core.add_request(cmd.request_id, cmd.prompt_token_ids, params,
                                  priority=cmd.priority, group=cmd.group,
                                  media=[m.item() for m in cmd.media],
                                  stream_text=cmd.stream_text)
        except ValueError as exc:   # SamplingParamsError and msgspec.ValidationError included
            self._send(AddFailed(cmd.request_id, str(exc), invalid_input=True))
        except Exception as exc:
            logger.exception("add_request(%s) failed", cmd.request_id)
            self._send(AddFailed(cmd.request_id, _describe(exc), invalid_input=False))

    def _stats(self) -> EngineStatsSnapshot:
        from kdaserve.engine.tier_transfer import offload_stats   # torch: in the engine process

        core, cache = self.core, self.core.cache
        cs = cache.stats
        return EngineStatsSnapshot(
            num_running=core.num_running, num_waiting=core.num_waiting,
            cache_usage=float(cache.usage), num_free_blocks=cache.num_free_blocks,
            num_free_slots=cache.num_free_slots, num_blocks=cache.block_pool.num_blocks,
            all_free=bool(cache.all_free()), prefix_cache_queries=cs.queries,
            prefix_cache_hits=cs.hits, prefix_cache_query_tokens=cs.query_tokens,
            prefix_cache_hit_tokens=cs.hit_tokens, state_snapshots=cache.snapshots.num_used,
            state_snapshot_bytes=cache.snapshots.bytes_held, prompt_tokens=core.stats.prompt_tokens,
            generation_tokens=core.stats.generation_tokens,
            preemptions=core.stats.preemptions, steps=core.stats.steps,
            spec_verifications=core.scheduler.num_verify_rows,
            spec_draft_tokens=core.scheduler.num_draft_tokens,
            spec_accepted_tokens=core.scheduler.num_accepted_tokens,
            spec_adaptive=(core.scheduler.spec_policy.decisions()
                           if core.scheduler.spec_policy is not None else {}),
            offload=(offload_stats(cache.offload, core.executor.transfer_stats())
                     if cache.offload is not None else {}))


# ---- the client, in the server's event loop ---------------------------------------------------
@dataclass
class _Stream:
    queue: asyncio.Queue[RequestDelta | BaseException] = field(default_factory=asyncio.Queue)
    started: bool = False          # got its first delta (no longer counts as waiting)


class AsyncEngine:
    """Client of an `EngineCore` running in a child process.

    `max_waiting` bounds the sequences (n per prompt) that were accepted but have produced no
    token yet, `max_queued_tokens` their prompt tokens; a request beyond either is refused with
    `QueueFullError` instead of queueing without limit. `on_dead` is called (in the event loop)
    if the engine process dies while serving. `last_heartbeat` is when the engine last said
    anything (it reports at least every HEARTBEAT_S while its loop runs).
    """

    def __init__(self, config: EngineConfig, *, max_waiting: int = DEFAULT_MAX_WAITING,
                 max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
                 startup_timeout_s: float = 1800.0, log_level: int | None = None,
                 on_dead: Any = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.config = config
        self.max_waiting = max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.on_dead = on_dead
        self.last_heartbeat = time.monotonic()
        self._queued_tokens = 0
        self.startup_timeout_s = startup_timeout_s
        self.log_level = log_level if log_level is not None else logger.getEffectiveLevel()
        self.info: EngineInfo | None = None
        self._streams: dict[str, _Stream] = {}
        self._waiting: dict[str, tuple[int, int]] = {}   # request -> (sequences, tokens)
        self._stats_waiters: dict[int, asyncio.Future[EngineStatsSnapshot]] = {}
        self._tokens = itertools.count()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._encoder = msgspec.msgpack.Encoder()
        self._dead: str | None = None          # why the engine is gone, once it is
        self._fatal: str | None = None
        self._died = False                     # it ended without being asked to
        self._closing = False
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.Context | None = None
        self._cmd: zmq.Socket | None = None
        self._out: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._exited: asyncio.Future[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Spawn the engine and wait until it has loaded the model."""
        if self._proc is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        loop = asyncio.get_running_loop()
        self._tmpdir = tempfile.mkdtemp(prefix="kdaserve-")
        cmd_addr, out_addr = f"ipc://{self._tmpdir}/cmd", f"ipc://{self._tmpdir}/out"
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.SNDHWM, 0)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.bind(cmd_addr)
        self._out = zmq.asyncio.Socket(self._ctx, zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(
            # a daemonic process may not start the workers of a parallel layout; those die
            # with the engine process (PDEATHSIG), which exits when the server goes
            target=_engine_process, name="kdaserve-engine",
            daemon=self.config.parallel.executor == "uni",
            args=(self._encoder.encode(self.config), cmd_addr, out_addr, self.log_level))
        self._proc.start()
        self._exited = loop.create_future()
        loop.add_reader(self._proc.sentinel, self._on_exit)
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
        self._reader = loop.create_task(self._read_loop(), name="kdaserve-engine-reader")
        return first

    async def _first_reply(self) -> Reply:
        assert self._out is not None and self._exited is not None
        recv = asyncio.ensure_future(self._out.recv())
        try:
            done, _ = await asyncio.wait({recv, self._exited}, timeout=self.startup_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if recv not in done and self._exited in done:
                # It may have said why just before exiting: give that message a moment.
                done, _ = await asyncio.wait({recv}, timeout=1.0)
            if recv not in done:
                if self._exited.done():
                    code = self._proc.exitcode if self._proc else None
                    raise EngineStartupError(f"engine process exited during startup (code {code})")
                raise EngineStartupError(
                    f"engine did not become ready within {self.startup_timeout_s:.0f} s")
            return self._decoder.decode(recv.result())
        finally:
            if not recv.done():
                recv.cancel()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process and release sockets; pending requests get EngineDeadError."""
        if self._closing:
            return
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                self._send(ShutdownCmd())
            except EngineError:
                pass
            await self._wait_exit(timeout_s)
            if proc.is_alive():         # it ignores SIGTERM (see _engine_process)
                logger.warning("the engine did not stop within %.0f s; killing it", timeout_s)
                proc.kill()
                await self._wait_exit(timeout_s)
        if proc is not None:
            self._on_exit()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        for sock in (self._cmd, self._out):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def _wait_exit(self, timeout_s: float) -> None:
        if self._exited is not None and not self._exited.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), timeout_s)
            except asyncio.TimeoutError:
                pass

    def _on_exit(self) -> None:
        """The child process ended (its sentinel became readable) or we are shutting down."""
        assert self._proc is not None
        if self._exited is not None and not self._exited.done():
            asyncio.get_running_loop().remove_reader(self._proc.sentinel)
            self._proc.join(0)
            self._exited.set_result(None)
        if self._dead is not None:
            return
        if self._closing:
            why = "the engine was shut down"
        else:
            why = f"the engine process exited (code {self._proc.exitcode})"
            if self._fatal:
                why += f": {self._fatal}"
            if self.info is not None:     # during start() the caller gets the reason instead
                logger.error("%s", why)
            self._died = True
        self._dead = why
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(why))
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
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
        return sum(n for n, _ in self._waiting.values())

    def seconds_since_heartbeat(self) -> float:
        return time.monotonic() - self.last_heartbeat

    def _unqueue(self, request_id: str) -> None:
        entry = self._waiting.pop(request_id, None)
        if entry is not None:
            self._queued_tokens -= entry[1]

    # ---- messages ------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.info is None:
            raise EngineError("the engine has not started")

    def _send(self, msg: Command) -> None:
        assert self._cmd is not None
        try:
            self._cmd.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:   # no peer (it died) or the socket is closed
            raise EngineDeadError(self._dead or f"cannot reach the engine: {exc}") from None

    async def _read_loop(self) -> None:
        assert self._out is not None
        while True:
            try:
                frame = await self._out.recv()
            except zmq.ZMQError:
                return
            try:
                msg = self._decoder.decode(frame)
            except msgspec.DecodeError as exc:
                logger.error("dropping an undecodable engine message: %s", exc)
                continue
            self.last_heartbeat = time.monotonic()
            self._dispatch(msg)

    def _dispatch(self, msg: Reply) -> None:
        if isinstance(msg, DeltaBatch):
            for delta in msg.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:      # aborted on our side; the engine has dropped it too
                    continue
                if not stream.started:
                    stream.started = True
                    self._unqueue(delta.request_id)
                stream.queue.put_nowait(delta)
        elif isinstance(msg, AddFailed):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                exc = ValueError(msg.message) if msg.invalid_input else EngineError(msg.message)
                stream.queue.put_nowait(exc)
        elif isinstance(msg, StatsReply):
            fut = self._stats_waiters.get(msg.token)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, Fatal):
            self._fatal = msg.message
        elif isinstance(msg, Heartbeat):
            pass
        else:
            logger.error("unexpected engine message %r", msg)

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
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        queued = self.num_waiting
        tokens = len(prompt_token_ids) * params.n
        if queued and (queued + params.n > self.max_waiting
                       or self._queued_tokens + tokens > self.max_queued_tokens):
            raise QueueFullError(
                f"{queued} sequences ({self._queued_tokens} prompt tokens) are waiting for "
                f"their first token (limits: {self.max_waiting} sequences, "
                f"{self.max_queued_tokens} tokens); retry later")
        stream = self._streams[request_id] = _Stream()
        self._waiting[request_id] = (params.n, tokens)
        self._queued_tokens += tokens
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
            del self._streams[request_id]
            self._unqueue(request_id)
            if remaining and self._dead is None:
                self._send(AbortCmd([request_id]))

    async def abort(self, request_id: str, error: EngineError | None = None) -> None:
        """Stop a request; its `generate` iterator ends with `error` (default: an
        EngineError saying it was aborted) if still read."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.queue.put_nowait(error or EngineError(f"request {request_id!r} was aborted"))
        if self._dead is None and self.info is not None:
            self._send(AbortCmd([request_id]))

    async def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's counters (see EngineStatsSnapshot for the keys)."""
        self._check_alive()
        token = next(self._tokens)
        fut: asyncio.Future[EngineStatsSnapshot] = asyncio.get_running_loop().create_future()
        self._stats_waiters[token] = fut
        try:
            self._send(StatsCmd(token))
            snapshot = await asyncio.wait_for(fut, _STATS_TIMEOUT_S)
        finally:
            self._stats_waiters.pop(token, None)
        return msgspec.structs.asdict(snapshot)
