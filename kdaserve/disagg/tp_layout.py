"""Tensor-parallel layouts of a transfer: a TP=N prefill instance sends N messages (one per
rank), the decode instance joins them into one; `split` is the inverse: what a TP=N sender's
ranks send (latents from rank 0 only), or, with `replicate`, what each rank of a TP=N decode
instance installs (latents on every rank; kdaserve/disagg/rank_receive.py).

What each rank holds (kdaserve/distributed/layout.py): the KDA heads are split evenly and in
order over the ranks, so
  kda_state.{j}  [H/N, K, V]        rank r holds heads [r·H/N, (r+1)·H/N): joined along dim 0
  kda_conv.{j}   [K-1, 3·(H/N)·K]   q | k | v inputs, each its heads' columns: joined per part
while the MLA latents are per token, not per head, and so the same on every rank: only rank 0
sends them (and pushes parts while the prompt computes; the DSpark draft's pages likewise), the
other ranks send their KDA shards alone. Pure functions over a header and its raw frames
(torch-free); every checksum
of the result is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from kdaserve.disagg import wire
from kdaserve.disagg.wire import BufferSpec, CacheLayout, TransferHeader, TransferRefused

Message = tuple[TransferHeader, list[memoryview]]


def rank_layout(layout: CacheLayout, tp_size: int, tp_rank: int) -> CacheLayout:
    """Rank `tp_rank`'s shard of a whole (TP=1) layout."""
    if layout.tp_size != 1 or layout.kda_num_heads % tp_size:
        raise ValueError(f"{layout.kda_num_heads} KDA heads (TP {layout.tp_size}) do not "
                         f"split over {tp_size} ranks")
    return msgspec.structs.replace(layout, kda_num_heads=layout.kda_num_heads // tp_size,
                                   kda_conv_dim=layout.kda_conv_dim // tp_size,
                                   tp_size=tp_size, tp_rank=tp_rank)


def _spec(name: str, dtype: str, shape: list[int], frame: memoryview) -> BufferSpec:
    return BufferSpec(name, dtype, shape, len(frame), wire.checksum(frame))


def _rows(frame: memoryview, spec: BufferSpec) -> np.ndarray:
    """A conv window's bytes as [K-1, 3 (q, k, v), bytes of this rank's heads]."""
    return np.frombuffer(frame, np.uint8).reshape(spec.shape[0], 3, -1)


def _is_kda(name: str) -> bool:
    return name.startswith(("kda_state.", "kda_conv."))


def split(header: TransferHeader, frames: Sequence[memoryview], tp_size: int,
          replicate: bool = False) -> list[Message]:
    """A whole (TP=1) transfer as the `tp_size` messages its ranks would send; `replicate`:
    as its ranks would receive (the latents and draft pages, per token, on every rank)."""
    out = []
    for r in range(tp_size):
        specs: list[BufferSpec] = []
        parts: list[memoryview] = []
        for spec, f in zip(header.buffers, frames):
            if not _is_kda(spec.name):              # latents, draft pages: per token
                if r == 0 or replicate:
                    specs.append(spec)
                    parts.append(f)
                continue
            if spec.name.startswith("kda_state."):
                n = spec.shape[0] // tp_size        # [H, K, V]: contiguous heads
                per = len(f) // spec.shape[0]
                g = memoryview(f)[r * n * per:(r + 1) * n * per]
                shape = [n, *spec.shape[1:]]
            else:                                   # [K-1, 3HK]: each part's heads
                rows = _rows(f, spec)
                w = rows.shape[2] // tp_size
                g = memoryview(np.ascontiguousarray(rows[:, :, r * w:(r + 1) * w]).reshape(-1))
                shape = [spec.shape[0], spec.shape[1] // tp_size]
            specs.append(_spec(spec.name, spec.dtype, shape, g))
            parts.append(g)
        extra = {} if r == 0 or replicate else {"part": 0, "token_start": 0}
        out.append((msgspec.structs.replace(
            header, layout=rank_layout(header.layout, tp_size, r), buffers=specs, **extra),
            parts))
    return out


def join(shards: Sequence[Message]) -> Message:
    """The messages of every rank of a TP=N sender (any order) as one whole (TP=1) transfer.
    TransferRefused when they do not fit together."""
    shards = sorted(shards, key=lambda m: m[0].layout.tp_rank)
    h0 = shards[0][0]
    tid, tp = h0.transfer_id, h0.layout.tp_size
    if [h.layout.tp_rank for h, _ in shards] != list(range(tp)):
        raise TransferRefused(f"transfer {tid}: ranks {[h.layout.tp_rank for h, _ in shards]} "
                              f"of a TP={tp} sender arrived")
    for h, _ in shards[1:]:
        same = (h.layout.tp_size, h.layout.whole(), h.model_identity, h.num_tokens,
                h.token_hash, h.first_token_id)
        if same != (tp, h0.layout.whole(), h0.model_identity, h0.num_tokens,
                    h0.token_hash, h0.first_token_id):
            raise TransferRefused(f"transfer {tid}: rank {h.layout.tp_rank}'s message does "
                                  "not match rank 0's (layout, model, prompt or first token)")
    for h, _ in shards:
        got = [b.name for b in h.buffers]
        want = wire.expected_names(h.layout)
        if got != want:
            raise TransferRefused(f"transfer {tid}: rank {h.layout.tp_rank} sent buffers "
                                  f"{got}, its layout needs {want}")
    by_rank = [dict(zip((b.name for b in h.buffers), zip(h.buffers, f))) for h, f in shards]
    specs: list[BufferSpec] = []
    frames: list[memoryview] = []
    for spec, f in zip(h0.buffers, shards[0][1]):
        if not _is_kda(spec.name):
            specs.append(spec)
            frames.append(f)
            continue
        parts = [r[spec.name] for r in by_rank]
        if spec.name.startswith("kda_state."):
            g = memoryview(b"".join(bytes(f) for _, f in parts))
            shape = [sum(s.shape[0] for s, _ in parts), *spec.shape[1:]]
        else:
            g = memoryview(np.concatenate([_rows(f, s) for s, f in parts], axis=2).reshape(-1))
            shape = [spec.shape[0], sum(s.shape[1] for s, _ in parts)]
        specs.append(_spec(spec.name, spec.dtype, shape, g))
        frames.append(g)
    header = msgspec.structs.replace(h0, layout=h0.layout.whole(), buffers=specs)
    return header, frames
