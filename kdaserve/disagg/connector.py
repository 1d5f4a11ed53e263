"""The connector interface: send one request's cache to another instance, or take one that
arrived, by transfer id; and the inbox where arrived transfers wait for their request.

A connector moves bytes and checks them; it decides nothing about scheduling. The prefill
side sends when its request finished (the send returns once the receiver acknowledged, so the
prefill instance answers only after the cache is safe on the other side). The decode side
keeps each arrived transfer in host memory until its request takes it; one that nobody takes
within `ttl_s` is dropped (a proxy that gave up, a decode request that never came), so host
memory never leaks. Device pages are allocated only when the request is admitted. A
tensor-parallel sender's ranks each send their share (tp_layout.py); the inbox joins them
into one transfer once every rank's has arrived.
Implementations: zmq_connector.py (the buffers as raw frames) and nixl_connector.py (the
same control channel; the decode side READs the buffers through NIXL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kdaserve.disagg import tp_layout, wire
from kdaserve.disagg.wire import BufferSpec, TransferHeader, TransferRefused

# how a request's error starts when its cache transfer failed: the server answers it with a
# 503 `kv_transfer_failed` (kdaserve/server/errors.py), which the proxy retries elsewhere
FAILED_PREFIX = "kv transfer failed: "


class TransferFailed(RuntimeError):
    """A send that was not acknowledged (peer gone, refused), or a transfer that never came."""


@dataclass
class Arrived:
    header: TransferHeader
    frames: list[memoryview]
    at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


@dataclass
class ConnectorStats:
    sent: int = 0
    parts_pushed: int = 0        # push mode: parts sent while their prompt was computed
    sent_mla_bytes: int = 0
    sent_kda_bytes: int = 0
    sent_draft_bytes: int = 0    # the DSpark draft's pages
    send_seconds: float = 0.0
    send_failures: int = 0
    received: int = 0
    received_bytes: int = 0
    refused: int = 0
    taken: int = 0
    expired: int = 0
    missing: int = 0
    pending: int = 0             # transfers in the inbox now
    pending_bytes: int = 0


class Connector(Protocol):
    address: str | None          # where peers push to (None: this instance only sends)
    stats: ConnectorStats

    def push(self, peer: str, header: TransferHeader, frames: Sequence[memoryview]) -> None:
        """Push mode: send a part that is not the last without waiting (`header.final` False);
        the send of the last part waits for every acknowledgement."""

    def send(self, peer: str, header: TransferHeader, frames: Sequence[memoryview]) -> None:
        """Raises TransferFailed unless `peer` acknowledged the whole transfer (every part)."""

    def take(self, transfer_id: str, timeout_s: float) -> Arrived:
        """The transfer, waiting up to `timeout_s` for it; TransferFailed if it never came."""

    def close(self) -> None: ...


class Inbox:
    """Arrived transfers by id, thread-safe (the receiver thread puts, the runner takes)."""

    def __init__(self, stats: ConnectorStats, ttl_s: float) -> None:
        self.stats = stats
        self.ttl_s = ttl_s
        self._items: dict[str, Arrived] = {}
        # push mode: parts before the last, by transfer id and sender rank
        self._parts: dict[tuple[str, int], list[Arrived]] = {}
        # a tensor-parallel sender's ranks that arrived, by transfer id and rank
        self._shards: dict[str, dict[int, Arrived]] = {}
        self._cv = threading.Condition()

    def put(self, item: Arrived) -> None:
        """Raises TransferRefused when the last part does not complete the parts before it,
        or a tensor-parallel sender's ranks do not fit together."""
        tid, rank = item.header.transfer_id, item.header.layout.tp_rank
        with self._cv:
            self._expire()
            if not item.header.final:
                self._parts.setdefault((tid, rank), []).append(item)
                self._count()
                return
            parts = self._parts.pop((tid, rank), [])
            if parts or item.header.part:
                item = assemble(parts, item)
            tp = item.header.layout.tp_size
            if tp > 1:             # one message per rank of the sender: joined once all came
                got = self._shards.setdefault(tid, {})
                got[rank] = item
                if len(got) < tp:
                    self._count()
                    return
                del self._shards[tid]
                header, frames = tp_layout.join([(a.header, a.frames) for a in got.values()])
                item = Arrived(header, frames)
            self._items.pop(tid, None)
            self._items[tid] = item
            self.stats.received += 1
            self.stats.received_bytes += item.nbytes
            self._count()
            self._cv.notify_all()

    def take(self, transfer_id: str, timeout_s: float) -> Arrived:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while transfer_id not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats.missing += 1
                    raise TransferFailed(f"transfer {transfer_id} did not arrive within "
                                         f"{timeout_s:g} s (the prefill instance never sent it, "
                                         "or it expired)")
                self._cv.wait(left)
            item = self._items.pop(transfer_id)
            self.stats.taken += 1
            self._expire()
            self._count()
            return item

    def peek(self, transfer_id: str) -> TransferHeader | None:
        """The header of an arrived transfer, left in the inbox (None: not here yet)."""
        with self._cv:
            item = self._items.get(transfer_id)
            return item.header if item is not None else None

    def expire(self) -> None:
        with self._cv:
            self._expire()
            self._count()

    def _expire(self) -> None:
        now = time.monotonic()
        for tid in [t for t, a in self._items.items() if now - a.at > self.ttl_s]:
            del self._items[tid]
            self.stats.expired += 1
        for key in [k for k, ps in self._parts.items() if now - ps[-1].at > self.ttl_s]:
            del self._parts[key]         # a push whose request never finished (aborted)
            self.stats.expired += 1
        for tid in [t for t, g in self._shards.items()
                    if now - max(a.at for a in g.values()) > self.ttl_s]:
            del self._shards[tid]        # a rank whose message never came
            self.stats.expired += 1

    def _count(self) -> None:
        self.stats.pending = len(self._items) + len(self._parts) + len(self._shards)
        self.stats.pending_bytes = (sum(a.nbytes for a in self._items.values())
                                    + sum(a.nbytes for ps in self._parts.values() for a in ps)
                                    + sum(a.nbytes for g in self._shards.values()
                                          for a in g.values()))


