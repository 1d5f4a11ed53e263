"""Carries out the offload tiers' cache operations (kdaserve/cache/ops.py TIER_OPS) against the
device cache and the tiers' stores, for the executor of a step's cache operations
(kdaserve/engine/cache_ops.py).

This is the torch side of offloading: an entry's payload is the raw bytes of its device
tensors, concatenated in a fixed order (a block: its latents in every MLA layer; a snapshot:
the recurrent state of every KDA layer, then every conv window), read through byte views so no
dtype conversion or alignment is involved. Operations run in order, before the forward: stores
read device entries before the step reuses them, loads fill blocks and slots before the step
reads them. A failure is reported, never raised: a failed load leaves its request out of the
step (the scheduler recomputes it), a failed store only loses the entry.

On CPU the copies run inline (they are memcpy-sized next to a prefill). On CUDA the host tier
sits in pinned memory; moving the copies to a side stream, off the step's critical path, is
the next step and needs nothing from the bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import numpy as np
import torch

from kdaserve.cache.offload import Offload
from kdaserve.cache.ops import (
    BLOCK,
    SNAPSHOT,
    CacheOp,
    DropEntry,
    KeepState,
    LoadBlock,
    LoadState,
    OpFailure,
    StoreBlock,
    StoreSnapshot,
)
from kdaserve.model.hybrid_cache import HybridCache

logger = logging.getLogger("kdaserve")


class Store(Protocol):
    name: str
    persistent: bool

    def put(self, kind: str, key: bytes, payload: memoryview, position: int = 0,
            chain: tuple[bytes, ...] = ()) -> None: ...

    def get(self, kind: str, key: bytes) -> memoryview: ...

    def drop(self, kind: str, key: bytes) -> None: ...


@dataclass
class TransferStats:
    """Bytes actually moved, per tier (the bookkeeping's counters are in offload.py)."""

    stored_entries: int = 0
    stored_bytes: int = 0
    loaded_entries: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0


class TierTransfer:
    def __init__(self, cache: HybridCache, stores: Mapping[str, Store]) -> None:
        self.cache = cache
        self.stores = dict(stores)
        self.stats = {name: TransferStats() for name in self.stores}
        self._failures_logged = 0
        # several ranks, each with its share of every entry: makes the failures the same on
        # every rank (kdaserve.distributed.comm.union_failures); None with one rank
        self.agree: Callable[[list[OpFailure]], list[OpFailure]] | None = None

    def run(self, ops: list[CacheOp]) -> list[OpFailure]:
        failures = self._run_all(ops)
        return self.agree(failures) if self.agree is not None else failures

    def _run_all(self, ops: list[CacheOp]) -> list[OpFailure]:
        failures: list[OpFailure] = []
        lost: set[str] = set()          # requests with a failed load: skip their other loads
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, LoadBlock):
                # a hit loads its blocks back to back: one scatter per MLA layer for all
                j = i
                while j < len(ops) and isinstance(ops[j], LoadBlock):
                    j += 1
                failures += self._load_blocks(ops[i:j], lost)
                i = j
                continue
            i += 1
            if isinstance(op, (LoadState, KeepState)) and op.request_id in lost:
                continue
            try:
                self._run(op)
            except Exception as exc:    # a tier problem is a miss, never a crash
                f = self._failure(op, exc)
                failures += f
                lost.update(x.request_id for x in f if x.request_id is not None)
        return failures

    def _load_blocks(self, ops: list[CacheOp], lost: set[str]) -> list[OpFailure]:
        start = time.perf_counter()
        pages = self.cache.mla_pages
        sizes = [p[0].numel() * p.element_size() for p in pages]
        failures: list[OpFailure] = []
        good: list[LoadBlock] = []
        rows: list[memoryview] = []
        for op in ops:
            assert isinstance(op, LoadBlock)
            if op.request_id in lost:
                continue
            try:
                payload = self.stores[op.tier].get(BLOCK, op.key)
                if len(payload) != sum(sizes):
                    raise ValueError(f"payload of {len(payload)} bytes, the layout needs "
                                     f"{sum(sizes)}")
            except Exception as exc:
                failures += self._failure(op, exc)
                lost.add(op.request_id)
                continue
            good.append(op)
            rows.append(payload)
        good_rows = [(op, r) for op, r in zip(good, rows) if op.request_id not in lost]
        if good_rows and sizes:
            buf = np.empty((len(good_rows), sum(sizes)), dtype=np.uint8)
            for k, (_, r) in enumerate(good_rows):
                buf[k] = np.frombuffer(r, dtype=np.uint8)
            src = torch.from_numpy(buf)
            ids = torch.tensor([op.block_id for op, _ in good_rows], device=pages[0].device)
            at = 0
            for p, n in zip(pages, sizes):
                layer = src[:, at:at + n].contiguous().view(p.dtype).view(-1, *p.shape[1:])
                p.index_copy_(0, ids, layer.to(p.device))
                at += n
        elapsed = time.perf_counter() - start
        for op, _ in good_rows:
            st = self.stats[op.tier]
            st.loaded_entries += 1
            st.loaded_bytes += sum(sizes)
            st.load_seconds += elapsed / len(good_rows)
        return failures

    def _run(self, op: CacheOp) -> None:
        if isinstance(op, StoreBlock):
            self._store(op.tiers, BLOCK, op.key, self.cache.block_views(op.block_id))
        elif isinstance(op, StoreSnapshot):
            self._store(op.tiers, SNAPSHOT, op.key, self.cache.snapshot_views(op.snapshot_id),
                        op.position, op.chain)
        elif isinstance(op, LoadState):
            self._load(op.tier, SNAPSHOT, op.key, self.cache.slot_views(op.slot))
        elif isinstance(op, KeepState):
            for dst, src in zip(self.cache.snapshot_views(op.snapshot_id),
                                self.cache.slot_views(op.slot)):
                dst.copy_(src)
        elif isinstance(op, DropEntry):
            self.stores[op.tier].drop(op.kind, op.key)

    def _store(self, tiers: tuple[str, ...], kind: str, key: bytes, views: list[torch.Tensor],
               position: int = 0, chain: tuple[bytes, ...] = ()) -> None:
        parts = [v.reshape(-1).view(torch.uint8) for v in views]
        payload = memoryview(torch.cat(parts).cpu().numpy()) if parts else memoryview(b"")
        errors = []
        for name in tiers:
            try:
                self.stores[name].put(kind, key, payload, position, chain)
            except Exception as exc:
                errors.append((name, exc))
                continue
            st = self.stats[name]
            st.stored_entries += 1
            st.stored_bytes += len(payload)
        if errors:
            raise _StoreErrors(errors)

    def _load(self, tier: str, kind: str, key: bytes, views: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        payload = self.stores[tier].get(kind, key)
        want = sum(v.numel() * v.element_size() for v in views)
        if len(payload) != want:
            raise ValueError(f"payload of {len(payload)} bytes, the layout needs {want}")
        src = torch.frombuffer(payload, dtype=torch.uint8) if want else None
        at = 0
        for v in views:
            n = v.numel() * v.element_size()
            v.view(-1).view(torch.uint8).copy_(src[at:at + n])
            at += n
        st = self.stats[tier]
        st.loaded_entries += 1
        st.loaded_bytes += want
        st.load_seconds += time.perf_counter() - start

    def _failure(self, op: CacheOp, exc: Exception) -> list[OpFailure]:
        if isinstance(exc, _StoreErrors):
            out = [OpFailure(name, _kind(op), op.key, None, f"store: {e}")
                   for name, e in exc.errors]
        elif isinstance(op, (LoadBlock, LoadState)):
            out = [OpFailure(op.tier, _kind(op), op.key, op.request_id, f"load: {exc}")]
        elif isinstance(op, KeepState):     # the request sits out; its snapshot is dropped
            out = [OpFailure("device", SNAPSHOT, b"", op.request_id, f"keep: {exc}")]
        elif isinstance(op, DropEntry):
            out = []                    # the entry is already out of the index
        else:
            out = [OpFailure(t, _kind(op), op.key, None, f"store: {exc}") for t in op.tiers]
        # every failure is counted in /metrics; the log says the first ones and then every
        # 1000th, so a full disk does not flood it
        self._failures_logged += 1
        if self._failures_logged <= 20 or self._failures_logged % 1000 == 0:
            logger.warning("offload: %s of %s %s failed (%s); treated as a miss",
                           type(op).__name__, _kind(op), getattr(op, "key", b"").hex()[:16], exc)
        return out


class _StoreErrors(Exception):
    def __init__(self, errors: list[tuple[str, Exception]]) -> None:
        super().__init__("; ".join(f"{n}: {e}" for n, e in errors))
        self.errors = errors


def _kind(op: CacheOp) -> str:
    if isinstance(op, DropEntry):
        return op.kind
    return BLOCK if isinstance(op, (StoreBlock, LoadBlock)) else SNAPSHOT


def offload_stats(offload: Offload | None,
                  moved_by_tier: Mapping[str, TransferStats]) -> dict[str, dict[str, float]]:
    """Per tier: what it holds, what moved (`moved_by_tier`: TierTransfer.stats), and how
    lookups went (for /metrics)."""
    if offload is None:
        return {}
    out = {}
    for t in offload.tiers:
        c, moved = offload.counters[t.name], moved_by_tier.get(t.name, TransferStats())
        out[t.name] = {"entries": t.num_entries, "bytes": t.bytes_held, "capacity": t.capacity,
                       "evictions": t.evictions, "queries": c.queries, "hits": c.hits,
                       "hit_rate": c.hits / c.queries if c.queries else 0.0,
                       "hit_tokens": c.hit_tokens, "load_failures": c.load_failures,
                       "store_failures": c.store_failures, "scan_dropped": c.scan_dropped,
                       **asdict(moved)}
    return out
