"""The ZeroMQ connector on real loopback sockets, without a model: a transfer arrives whole;
another model, another layout or a corrupted buffer is refused with a clear error that reaches
the sender; a peer that is not there fails the send within its timeout; an arrived transfer
nobody takes expires, and a take of one that never came times out."""

from __future__ import annotations

import msgspec
import pytest

from kdaserve.disagg import wire
from kdaserve.disagg.connector import TransferFailed
from kdaserve.disagg.field import parse_kv_transfer
from kdaserve.disagg.wire import BufferSpec, CacheLayout, TransferHeader
from kdaserve.disagg.zmq_connector import ZmqConnector
from kdaserve.request import SamplingParamsError

LAYOUT = CacheLayout("float32", [3], 8, [0, 1, 2], 2, 4, 4, 24)


def transfer(tid: str, identity: str = "m1", layout: CacheLayout = LAYOUT):
    frames = [memoryview(bytes([i]) * (16 + i)) for i in range(3)]
    specs = [BufferSpec(f"b{i}", "uint8", [len(f)], len(f), wire.checksum(f))
             for i, f in enumerate(frames)]
    return TransferHeader(wire.VERSION, tid, identity, layout, 5, 7, 11, specs), frames


@pytest.fixture()
def pair():
    recv = ZmqConnector("m1", LAYOUT, port=0, send_timeout_s=2.0, ttl_s=60.0)
    send = ZmqConnector("m1", LAYOUT, send_timeout_s=2.0)
    yield send, recv
    send.close()
    recv.close()


def test_arrives_whole(pair):
    send, recv = pair
    header, frames = transfer("a")
    send.send(recv.address, header, frames)
    got = recv.take("a", 1.0)
    assert got.header == header
    assert [bytes(f) for f in got.frames] == [bytes(f) for f in frames]
    assert recv.stats.received == recv.stats.taken == 1 and recv.stats.pending == 0


@pytest.mark.parametrize("case, message", [
    ("model", "comes from another model"),
    ("layout", "another cache layout (differs in kda_num_heads"),
    ("checksum", "fails its checksum"),
    ("size", "has 3 bytes, the header says 16"),
])
def test_refused_with_a_clear_error(pair, case, message):
    send, recv = pair
    header, frames = transfer("r")
    if case == "model":
        header = msgspec.structs.replace(header, model_identity="m2")
    elif case == "layout":
        header = msgspec.structs.replace(header, layout=msgspec.structs.replace(
            LAYOUT, kda_num_heads=1))
    elif case == "checksum":
        frames[0] = memoryview(b"\xff" * 16)
    else:
        frames[0] = memoryview(b"abc")
    with pytest.raises(TransferFailed, match="refused transfer r: .*" + message.replace(
            "(", r"\(")):
        send.send(recv.address, header, frames)
    assert recv.stats.refused == 1 and recv.stats.pending == 0
    assert send.stats.send_failures == 1


def test_absent_peer_fails_within_the_timeout():
    send = ZmqConnector("m1", LAYOUT, send_timeout_s=0.5)
    header, frames = transfer("x")
    with pytest.raises(TransferFailed, match="did not acknowledge transfer x within 0.5 s"):
        send.send("tcp://127.0.0.1:9", header, frames)
    send.close()


def test_untaken_transfers_expire_and_missing_ones_time_out(pair):
    send, recv = pair
    recv.inbox.ttl_s = 0.0
    header, frames = transfer("e")
    send.send(recv.address, header, frames)
    recv.inbox.expire()
    assert recv.stats.expired == 1 and recv.stats.pending == recv.stats.pending_bytes == 0
    with pytest.raises(TransferFailed, match="did not arrive within 0.2 s"):
        recv.take("e", 0.2)
    assert recv.stats.missing == 1


def test_request_field_checked():
    assert parse_kv_transfer({"transfer_id": "t", "peer": "tcp://127.0.0.1:5"}).is_export
    assert parse_kv_transfer({"transfer_id": "t", "first_token_id": 3}).is_import
    for bad in ({"transfer_id": "t"}, {"transfer_id": "t", "peer": "x", "first_token_id": 1},
                {"transfer_id": "t", "peer": "http://a:1"}, {"transfer_id": "", "peer": None},
                {"transfer_id": "t", "first_token_id": -1}, {"transfer_id": "t", "foo": 1}, []):
        with pytest.raises(SamplingParamsError):
            parse_kv_transfer(bad)


def test_malformed_messages_are_refused_and_the_receiver_lives_on(pair):
    import zmq

    send, recv = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(recv.address)
    for msg in ([b"not msgpack"], [b""], [wire.encode(wire.Ack("x", True))]):
        sock.send_multipart(msg)
        assert sock.poll(2000)
        assert not wire.decode_ack(sock.recv()).ok
    sock.close()
    header, frames = transfer("after")
    send.send(recv.address, header, frames)
    assert recv.take("after", 1.0).header == header


def _part(tid: str, part: int, start: int, end: int, final: bool, rows: bytes):
    frames = [memoryview(rows)] + ([memoryview(b"s" * 8)] if final else [])
    names = ["mla.0"] + (["kda_state.0"] if final else [])
    specs = [BufferSpec(n, "uint8", [len(f)], len(f), wire.checksum(f))
             for n, f in zip(names, frames)]
    layout = msgspec.structs.replace(LAYOUT, mla_layers=[3], kda_layers=[0])
    return TransferHeader(wire.VERSION, tid, "m1", layout, end, 7 if final else 0,
                          11 if final else -1, specs, part, start, final), frames


def test_pushed_parts_join_in_token_order():
    layout = msgspec.structs.replace(LAYOUT, mla_layers=[3], kda_layers=[0])
    recv = ZmqConnector("m1", layout, port=0, send_timeout_s=2.0)
    send = ZmqConnector("m1", layout, send_timeout_s=2.0)
    try:
        send.push(recv.address, *_part("p", 0, 0, 2, False, b"ab"))
        send.push(recv.address, *_part("p", 1, 2, 4, False, b"cd"))
        send.send(recv.address, *_part("p", 2, 4, 5, True, b"e"))
        got = recv.take("p", 1.0)
        assert bytes(got.frames[0]) == b"abcde" and bytes(got.frames[1]) == b"s" * 8
        assert got.header.num_tokens == 5 and got.header.buffers[0].shape == [5]
        assert send.stats.parts_pushed == 2 and send.stats.sent == 1
        # a last part whose earlier parts never came is refused
        with pytest.raises(TransferFailed, match=r"parts \[2\] arrived, not 0..0"):
            send.send(recv.address, *_part("q", 2, 4, 5, True, b"e"))
    finally:
        send.close()
        recv.close()
