"""Cache operations: every tensor movement the cache bookkeeping decides, as plain records.

The scheduler and the cache manager (`CacheManager.take_ops`) put them in `SchedulerOutput.ops`
in the order they must run; one executor in the runner (`kdaserve/engine/cache_ops.py`) carries
them out against the device cache and the offload tiers' stores, and one `CacheOutcome` comes
back in `ModelRunnerOutput.cache`: the entries that failed (the manager forgets them) and the
snapshots that were planned but never written (the manager drops them).

When each kind runs, in the list's order within its phase:
- before the forward: `FreeRequest`, `PushBlocks` / `SendRequest` / `ReceiveRequest`
  (disaggregation), the offload ops (`StoreBlock`, `StoreSnapshot`,
  `LoadBlock`, `LoadState`, `KeepState`, `DropEntry`) and `RestoreSnapshot`;
- during the forward: `TakeSnapshot` (a state inside the step's tokens; the layout plans it);
- after verification: `SettleDrafts`, and the `TakeSnapshot`s of a request that verifies
  drafts (taken only if their position was accepted).

Why an explicit list: the bookkeeping reuses a device block or snapshot id the moment it hands
it out, so whatever must survive (its content, copied to a tier) has to be copied before the
forward overwrites it, and a tier entry has to be in the device pool before the forward reads
it. Running the list in order gives exactly that. Disaggregation ships the same operations
to another instance.

Keys are 16-byte chained block hashes. A block's key is its own hash; a snapshot's key is the
hash of the last block of the prefix it summarises. `kind` tells the two apart inside a tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    counterpart of `RestoreSnapshot`; no device snapshot id is spent)."""

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


@dataclass(frozen=True)
class RestoreSnapshot:
    """Copy device snapshot `snapshot_id` into `slot`, the live KDA slot of `request_id`: a
    prefix hit continues from the state the snapshot holds."""

    request_id: str
    snapshot_id: int
    slot: int


@dataclass(frozen=True)
class TakeSnapshot:
    """Save the KDA state of `request_id` with its first `position` tokens in (a block
    boundary among this step's tokens) as device snapshot `snapshot_id`. Never written (the
    request sat the step out, or the position held a rejected draft): reported dropped."""

    request_id: str
    position: int
    snapshot_id: int


@dataclass(frozen=True)
class SettleDrafts:
    """After verification, `slot` (the live slot of `request_id`) holds the state after the
    request's last accepted token: rolled back from the states the forward kept after each
    position when a draft was rejected, left as is when all stood."""

    request_id: str
    slot: int


@dataclass(frozen=True)
class SendRequest:
    """Push the cache of finished request `request_id` to another instance (disaggregation,
    kdaserve/disagg): the latents of its first `num_tokens` tokens in `block_ids` (every MLA
    layer) and its live KDA slot `slot` (state + conv window, every KDA layer), under
    `transfer_id`, to `peer`. The bookkeeping freed both already; the op runs before any
    forward can reuse them. `token_hash` (xxh3-64 of the tokens) and `first_token_id` let the
    receiver check it continues the same request. With a DSpark draft, its pages of the
    same tokens go along, and `draft_token_ids`, the drafts proposed after the first token.
    `held_tokens`: the receiver holds the first tokens already (its answer to the hit query,
    kdaserve/disagg/handoff.py): the transfer's per-token buffers start after them."""

    request_id: str
    transfer_id: str
    peer: str
    block_ids: tuple[int, ...]
    slot: int
    num_tokens: int
    token_hash: int
    first_token_id: int
    token_start: int = 0          # push mode: tokens before it went in `parts` PushBlocks
    parts: int = 0
    draft_token_ids: tuple[int, ...] = ()
    held_tokens: int = 0


@dataclass(frozen=True)
class PushBlocks:
    """Push mode: send the latents of tokens [token_start, token_end) of `request_id`, still
    computing its prompt, from `block_ids` (whole blocks, written by earlier steps) as part
    `part` of transfer `transfer_id` to `peer`, without waiting: the network moves them while
    the next chunk computes. The request's SendRequest sends the rest and the KDA states, and
    waits for every part's acknowledgement. `block_ids` start with the block that holds
    `token_start` (which need not be a block boundary: the transfer starts after the tokens
    the receiver holds, in its own block size); `held_tokens` as in SendRequest."""

    request_id: str
    transfer_id: str
    peer: str
    block_ids: tuple[int, ...]
    token_start: int
    token_end: int
    part: int
    held_tokens: int = 0


@dataclass(frozen=True)
class ReceiveRequest:
    """Fill `block_ids` (the first `num_tokens` tokens, in this instance's own block size) and
    live slot `slot` of `request_id` with transfer `transfer_id` from the connector's inbox.
    The first `skip_tokens` (whole blocks) are a prefix hit this instance already holds: those
    blocks are shared and left as they are; the transfer may leave out at most those (a
    transfer that starts later is refused: the tokens between were never written here). A
    transfer that is missing, late, or fails a check (model, layout, checksum, tokens) fails
    the op: the request ends with that error."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    slot: int
    num_tokens: int
    token_hash: int
    first_token_id: int
    skip_tokens: int = 0


@dataclass(frozen=True)
class FreeRequest:
    """`request_id` is gone (finished, aborted): the runner forgets what it holds for it
    (its copy of the request, sampling generator, draft probabilities, grammar state). Its
    blocks and slot are already free in the bookkeeping; nothing is copied."""

    request_id: str


CacheOp = Union[StoreBlock, StoreSnapshot, LoadBlock, LoadState, KeepState, DropEntry,
                RestoreSnapshot, TakeSnapshot, SettleDrafts, PushBlocks, SendRequest,
                ReceiveRequest, FreeRequest]
# the offload tiers' operations (kdaserve/engine/tier_transfer.py carries them out)
TIER_OPS = (StoreBlock, StoreSnapshot, LoadBlock, LoadState, KeepState, DropEntry)
# disaggregation's (kdaserve/disagg/transfer.py carries them out); their failures name the
# tier DISAGG
DISAGG_OPS = (PushBlocks, SendRequest, ReceiveRequest)
DISAGG = "disagg"


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


@dataclass
class CacheOutcome:
    """What came of a step's cache operations, back to the scheduler."""

    failures: list[OpFailure] = field(default_factory=list)
    # planned snapshots never written: their position held a rejected draft, or their
    # request sat the step out
    dropped_snapshots: list[int] = field(default_factory=list)

    def extend(self, other: CacheOutcome) -> None:
        self.failures.extend(other.failures)
        self.dropped_snapshots.extend(other.dropped_snapshots)


def request_of(op: CacheOp) -> str | None:
    """The request an operation belongs to (None: a tier's own, e.g. a store on eviction)."""
    return getattr(op, "request_id", None)


def ops_for(ops: list[CacheOp], request_ids: set[str]) -> list[CacheOp]:
    """The operations of a part of the step (a data-parallel rank's requests): those of its
    requests, every `FreeRequest` (each runner forgets the request) and the tiers' own."""
    return [op for op in ops if isinstance(op, FreeRequest) or request_of(op) is None
            or request_of(op) in request_ids]
