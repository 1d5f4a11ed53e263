"""The NIXL connector on loopback, without a model: the header and offer travel on the ZeroMQ
channel, the receiver READs the buffers through NIXL's UCX backend; pushed parts join in token
order; a buffer whose bytes no longer match the header's checksum (changed before the READ) is
refused and the refusal reaches the sender; a ZeroMQ sender is refused by a NIXL receiver with
a clear error; the sender's memory is deregistered once its transfer is over."""

from __future__ import annotations

import msgspec
import pytest

from kdaserve.disagg import wire
from kdaserve.disagg.connector import TransferFailed
from kdaserve.disagg.zmq_connector import ZmqConnector

pytest.importorskip("nixl", reason="nixl is not installed (pip install 'kdaserve[disagg]')")

from test_connector import LAYOUT, _part, transfer

from kdaserve.disagg.nixl_connector import NixlConnector


@pytest.fixture(scope="module")
def pair():
    recv = NixlConnector("m1", LAYOUT, port=0, send_timeout_s=5.0)
    send = NixlConnector("m1", LAYOUT, send_timeout_s=5.0)
    yield send, recv
    send.close()
    recv.close()


def _writable(frames):
    return [memoryview(bytearray(f)) for f in frames]


def test_arrives_whole_through_a_read(pair):
    send, recv = pair
    header, frames = transfer("a")
    big = memoryview(bytearray(1 << 20))            # and one buffer of 1 MiB
    big[::4096] = bytes(range(256))
    frames = [*frames, big]
    spec = wire.BufferSpec("big", "uint8", [len(big)], len(big), wire.checksum(big))
    header = msgspec.structs.replace(header, buffers=[*header.buffers, spec])
    send.send(recv.address, header, frames)
    got = recv.take("a", 1.0)
    assert got.header.transport == "nixl" and got.header.buffers == header.buffers
    assert [bytes(f) for f in got.frames] == [bytes(f) for f in frames]
    assert not send._regs                   # deregistered once acknowledged


def test_pushed_parts_join_in_token_order():
    layout = msgspec.structs.replace(LAYOUT, mla_layers=[3], kda_layers=[0])
    recv = NixlConnector("m1", layout, port=0, send_timeout_s=5.0)
    send = NixlConnector("m1", layout, send_timeout_s=5.0)
    try:
        send.push(recv.address, *_part("p", 0, 0, 2, False, b"ab"))
        send.push(recv.address, *_part("p", 1, 2, 4, False, b"cd"))
        send.send(recv.address, *_part("p", 2, 4, 5, True, b"e"))
        got = recv.take("p", 1.0)
        assert bytes(got.frames[0]) == b"abcde" and bytes(got.frames[1]) == b"s" * 8
        assert send.stats.parts_pushed == 2 and send.stats.sent == 1 and not send._regs
    finally:
        send.close()
        recv.close()


def test_checksum_mismatch_is_refused(pair):
    """The sender's buffer changes after its header was written (a page reused before the
    READ): the bytes read no longer match the checksum, and the transfer is refused."""
    send, recv = pair
    header, frames = transfer("c")
    frames = _writable(frames)
    frames[1][0] ^= 0xFF
    refused = recv.stats.refused
    with pytest.raises(TransferFailed, match="refused transfer c: .*buffer b1 fails its "
                                             "checksum"):
        send.send(recv.address, header, frames)
    assert recv.stats.refused == refused + 1 and recv.stats.pending == 0
    assert not send._regs


def test_a_zmq_sender_is_refused_clearly(pair):
    _, recv = pair
    send = ZmqConnector("m1", LAYOUT, send_timeout_s=5.0)
    try:
        with pytest.raises(TransferFailed, match="sent over zmq; this instance receives over "
                                                 "nixl: give both sides the same --kv-connector"):
            send.send(recv.address, *transfer("z"))
    finally:
        send.close()
