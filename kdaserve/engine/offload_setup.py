"""Opening the offload tiers at startup: the bookkeeping (to the cache manager, in the engine
process) and the stores that hold the bytes (to the runner of each rank).

With one rank both live in the engine process. With several (tensor or expert parallel),
each rank keeps its own share of every entry (its heads' KDA states, its replica of the MLA
latents) in its own stores: the host tier in its process, the disk tier under a directory of
its own (the rank is part of the cache layout, hence of the identity that names the
directory). The engine keeps one logical index. At startup it scans every rank's disk
directory and keeps only what all of them hold: an entry one rank lost (a crash between two
ranks' writes) would be a hit the other ranks could not serve.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kdaserve.cache.identity import cache_layout, offload_identity
from kdaserve.cache.offload import CHAIN_BYTES, HEADER_BYTES, Offload
from kdaserve.cache.ops import BLOCK, SNAPSHOT
from kdaserve.cache.spec import specs_for
from kdaserve.cache.stores import DiskStore, HostStore, OffloadError
from kdaserve.cache.tiers import Tier, TierEntry
from kdaserve.config import EngineConfig
from kdaserve.engine.tier_transfer import Store

logger = logging.getLogger("kdaserve")


@dataclass
class OffloadSetup:
    offload: Offload                   # the bookkeeping (to the cache manager)
    stores: dict[str, Store]           # the bytes (to the in-process runner; {} with workers)


def rank_identity(config: EngineConfig, rank_cfg: Any, chunk: int, device_type: str,
                  rank: int = 0, world: int = 1) -> tuple[bytes, dict] | None:
    """The identity of one rank's disk entries (None without a disk tier). One rank keeps the
    single-process identity, so a restart with the same layout finds its entries."""
    cc = config.cache
    if "disk" not in cc.offload_tiers:
        return None
    if not config.model:
        raise ValueError("the disk offload tier needs a model directory")
    layout = cache_layout(rank_cfg, cc.block_size, config.dtype, chunk, device_type)
    if world > 1:
        par = config.parallel
        layout = {**layout, "rank": rank, "ranks": world, "tp": par.tensor_parallel_size,
                  "ep": par.expert_parallel_size}
    return offload_identity(config.model, layout)


def open_stores(config: EngineConfig, identity: tuple[bytes, dict] | None, block_bytes: int,
                snapshot_bytes: int, device: torch.device) -> dict[str, Store]:
    """One rank's stores, fastest first. Raises OffloadError when a tier cannot work."""
    stores: dict[str, Store] = {}
    for name in config.cache.offload_tiers:
        if name == "host":
            stores[name] = HostStore(alloc=_pinned_alloc if device.type == "cuda" else None)
        elif name == "disk":
            if config.cache.offload_dir is None or identity is None:
                raise OffloadError("the disk tier needs a directory and a model identity")
            one_entry = max(block_bytes, snapshot_bytes) + (1 << 20)
            stores[name] = DiskStore(config.cache.offload_dir, identity[0], identity[1],
                                     one_entry, payload_bytes={BLOCK: block_bytes,
                                                               SNAPSHOT: snapshot_bytes})
        else:
            raise OffloadError(f"unknown offload tier {name!r}")
    return stores


def open_offload(config: EngineConfig, rank_stores: list[dict[str, Store]], block_bytes: int,
                 snapshot_bytes: int, mla_bytes_per_token: int) -> Offload:
    """The bookkeeping, seeded with what every rank's persistent stores kept from an earlier
    run (entries beyond a tier's cap, or missing on some rank, are deleted)."""
    index: list[Tier] = []
    for name, cap in zip(config.cache.offload_tiers, config.cache.offload_capacities()):
        index.append(Tier(name, cap, snapshot_bytes, mla_bytes_per_token,
                          granule=4096 if name == "disk" else 1))
    off = Offload(index, block_bytes, snapshot_bytes)
    for tier in index:
        stores: list[Any] = [s[tier.name] for s in rank_stores]
        if not stores[0].persistent:
            continue
        scans = [store.scan() for store in stores]
        off.counters[tier.name].scan_dropped += sum(getattr(s, "dropped", 0) for s in stores)
        everywhere = set.intersection(*({(e.kind, e.key) for e in scan} for scan in scans))
        for store, scan in zip(stores[1:], scans[1:]):
            for e in scan:
                if (e.kind, e.key) not in everywhere:
                    store.drop(e.kind, e.key)
        # snapshots first, so blocks know what they lead to when the cap trims them; each
        # kind oldest first (the scan's order)
        found = sorted((e for e in scans[0] if (e.kind, e.key) in everywhere),
                       key=lambda e: e.kind != SNAPSHOT)
        for e in scans[0]:
            if (e.kind, e.key) not in everywhere:
                stores[0].drop(e.kind, e.key)
        kept = [TierEntry(e.kind, e.key, tier.cost(
            block_bytes if e.kind == BLOCK else snapshot_bytes,
            HEADER_BYTES + CHAIN_BYTES * len(e.chain)), e.position, e.chain) for e in found]
        for e in off.seed(tier, kept):
            for store in stores:
                store.drop(e.kind, e.key)
        if kept:
            logger.info("offload: the %s tier kept %d entries (%.1f MiB) from an earlier run",
                        tier.name, tier.num_entries, tier.bytes_held / 2**20)
        free = stores[0].free_bytes()
        if free + tier.bytes_held < tier.capacity:
            logger.warning("offload: %s has %.1f GiB free, less than the %.1f GiB cap; writes "
                           "past that will fail and count as misses", stores[0].root,
                           free / 2**30, tier.capacity / 2**30)
    return off


def open_tiers(config: EngineConfig, rank_cfg: Any, chunk: int,
               device: torch.device) -> OffloadSetup | None:
    """In the engine process: the bookkeeping, and the stores when the runner is here too.
    With worker ranks, each opens its own stores (`worker_stores`); the engine opens their
    disk directories only to read what they kept."""
    cc = config.cache
    if not cc.offload_tiers:
        return None
    latent, state = specs_for(rank_cfg, cc.block_size, config.dtype, cc.kv_cache_dtype)
    world = config.parallel.world_size
    rank_stores = [
        open_stores(config, rank_identity(config, rank_cfg, chunk, device.type, r, world),
                    latent.bytes_per_block, state.bytes_per_slot, device)
        for r in range(world)]
    off = open_offload(config, rank_stores, latent.bytes_per_block, state.bytes_per_slot,
                       latent.bytes_per_token)
    logger.info("kdaserve offload: %s%s", ", ".join(
        f"{t.name} {t.capacity / 2**30:.2f} GiB" for t in off.tiers),
        f" (each of {world} ranks holds its share)" if world > 1 else "")
    return OffloadSetup(off, rank_stores[0] if world == 1 else {})


def worker_stores(config: EngineConfig, rank_cfg: Any, chunk: int, device: torch.device,
                  rank: int, world: int) -> dict[str, Store]:
    """In a worker rank: its own stores (the engine process holds the bookkeeping)."""
    cc = config.cache
    if not cc.offload_tiers:
        return {}
    latent, state = specs_for(rank_cfg, cc.block_size, config.dtype, cc.kv_cache_dtype)
    return open_stores(config, rank_identity(config, rank_cfg, chunk, device.type, rank, world),
                       latent.bytes_per_block, state.bytes_per_slot, device)


def _pinned_alloc(n: int) -> memoryview:
    # the memoryview keeps the numpy array alive, which keeps the pinned tensor alive
    return memoryview(torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy())
