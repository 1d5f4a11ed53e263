"""Cache operations: the tensor movements the cache bookkeeping decides, as plain records.

The cache manager emits them (`CacheManager.take_ops`) into `SchedulerOutput.cache_ops`, in the
order they must run; the runner (`kdaserve/engine/cache_ops.py`) carries them out before the
step's forward, against the device cache and the offload tiers' stores, and reports the ones
that failed (`ModelRunnerOutput.cache_op_failures`), which the manager then forgets.

Why an explicit list: the bookkeeping reuses a device block or snapshot id the moment it hands
it out, so whatever must survive (its content, copied to a tier) has to be copied before the
forward overwrites it, and a tier entry has to be in the device pool before the forward reads
it. Running the list in order before the forward gives exactly that.

Keys are 16-byte chained block hashes. A block's key is its own hash; a snapshot's key is the
hash of the last block of the prefix it summarises. `kind` tells the two apart inside a tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BLOCK = "block"
SNAPSHOT = "snapshot"
KINDS = (BLOCK, SNAPSHOT)


@dataclass(frozen=True)
class StoreBlock:
    """Copy device MLA block `block_id` (every MLA layer) into `tiers` under `key`."""

    block_id: int
    key: bytes
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class StoreSnapshot:
    """Copy device KDA snapshot `snapshot_id` (state + conv window, every KDA layer) into
    `tiers`. `position` and `chain` (the block hashes of its prefix) travel with the entry so a
    restarted engine can rebuild its index from the disk tier alone."""

    snapshot_id: int
    key: bytes
    position: int
    chain: tuple[bytes, ...]
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class LoadBlock:
    """Copy tier entry `key` into device block `block_id` (a prefix hit of `request_id`)."""

    tier: str
    key: bytes
    block_id: int
    request_id: str


@dataclass(frozen=True)
class LoadState:
    """Copy tier snapshot `key` straight into the live KDA slot of `request_id` (the tier's
    counterpart of `ScheduledSequence.restore_snapshot`; no device snapshot id is spent)."""

    tier: str
    key: bytes
    slot: int
    request_id: str


@dataclass(frozen=True)
class KeepState:
    """Copy the live slot of `request_id`, just filled by a `LoadState`, into device snapshot
    `snapshot_id`: the snapshot is back on the device, and the next hit restores it there."""

    slot: int
    snapshot_id: int
    request_id: str


@dataclass(frozen=True)
class DropEntry:
    """Forget a tier entry (evicted by the tier's policy): free its memory or delete its file."""

    tier: str
    kind: str
    key: bytes


CacheOp = Union[StoreBlock, StoreSnapshot, LoadBlock, LoadState, KeepState, DropEntry]


@dataclass(frozen=True)
class OpFailure:
    """One entry that could not be stored or loaded. A failed load names its request: the
    runner leaves that request out of the step and the scheduler recomputes it (never a step
    on data that did not verify)."""

    tier: str
    kind: str
    key: bytes
    request_id: str | None
    reason: str
