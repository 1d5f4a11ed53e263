"""Time limits on reading a request, so half-sent requests cannot hold sockets forever.

uvicorn times out idle keep-alive connections only: a client that opens a connection and
sends nothing, or half its headers, or headers announcing a body it never sends, holds the
socket (and whatever the app allotted it) indefinitely; a few thousand such clients hold the
server. This protocol (uvicorn's h11 one, with two timers) closes a connection whose request
headers are not complete `header_timeout_s` after its first byte (or after it opened), and one
whose body stalls for `body_timeout_s` between reads; the app then sees a disconnect. A
client that sent part of a request gets a 408 (OpenAI-shaped body, `Connection: close`) before
the close; one that sent nothing (a browser's preconnect) is closed without a word.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kdaserve")

_BODY = json.dumps({"error": {"message": "the request was not sent in time", "type":
                              "invalid_request_error", "param": None,
                              "code": "request_timeout"}}).encode()
TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: " + str(len(_BODY)).encode()
                    + b"\r\n\r\n" + _BODY)


class TimedH11Protocol(H11Protocol):
    header_timeout_s: float = 4.0
    body_timeout_s: float = 4.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._partial = False          # bytes of a request not yet complete came in

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting_headers = self.conn.their_state is h11.IDLE
        super().data_received(data)
        state = self.conn.their_state
        self._partial = bool(data) and state in (h11.IDLE, h11.SEND_BODY)
        if state is h11.SEND_BODY:              # every read restarts the body's clock
            self._arm(self.body_timeout_s)
        elif state is h11.IDLE:
            if not waiting_headers or self._read_timer is None:
                self._arm(self.header_timeout_s)    # the first bytes of a new request
        else:
            self._disarm()                      # the request is read

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()                          # idle now: uvicorn's keep-alive timer's job

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expired(self) -> None:
        self._read_timer = None
        state = self.conn.their_state
        if state not in (h11.IDLE, h11.SEND_BODY) or self.transport.is_closing():
            return
        if state is h11.IDLE and self.cycle is not None and not self.cycle.response_complete:
            return                              # a response is being written: not idle
        logger.info("closing a connection whose request was not sent in time (%s)",
                    "headers" if state is h11.IDLE else "body")
        if self._partial:
            self.transport.write(TIMEOUT_RESPONSE)
        self.transport.close()


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type[TimedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these limits."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
