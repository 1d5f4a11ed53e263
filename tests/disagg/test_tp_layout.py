"""Tensor-parallel layouts of a transfer (kdaserve/disagg/tp_layout.py), without a model: a
whole (TP=1) transfer split into the messages of 2 and 4 ranks joins back to the same bytes;
each rank holds its heads' states and conv columns (and, split for a TP=N receiver, every
rank the latents and draft pages); the ranks' messages sent over real sockets
to a TP=1 receiver arrive joined (a lone rank's expires); shards that do not fit together are
refused."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kdaserve.disagg import tp_layout, wire
from kdaserve.disagg.connector import TransferFailed
from kdaserve.disagg.wire import BufferSpec, CacheLayout, TransferHeader, TransferRefused
from kdaserve.disagg.zmq_connector import ZmqConnector

H, D, KM1, T = 4, 3, 3, 5            # heads, head dim, conv window rows, tokens
LAYOUT = CacheLayout("float32", [1, 3], 6, [0, 2], H, D, KM1 + 1, 3 * H * D)
# with a DSpark draft's pages (one layer of width 5, and which positions hold context)
DRAFTED = msgspec.structs.replace(LAYOUT, draft_layers=1, draft_latent_dim=5)


def whole(tid: str = "w", layout: CacheLayout = LAYOUT
          ) -> tuple[TransferHeader, list[memoryview]]:
    rng = np.random.default_rng(7)
    arrays = ([rng.standard_normal((T, 6), dtype=np.float32) for _ in layout.mla_layers]
              + [rng.standard_normal((H, D, D), dtype=np.float32) for _ in layout.kda_layers]
              + [rng.standard_normal((KM1, 3 * H * D), dtype=np.float32)
                 for _ in layout.kda_layers])
    if layout.draft_layers:
        arrays += [rng.standard_normal((T, 5), dtype=np.float32),
                   np.array([1, 1, 0, 1, 1], dtype=np.uint8)]
    frames = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays]
    specs = [BufferSpec(n, str(a.dtype), list(a.shape), a.nbytes, wire.checksum(f))
             for n, a, f in zip(wire.expected_names(layout), arrays, frames)]
    return TransferHeader(wire.VERSION, tid, "m1", layout, T, 9, 11, specs,
                          draft_token_ids=[4, 5] if layout.draft_layers else []), frames


@pytest.mark.parametrize("tp, layout", [(2, LAYOUT), (4, LAYOUT), (2, DRAFTED)])
def test_split_then_join_is_identity(tp, layout):
    header, frames = whole(layout=layout)
    shards = tp_layout.split(header, frames, tp)
    assert [h.layout.tp_rank for h, _ in shards] == list(range(tp))
    assert all(h.layout.kda_num_heads == H // tp for h, _ in shards)
    # the latents (and the draft's pages) travel once, with rank 0
    assert [b.name for b in shards[0][0].buffers] == wire.expected_names(layout)
    assert [b.name for b in shards[1][0].buffers] == wire.cache_names(layout)[2:]
    for h, f in shards:
        wire.check_buffers(h, f)                     # every shard's checksums hold
    # rank r holds heads [r·H/tp, (r+1)·H/tp) of the state and of q, k and v's conv columns
    state = np.frombuffer(frames[2], np.float32).reshape(H, D, D)
    conv = np.frombuffer(frames[4], np.float32).reshape(KM1, 3, H, D)
    for r, (h, f) in enumerate(shards):
        n = 2 if r == 0 else 0               # its first KDA buffer
        heads = slice(r * H // tp, (r + 1) * H // tp)
        assert np.array_equal(np.frombuffer(f[n], np.float32).reshape(-1, D, D), state[heads])
        got = np.frombuffer(f[n + 2], np.float32).reshape(KM1, 3, H // tp, D)
        assert np.array_equal(got, conv[:, :, heads])
    for order in (shards, shards[::-1]):
        jh, jf = tp_layout.join(order)
        assert jh == header
        assert [bytes(f) for f in jf] == [bytes(f) for f in frames]


@pytest.mark.parametrize("layout", [LAYOUT, DRAFTED])
def test_split_for_receiving_ranks_replicates_the_latents(layout):
    """What each rank of a TP=2 decode instance installs: its heads, as a sender's rank sends
    them, plus everything per token (latents, draft pages), unchanged, on every rank."""
    header, frames = whole(layout=layout)
    sent = tp_layout.split(header, frames, 2)
    got = tp_layout.split(header, frames, 2, replicate=True)
    per_token = [i for i, b in enumerate(header.buffers) if not b.name.startswith("kda_")]
    for r, ((h, f), (sh, sf)) in enumerate(zip(got, sent)):
        wire.check_buffers(h, f)
        assert h.layout == sh.layout and h.layout.tp_rank == r
        assert [b.name for b in h.buffers] == [b.name for b in header.buffers]
        assert [bytes(f[i]) for i in per_token] == [bytes(frames[i]) for i in per_token]
        kda = [bytes(x) for b, x in zip(h.buffers, f) if b.name.startswith("kda_")]
        assert kda == [bytes(x) for b, x in zip(sh.buffers, sf) if b.name.startswith("kda_")]


def test_shards_that_do_not_fit_are_refused():
    header, frames = whole()
    a, b = tp_layout.split(header, frames, 2)
    with pytest.raises(TransferRefused, match=r"ranks \[0\] of a TP=2 sender"):
        tp_layout.join([a])
    other = (msgspec.structs.replace(b[0], token_hash=1), b[1])
    with pytest.raises(TransferRefused, match="rank 1's message does not match rank 0's"):
        tp_layout.join([a, other])


def test_ranks_sent_to_a_tp1_receiver_arrive_joined():
    recv = ZmqConnector("m1", LAYOUT, port=0, send_timeout_s=2.0)
    senders = [ZmqConnector("m1", tp_layout.rank_layout(LAYOUT, 2, r), send_timeout_s=2.0)
               for r in range(2)]
    try:
        header, frames = whole("j")
        shards = tp_layout.split(header, frames, 2)
        senders[1].send(recv.address, *shards[1])
        assert recv.stats.pending == 1 and recv.stats.received == 0   # waits for rank 0
        senders[0].send(recv.address, *shards[0])
        got = recv.take("j", 1.0)
        assert got.header == header
        assert [bytes(f) for f in got.frames] == [bytes(f) for f in frames]
        assert recv.stats.pending == 0
        # a rank whose sibling never sends expires like any transfer nobody takes
        senders[1].send(recv.address, *tp_layout.split(*whole("lone"), 2)[1])
        assert recv.stats.pending == 1
        recv.inbox.ttl_s = 0.0
        recv.inbox.expire()
        assert recv.stats.pending == recv.stats.pending_bytes == 0 and recv.stats.expired == 1
        recv.inbox.ttl_s = 60.0
        # a shard of another model's layout (other head counts in total) is refused
        bad = tp_layout.split(*whole("k"), 2)[1]
        lay = msgspec.structs.replace(bad[0].layout, kda_num_heads=1, kda_conv_dim=3 * D)
        with pytest.raises(TransferFailed, match="differs in kda_num_heads, kda_conv_dim"):
            senders[1].send(recv.address, msgspec.structs.replace(bad[0], layout=lay), bad[1])
    finally:
        for c in (*senders, recv):
            c.close()
