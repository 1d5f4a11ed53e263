"""The connector on NIXL, the transfer library vLLM and SGLang use (`serve --kv-connector nixl`,
or vLLM's `--kv-transfer-config '{"kv_connector": "NixlConnector", ...}'`).

The control channel stays the ZeroMQ one (zmq_connector.py): one message per part, the same
typed header, one acknowledgement per part. What changes is how the buffers travel. The sender
registers its host buffers with its NIXL agent and sends, after the header, an offer: its
agent's metadata (connection info and the registered regions only) and where each buffer lies.
The receiver loads that metadata, READs every buffer into one registered host region of its
own (decode pulls, vLLM's mode; UCX picks RDMA where the NICs have it, else TCP or shared
memory), then checks the header and every checksum exactly as for ZeroMQ before it
acknowledges. The sender deregisters a transfer's memory once the transfer is over.

Progress: NIXL's own progress thread busy-polls (half a core, idle), so the agents run
without it. The reader drives its READ by polling the transfer; the sender, the READ's passive
target, must progress too (over TCP UCX emulates the READ with messages the target handles), so
a thread polls the sender's agent, only while it has memory registered, and sleeps otherwise.
Never pickle: the offer is a msgspec Struct (NIXL's own descriptor pickling is not used).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kdaserve.config import ConfigError
from kdaserve.disagg.wire import CacheLayout, TransferHeader, TransferRefused
from kdaserve.disagg.zmq_connector import ZmqConnector

INSTALL_HINT = ("the NIXL connector needs the `nixl` package (pip install 'kdaserve[disagg]', "
                "or pip install nixl); without it use --kv-connector zmq")
_POLL_S = 0.0005            # between polls of a READ, and of the sender's agent while it waits


class NixlOffer(msgspec.Struct, frozen=True, tag="nixl_offer"):
    agent: str                          # the sending agent's name
    metadata: bytes                     # its partial metadata: connection info + these regions
    regions: list[tuple[int, int]]      # (address, nbytes) per buffer, header order; (0, 0) empty


_offer_dec = msgspec.msgpack.Decoder(NixlOffer)


def require_nixl() -> Any:
    """nixl's agent API, or a ConfigError saying how to install it."""
    try:
        from nixl import _api
    except ImportError as exc:          # the package, or its compiled backend, is missing
        raise ConfigError(f"{INSTALL_HINT} ({exc})") from None
    # nixl logs to stdout, which belongs to the program's own output (`bench ... --json`)
    for h in logging.getLogger("nixl").handlers:
        if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout:
            h.setStream(sys.stderr)
    return _api


def _address(frame: memoryview) -> int:
    return int(np.frombuffer(frame, dtype=np.uint8).ctypes.data)


