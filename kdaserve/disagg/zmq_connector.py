"""The connector on ZeroMQ: a ROUTER socket on the kv-transfer port receives, a DEALER per
send pushes. One transfer = one multipart message: [msgpack header, buffer 0, buffer 1, ...],
the buffers sent zero-copy from the sender's host views; the receiver checks the header
against its own model and layout and every buffer's checksum before it acknowledges, so a
refusal reaches the sender (and its client) as a clear error. Never pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import zmq

from kdaserve.disagg import wire
from kdaserve.disagg.connector import Arrived, ConnectorStats, Inbox, TransferFailed
from kdaserve.disagg.wire import CacheLayout, TransferHeader, TransferRefused

logger = logging.getLogger("kdaserve")


class ZmqConnector:
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
    def send(self, peer: str, header: TransferHeader, frames: Sequence[memoryview]) -> None:
        start = time.perf_counter()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        try:
            sock.connect(peer)
            # zero-copy: the frames are views of host tensors the caller holds until we return
            sock.send_multipart([wire.encode(header), *frames], copy=False)
            if not sock.poll(int(self.send_timeout_s * 1000)):
                raise TransferFailed(f"the decode instance at {peer} did not acknowledge "
                                     f"transfer {header.transfer_id} within "
                                     f"{self.send_timeout_s:g} s")
            ack = wire.decode_ack(sock.recv())
            if not ack.ok:
                raise TransferFailed(f"the decode instance at {peer} refused transfer "
                                     f"{header.transfer_id}: {ack.error}")
        except TransferFailed:
            self.stats.send_failures += 1
            raise
        except Exception as exc:
            self.stats.send_failures += 1
            raise TransferFailed(f"sending transfer {header.transfer_id} to {peer} failed: "
                                 f"{exc}") from None
        finally:
            sock.close(linger=0)
        self.stats.sent += 1
        for spec in header.buffers:
            if spec.name.startswith("mla."):
                self.stats.sent_mla_bytes += spec.nbytes
            else:
                self.stats.sent_kda_bytes += spec.nbytes
        self.stats.send_seconds += time.perf_counter() - start

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
                wire.check_compatible(header, self.identity, self.layout)
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
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._ctx.term()
