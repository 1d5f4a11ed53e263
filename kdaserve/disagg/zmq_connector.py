"""The connector on ZeroMQ: a ROUTER socket on the kv-transfer port receives, a DEALER per
send pushes. One transfer = one multipart message: [msgpack header, buffer 0, buffer 1, ...],
the buffers sent zero-copy from the sender's host views; the receiver checks the header
against its own model and layout and every buffer's checksum before it acknowledges, so a
refusal reaches the sender (and its client) as a clear error. Never pickle.
nixl_connector.py keeps this control channel and moves the buffers over NIXL instead: it
overrides the three hooks `_outgoing`, `_incoming` and `_released`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from kdaserve.disagg import wire
from kdaserve.disagg.connector import Arrived, ConnectorStats, Inbox, TransferFailed
from kdaserve.disagg.wire import CacheLayout, TransferHeader, TransferRefused

logger = logging.getLogger("kdaserve")


@dataclass
class _Open:
    sock: zmq.Socket
    parts: int = 0
    frames: list = field(default_factory=list)
    at: float = field(default_factory=time.monotonic)


class ZmqConnector:
    transport = "zmq"

    def __init__(self, identity: str, layout: CacheLayout, port: int | None = None,
                 host: str = "127.0.0.1", send_timeout_s: float = 30.0,
                 ttl_s: float = 60.0) -> None:
        """port: receive on it (a decode instance; 0 picks a free one); None: only send."""
        self.identity = identity
        self.layout = layout
        self.send_timeout_s = send_timeout_s
        self.stats = ConnectorStats()
        self.inbox = Inbox(self.stats, ttl_s)
        self._ctx = zmq.Context()
        self._open: dict[str, _Open] = {}     # transfers with parts pushed, by id
        self._stop = threading.Event()
        self.address: str | None = None
        self._thread: threading.Thread | None = None
        if port is not None:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{host}:{port}"
            self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                            name="kdaserve-kv-recv")
            self._thread.start()

    # ---- sending ----------------------------------------------------------------------------
    # One DEALER socket per transfer: its parts go out in order on it, and their
    # acknowledgements come back on it. The frames stay referenced until the last
    # acknowledgement (zero-copy: ZeroMQ's I/O thread reads them while the engine computes).
    def push(self, peer: str, header: TransferHeader, frames: Sequence[memoryview]) -> None:
        self._drop_abandoned()
        header = msgspec.structs.replace(header, transport=self.transport)
        tid = header.transfer_id
        if tid not in self._open:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(peer)
            self._open[tid] = _Open(sock)
        o = self._open[tid]
        o.sock.send_multipart([wire.encode(header), *self._outgoing(header, frames)],
                              copy=False)
        o.parts += 1
        o.frames.append(frames)
        self.stats.parts_pushed += not header.final
        self._count(header)

    def send(self, peer: str, header: TransferHeader, frames: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        try:
            self.push(peer, header, frames)
            o = self._open.pop(header.transfer_id)
        except Exception as exc:
            self.stats.send_failures += 1
            self._close(header.transfer_id)
            raise TransferFailed(f"sending transfer {header.transfer_id} to {peer} failed: "
                                 f"{exc}") from None
        try:
            deadline = time.monotonic() + self.send_timeout_s
            for _ in range(o.parts):          # every part's acknowledgement, in order
                left = deadline - time.monotonic()
                if left <= 0 or not o.sock.poll(int(left * 1000)):
                    raise TransferFailed(f"the decode instance at {peer} did not acknowledge "
                                         f"transfer {header.transfer_id} within "
                                         f"{self.send_timeout_s:g} s")
                ack = wire.decode_ack(o.sock.recv())
                if not ack.ok:
                    raise TransferFailed(f"the decode instance at {peer} refused transfer "
                                         f"{header.transfer_id}: {ack.error}")
        except TransferFailed:
            self.stats.send_failures += 1
            raise
        finally:
            o.sock.close(linger=0)
            self._released(header.transfer_id)
        self.stats.sent += 1
        self.stats.send_seconds += time.perf_counter() - start

    def _count(self, header: TransferHeader) -> None:
        for spec in header.buffers:
            if spec.name.startswith("mla."):
                self.stats.sent_mla_bytes += spec.nbytes
            elif spec.name.startswith("draft"):
                self.stats.sent_draft_bytes += spec.nbytes
            else:
                self.stats.sent_kda_bytes += spec.nbytes

    def _close(self, tid: str) -> None:
        o = self._open.pop(tid, None)
        if o is not None:
            o.sock.close(linger=0)
            self._released(tid)

    def _drop_abandoned(self) -> None:
        """Pushes whose request never sent its last part (aborted) are let go."""
        now = time.monotonic()
        for tid in [t for t, o in self._open.items() if now - o.at > self.inbox.ttl_s]:
            self._close(tid)

    # ---- the hooks: how the buffers travel ----------------------------------------------------
    def _outgoing(self, header: TransferHeader, frames: Sequence[memoryview]) -> list:
        """What follows the header on the wire: here the buffers themselves."""
        return list(frames)

    def _incoming(self, header: TransferHeader, payload: list[memoryview]) -> list[memoryview]:
        """The buffers of a message whose header was checked: here its frames."""
        return payload

    def _released(self, tid: str) -> None:
        """Transfer `tid` is over on the sending side (acknowledged, failed or abandoned)."""

    # ---- receiving --------------------------------------------------------------------------
    def take(self, transfer_id: str, timeout_s: float) -> Arrived:
        return self.inbox.take(transfer_id, timeout_s)

    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                self.inbox.expire()
                continue
            parts = sock.recv_multipart(copy=False)
            peer, head, frames = parts[0], parts[1:2], [p.buffer for p in parts[2:]]
            tid = ""
            try:
                if not head:
                    raise TransferRefused("an empty message")
                header = wire.decode_header(head[0].bytes)
                tid = header.transfer_id
                wire.check_compatible(header, self.identity, self.layout, self.transport)
                frames = self._incoming(header, frames)
                wire.check_buffers(header, frames)
                self.inbox.put(Arrived(header, frames))
                ack = wire.Ack(tid, True)
            except Exception as exc:     # noqa: BLE001 (whatever a peer sends, this loop lives)
                self.stats.refused += 1
                logger.warning("kv transfer refused: %s", exc)
                ack = wire.Ack(tid, False, str(exc))
            sock.send_multipart([peer, wire.encode(ack)])
        sock.close(linger=0)

    def close(self) -> None:
        for tid in list(self._open):
            self._close(tid)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._ctx.term()