class NixlConnector(ZmqConnector):
    transport = "nixl"

    def __init__(self, identity: str, layout: CacheLayout, port: int | None = None,
                 host: str = "127.0.0.1", send_timeout_s: float = 30.0,
                 ttl_s: float = 60.0) -> None:
        api = require_nixl()
        self.agent_name = f"kdaserve-{uuid.uuid4().hex[:16]}"
        self._agent = api.nixl_agent(self.agent_name, api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            raise ConfigError("nixl has no UCX backend here (its plugin did not load)")
        self._nixl = threading.Lock()        # the agent is not thread-safe (sync mode NONE)
        self._regs: dict[str, list[Any]] = {}        # registered memory of sends in flight
        self._has_regs = threading.Condition()
        self._stuck: list[np.ndarray] = []          # regions of READs that could not be cancelled
        self._progress_stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, daemon=True,
                                          name="kdaserve-nixl-progress")
        self._progress.start()
        super().__init__(identity, layout, port, host, send_timeout_s, ttl_s)

    # ---- sending: register, offer, keep registered until the transfer is over -------------
    def _outgoing(self, header: TransferHeader, frames: Sequence[memoryview]) -> list:
        regions = [(_address(f), len(f)) if len(f) else (0, 0) for f in frames]
        used = [(a, n, 0, "") for a, n in regions if n]
        metadata = b""
        if used:
            with self._nixl:
                reg = self._agent.register_memory(used, "DRAM")
                metadata = self._agent.get_partial_agent_metadata(reg, True, ["UCX"])
            with self._has_regs:
                self._regs.setdefault(header.transfer_id, []).append(reg)
                self._has_regs.notify_all()
        return [msgspec.msgpack.encode(NixlOffer(self.agent_name, metadata, regions))]

    def _released(self, tid: str) -> None:
        with self._has_regs:
            regs = self._regs.pop(tid, [])
        with self._nixl:
            for reg in regs:
                self._agent.deregister_memory(reg)

    def _progress_loop(self) -> None:
        while not self._progress_stop.is_set():
            with self._has_regs:
                if not self._regs:
                    self._has_regs.wait(0.5)
                    continue
            with self._nixl:
                self._agent.get_new_notifs()     # progresses the worker the READs target
            time.sleep(_POLL_S)

    # ---- receiving: READ every buffer into one registered region ----------------------------
    def _incoming(self, header: TransferHeader, payload: list[memoryview]) -> list[memoryview]:
        tid = header.transfer_id
        if len(payload) != 1:
            raise TransferRefused(f"transfer {tid}: {len(payload)} frames after a NIXL header, "
                                  "expected one offer")
        try:
            offer = _offer_dec.decode(payload[0])
        except msgspec.DecodeError as exc:
            raise TransferRefused(f"transfer {tid}: not a NIXL offer: {exc}") from None
        if [n for _, n in offer.regions] != [b.nbytes for b in header.buffers]:
            raise TransferRefused(f"transfer {tid}: the offer's regions "
                                  f"{[n for _, n in offer.regions]} do not match the header's "
                                  f"buffer sizes {[b.nbytes for b in header.buffers]}")
        offsets = np.cumsum([0] + [n for _, n in offer.regions]).tolist()
        buf = np.empty(max(offsets[-1], 1), dtype=np.uint8)
        wanted = [(a, n, o) for (a, n), o in zip(offer.regions, offsets) if n]
        if wanted:
            self._read(tid, offer, buf, wanted)
        view = memoryview(buf)
        return [view[o:o + n] for (_, n), o in zip(offer.regions, offsets)]

    def _read(self, tid: str, offer: NixlOffer, buf: np.ndarray,
              wanted: list[tuple[int, int, int]]) -> None:
        base = int(buf.ctypes.data)
        a = self._agent
        with self._nixl:
            try:
                peer = a.add_remote_agent(offer.metadata)
            except Exception as exc:   # noqa: BLE001 (nixl raises its own error types)
                raise TransferRefused(f"transfer {tid}: bad NIXL metadata from "
                                      f"{offer.agent}: {exc}") from None
            reg = a.register_memory([(base, buf.nbytes, 0, "")], "DRAM")
            handle = None
            try:
                local = a.get_xfer_descs([(base + o, n, 0) for _, n, o in wanted], "DRAM")
                remote = a.get_xfer_descs([(addr, n, 0) for addr, n, _ in wanted], "DRAM")
                handle = a.initialize_xfer("READ", local, remote, peer, tid.encode())
                state = a.transfer(handle)
            except Exception as exc:   # noqa: BLE001
                if handle is not None:
                    a.release_xfer_handle(handle)
                a.deregister_memory(reg)
                raise TransferRefused(f"transfer {tid}: the NIXL READ from {offer.agent} "
                                      f"could not start: {exc}") from None
        deadline = time.monotonic() + self.send_timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            with self._nixl:
                state = a.check_xfer_state(handle)
        with self._nixl:
            try:
                a.release_xfer_handle(handle)    # cancels a READ still running
                a.deregister_memory(reg)
            except Exception:          # noqa: BLE001 (not cancellable: keep buf alive)
                self._stuck.append(buf)
        if state != "DONE":
            raise TransferRefused(f"transfer {tid}: the NIXL READ from {offer.agent} "
                                  + ("failed" if state == "ERR" else
                                     f"did not finish within {self.send_timeout_s:g} s"))

    def close(self) -> None:
        super().close()
        self._progress_stop.set()
        with self._has_regs:
            self._has_regs.notify_all()
        self._progress.join(timeout=2)
