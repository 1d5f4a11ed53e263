"""One offload tier's index: which entries it holds, its byte budget, its eviction order.

Plain Python over keys and sizes (the bytes themselves live in the tier's store, which the
runner drives). Eviction follows the device pool's policy, in one byte budget:
  1. blocks that lead to no snapshot anywhere (device or tier) can never produce a hit: they go
     first, least recently used first;
  2. then the snapshot with the least prefill saved per byte held,
     position * (1 + hits) / (snapshot bytes + position * MLA bytes per token), LRU on ties;
     its chain's blocks then become orphans and follow at the next eviction (rule 1);
  3. only a tier holding no snapshot evicts a still-useful block (LRU), e.g. a host tier that
     holds blocks whose snapshots sit in the disk tier.
Entries being loaded this step are protected.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kdaserve.cache.ops import BLOCK, SNAPSHOT

# Orphans are moved to the front when they become orphans; a few more are looked at in case
# one became an orphan through a path that does not demote (cheap insurance, not a scan).
_ORPHAN_LOOKAHEAD = 8


@dataclass(eq=False)
class TierEntry:
    kind: str
    key: bytes
    nbytes: int                        # what it costs in this tier's budget
    position: int = 0                  # snapshots: tokens of the prefix the state summarises
    chain: tuple[bytes, ...] = ()      # snapshots: the block hashes of that prefix
    hits: int = 0
    last_use: int = 0


class Tier:
    def __init__(self, name: str, capacity_bytes: int, snapshot_bytes: int,
                 mla_bytes_per_token: int, granule: int = 1) -> None:
        self.name = name
        self.capacity = capacity_bytes
        self.snapshot_bytes = snapshot_bytes
        self.mla_bytes_per_token = mla_bytes_per_token
        self.granule = granule         # allocation unit (a file system block for the disk tier)
        self.blocks: OrderedDict[bytes, TierEntry] = OrderedDict()   # front = evicted first
        self.snapshots: dict[bytes, TierEntry] = {}
        self.bytes_held = 0
        self.evictions = 0

    @property
    def num_entries(self) -> int:
        return len(self.blocks) + len(self.snapshots)

    def cost(self, payload_bytes: int, header_bytes: int = 0) -> int:
        n = payload_bytes + header_bytes
        return -(-n // self.granule) * self.granule

    def get(self, kind: str, key: bytes) -> TierEntry | None:
        return (self.blocks if kind == BLOCK else self.snapshots).get(key)

    def touch(self, entry: TierEntry, step: int) -> None:
        entry.last_use = step
        if entry.kind == BLOCK and entry.key in self.blocks:
            self.blocks.move_to_end(entry.key)

    def demote(self, key: bytes) -> None:
        """A block that no longer leads to any snapshot: first to go."""
        if key in self.blocks:
            self.blocks.move_to_end(key, last=False)

    def value(self, snap: TierEntry) -> float:
        held = self.snapshot_bytes + snap.position * self.mla_bytes_per_token
        return snap.position * (1 + snap.hits) / max(1, held)

    def admit(self, entry: TierEntry, leads: Callable[[bytes], bool],
              protect: set[tuple[str, bytes]]) -> list[TierEntry] | None:
        """Add `entry`, evicting what the policy says until it fits. Returns the evicted
        entries, or None (and changes nothing) when it cannot fit."""
        if entry.nbytes > self.capacity:
            return None
        victims: list[TierEntry] = []
        held = self.bytes_held
        while held + entry.nbytes > self.capacity:
            victim = self._victim(leads, protect, victims)
            if victim is None:
                return None
            victims.append(victim)
            held -= victim.nbytes
        for v in victims:
            self.remove(v.kind, v.key)
            self.evictions += 1
        self.add(entry)
        return victims

    def add(self, entry: TierEntry) -> None:
        if entry.kind == BLOCK:
            self.blocks[entry.key] = entry
        else:
            self.snapshots[entry.key] = entry
        self.bytes_held += entry.nbytes

    def remove(self, kind: str, key: bytes) -> TierEntry | None:
        entry = (self.blocks if kind == BLOCK else self.snapshots).pop(key, None)
        if entry is not None:
            self.bytes_held -= entry.nbytes
        return entry

    def _victim(self, leads: Callable[[bytes], bool], protect: set[tuple[str, bytes]],
                taken: list[TierEntry]) -> TierEntry | None:
        gone = {id(e) for e in taken}
        first_block = None
        for i, e in enumerate(self.blocks.values()):
            if id(e) in gone or (BLOCK, e.key) in protect:
                continue
            if first_block is None:
                first_block = e
            if not leads(e.key):
                return e
            if i >= _ORPHAN_LOOKAHEAD + len(taken):
                break
        snaps = [s for s in self.snapshots.values()
                 if id(s) not in gone and (SNAPSHOT, s.key) not in protect]
        if snaps:
            return min(snaps, key=lambda s: (self.value(s), s.last_use))
        return first_block