def assemble(parts: list[Arrived], last: Arrived) -> Arrived:
    """One transfer from its pushed parts and its last part: each MLA layer's latents joined
    in token order (from the first token the receiver does not hold), the KDA states from the
    last part."""
    heads = [p.header for p in parts] + [last.header]
    tid = last.header.transfer_id
    if [h.part for h in heads] != list(range(len(heads))):
        raise TransferRefused(f"transfer {tid}: parts {[h.part for h in heads]} arrived, not "
                              f"0..{len(heads) - 1}")
    held = last.header.held_tokens
    if any(h.held_tokens != held for h in heads):
        raise TransferRefused(f"transfer {tid}: parts disagree on the tokens held here")
    at = held
    for h in heads:
        if h.token_start != at:
            raise TransferRefused(f"transfer {tid}: part {h.part} starts at token "
                                  f"{h.token_start}, the parts before end at {at}")
        at = h.num_tokens
    nm = len(last.header.layout.mla_layers)
    frames: list[memoryview] = []
    specs: list[BufferSpec] = []
    for i in range(nm):
        joined = memoryview(b"".join(bytes(p.frames[i]) for p in [*parts, last]))
        s = last.header.buffers[i]
        specs.append(BufferSpec(s.name, s.dtype, [last.header.num_tokens - held, *s.shape[1:]],
                                len(joined), wire.checksum(joined)))
        frames.append(joined)
    header = msgspec.structs.replace(last.header, buffers=specs + last.header.buffers[nm:],
                                     part=0, token_start=held)
    return Arrived(header, frames + last.frames[nm:])
