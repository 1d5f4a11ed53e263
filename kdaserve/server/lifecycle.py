"""The server's process lifecycle: graceful drain on SIGTERM/SIGINT, and exit when the engine
dies.

Drain: stop taking requests (new ones and /health get 503 with Retry-After), let the streams
in flight finish for up to `shutdown_timeout_s`, then end the rest with an error event, and
stop. The exit code is 0, or 1 if the engine process died (a supervisor such as systemd or
Kubernetes then restarts the whole server: restarting the engine in place would lose every
request in flight anyway, and a restart loop belongs to the supervisor, which can back off).
A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from kdaserve.server.app import OpenAIServing

logger = logging.getLogger("kdaserve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving: OpenAIServing,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is None and self.started and self._loop is not None:
            logger.info("%s: draining (up to %.0f s for %d requests in flight)",
                        signal.Signals(sig).name, self.shutdown_timeout_s,
                        len(self.serving.active))
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)      # before startup, or a second signal: stop now
        self.force_exit = self.force_exit or self._drain is not None

    def _start_drain(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.drain("the server is shutting down"))

    def engine_died(self, why: str) -> None:
        """AsyncEngine's on_dead: fail what runs, stop, exit non-zero."""
        logger.error("the engine died (%s); the server exits with code 1", why)
        self.exit_code = 1
        self.serving.draining = True
        self.should_exit = True

    async def drain(self, why: str) -> None:
        self.serving.draining = True
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self.serving.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.serving.active:
            logger.warning("ending %d requests still running after %.0f s",
                           len(self.serving.active), self.shutdown_timeout_s)
            await self.serving.end_all(why)
            for _ in range(40):              # let their error events reach the clients
                if not self.serving.active:
                    break
                await asyncio.sleep(0.05)
        self.should_exit = True
