"""The engine's child process as AsyncEngine holds it: spawned with its config, two PUSH/PULL
pipes on ipc:// sockets in a private temp dir (commands to it, replies from it, msgpack frames
of wire.py's Structs), its exit watched from the event loop through the process sentinel, and
stopped politely first, killed when it does not stop."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import tempfile
from collections.abc import Callable

import zmq
import zmq.asyncio

from kdaserve.engine.engine_process import engine_process_main

logger = logging.getLogger("kdaserve")


class EngineChild:
    def __init__(self) -> None:
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.exited: asyncio.Future[None] | None = None   # set once the child has ended
        self._tmpdir: str | None = None
        self._ctx: zmq.Context | None = None
        self._cmd: zmq.Socket | None = None
        self.out: zmq.asyncio.Socket | None = None

    def spawn(self, config: bytes, log_level: int, daemon: bool,
              on_exit: Callable[[], None]) -> None:
        """Start the child with its encoded config; `on_exit` runs in the loop when it ends."""
        loop = asyncio.get_running_loop()
        self._tmpdir = tempfile.mkdtemp(prefix="kdaserve-")
        cmd_addr, out_addr = f"ipc://{self._tmpdir}/cmd", f"ipc://{self._tmpdir}/out"
        self._ctx = zmq.Context()
        self._cmd = self._ctx.socket(zmq.PUSH)
        self._cmd.setsockopt(zmq.SNDHWM, 0)
        self._cmd.setsockopt(zmq.LINGER, 0)
        self._cmd.bind(cmd_addr)
        self.out = zmq.asyncio.Socket(self._ctx, zmq.PULL)
        self.out.setsockopt(zmq.RCVHWM, 0)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=engine_process_main, name="kdaserve-engine",
                               daemon=daemon, args=(config, cmd_addr, out_addr, log_level))
        self.proc.start()
        self.exited = loop.create_future()
        loop.add_reader(self.proc.sentinel, on_exit)

    def send(self, frame: bytes) -> None:
        """Raises zmq.ZMQError when no peer reads (it died) or the socket is closed."""
        assert self._cmd is not None
        self._cmd.send(frame, zmq.NOBLOCK)

    async def first_frame(self, timeout_s: float) -> bytes | None:
        """The child's first message, or None with the reason raised by the caller: it
        exited (exitcode set) or stayed silent past `timeout_s`."""
        assert self.out is not None and self.exited is not None
        recv = asyncio.ensure_future(self.out.recv())
        try:
            done, _ = await asyncio.wait({recv, self.exited}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if recv not in done and self.exited in done:
                # It may have said why just before exiting: give that message a moment.
                done, _ = await asyncio.wait({recv}, timeout=1.0)
            return recv.result() if recv in done else None
        finally:
            if not recv.done():
                recv.cancel()

    def mark_exited(self) -> None:
        """The sentinel fired (or we are shutting down): stop watching, reap the child."""
        assert self.proc is not None
        if self.exited is not None and not self.exited.done():
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
            self.proc.join(0)
            self.exited.set_result(None)

    async def stop(self, timeout_s: float, ask: Callable[[], None]) -> None:
        """`ask` sends the child its shutdown command; it is killed if still running after
        `timeout_s`."""
        proc = self.proc
        if proc is None or not proc.is_alive():
            return
        ask()
        await self._wait_exit(timeout_s)
        if self.exited is not None and self.exited.done():
            # the sentinel fires when the child closes its descriptors, a moment before its
            # exit status exists: is_alive() then still says True
            await asyncio.to_thread(proc.join, timeout_s)
        if proc.is_alive():         # it ignores SIGTERM (see engine_process_main)
            logger.warning("the engine did not stop within %.0f s; killing it", timeout_s)
            proc.kill()
            await self._wait_exit(timeout_s)

    async def _wait_exit(self, timeout_s: float) -> None:
        if self.exited is not None and not self.exited.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout_s)
            except asyncio.TimeoutError:
                pass

    def close(self) -> None:
        """Release the sockets and the temp dir (after stop)."""
        for sock in (self._cmd, self.out):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
