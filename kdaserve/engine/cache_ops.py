"""The one executor of a step's cache operations (kdaserve/cache/ops.py) in the runner.

It walks `SchedulerOutput.ops` in order. What needs nothing from the forward runs at once
(`begin`): frees, the offload tiers' stores, loads and drops (kdaserve/engine/tier_transfer.py)
and snapshot restores (batched into one copy per KDA layer). What the forward must do is
handed to it: the snapshots among a step's tokens (`StepOps.takes_for`, which the layout plans).
What depends on verification runs after sampling (`settle`): rolling verify rows back to
their last accepted token, and their snapshots, taken only where the position stood. One
`CacheOutcome` comes back: failed entries and snapshots never written.

A request whose tier load failed sits the step out (`StepOps.lost`): its later operations
are skipped and its snapshots reported dropped, and the scheduler recomputes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kdaserve.cache.ops import (
    DISAGG_OPS,
    TIER_OPS,
    CacheOp,
    CacheOutcome,
    FreeRequest,
    OpFailure,
    RestoreSnapshot,
    SettleDrafts,
    TakeSnapshot,
)
from kdaserve.engine.tier_transfer import Store, TierTransfer, TransferStats
from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.kept_states import KeptStates
from kdaserve.model.layout.snapshots import SnapshotAt
from kdaserve.outputs import ScheduledSequence


@dataclass
class StepOps:
    """A step's operations once those before the forward ran: what is left for the forward
    and for settling, and the outcome so far."""

    takes: list[TakeSnapshot] = field(default_factory=list)
    settles: dict[str, SettleDrafts] = field(default_factory=dict)     # by request
    lost: set[str] = field(default_factory=set)       # requests that sit the step out
    outcome: CacheOutcome = field(default_factory=CacheOutcome)

    def takes_for(self, rows: Mapping[str, int]) -> list[SnapshotAt]:
        """The snapshots the forward takes among these rows (request -> batch row): all but
        those of rows verifying drafts, which wait for verification."""
        return [SnapshotAt(rows[t.request_id], t.position, t.snapshot_id) for t in self.takes
                if t.request_id in rows and t.request_id not in self.settles]


class CacheOpExecutor:
    def __init__(self, cache: HybridCache, stores: Mapping[str, Store],
                 on_free: Callable[[str], None] = lambda rid: None) -> None:
        self.cache = cache
        self.tiers = TierTransfer(cache, stores)
        self.on_free = on_free
        # disaggregation's sends and receives (kdaserve/disagg/transfer.py); None: not a
        # prefill or decode instance
        self.transfer = None
        self.agree: Callable[[list[OpFailure]], list[OpFailure]] | None = None

    @property
    def stores(self) -> dict[str, Store]:
        return self.tiers.stores

    @property
    def stats(self) -> dict[str, TransferStats]:
        return self.tiers.stats

    def set_agreement(self, agree: Callable[[list[OpFailure]], list[OpFailure]]) -> None:
        """Several ranks, each holding its share of every entry (or sending its share of a
        request's cache): failures are made the same on every rank
        (kdaserve.distributed.comm.union_failures)."""
        self.tiers.agree = agree
        self.agree = agree

    def begin(self, ops: Sequence[CacheOp]) -> StepOps:
        """Run the operations that precede the forward, in order."""
        step = StepOps()
        tier_ops: list[CacheOp] = []
        restores: list[RestoreSnapshot] = []
        moves = []
        for op in ops:
            if isinstance(op, FreeRequest):
                self.on_free(op.request_id)
            elif isinstance(op, DISAGG_OPS):
                moves.append(op)
            elif isinstance(op, TIER_OPS):
                tier_ops.append(op)
            elif isinstance(op, RestoreSnapshot):
                restores.append(op)
            elif isinstance(op, TakeSnapshot):
                step.takes.append(op)
            elif isinstance(op, SettleDrafts):
                step.settles[op.request_id] = op
            else:
                raise TypeError(f"not a cache operation: {op!r}")
        # the scheduler lists frees and tier operations before any request's restore
        if tier_ops:
            step.outcome.failures = self.tiers.run(tier_ops)
        lost = {f.request_id for f in step.outcome.failures if f.request_id is not None}
        moved: list[OpFailure] = []
        for op in moves:      # after the tiers' loads: a hit's blocks are in place first
            if op.request_id in lost:
                continue      # it sits the step out and is recomputed; the transfer expires
            if self.transfer is None:
                raise ValueError(f"{type(op).__name__} on an instance without a kv-transfer "
                                 "connector (serve --role prefill|decode)")
            moved += self.transfer.run(op)
        if moves and self.agree is not None:     # a send one rank failed fails on all
            moved = self.agree(moved)
        step.outcome.failures += moved
        step.lost = {f.request_id for f in step.outcome.failures if f.request_id is not None}
        restores = [r for r in restores if r.request_id not in step.lost]
        if restores:
            dev = self.cache.kda_states[0].device if self.cache.kda_states else "cpu"
            self.cache.restore(torch.tensor([r.slot for r in restores], device=dev),
                               torch.tensor([r.snapshot_id for r in restores], device=dev))
        step.outcome.dropped_snapshots = [t.snapshot_id for t in step.takes
                                          if t.request_id in step.lost]
        return step

    def run(self, ops: Sequence[CacheOp]) -> CacheOutcome:
        """Operations outside a step (flushing the device cache to the tiers)."""
        step = self.begin(ops)
        if step.takes or step.settles:
            raise ValueError("snapshots and drafts are settled within a step")
        return step.outcome

    def settle(self, step: StepOps, seqs: Sequence[ScheduledSequence], valid: Sequence[int],
               kept: KeptStates | None) -> None:
        """After verification: each verify row's slot gets the state after its last accepted
        token (`valid[b]` of row b's tokens stand), and its snapshots are taken where their
        position stood, dropped where it did not."""
        rolled, taken = [], []
        for b, s in enumerate(seqs):
            if s.request_id not in step.settles:
                if s.num_draft_tokens:
                    raise ValueError(f"request {s.request_id!r} verifies drafts without a "
                                     "SettleDrafts operation: its slot would keep rejected "
                                     "drafts' states")
                continue
            if valid[b] < len(s.token_ids):
                rolled.append((b, valid[b] - 1, step.settles[s.request_id].slot))
            for t in step.takes:
                if t.request_id != s.request_id:
                    continue
                upto = t.position - s.context_len
                if upto <= valid[b]:
                    taken.append((b, upto - 1, t.snapshot_id))
                else:
                    step.outcome.dropped_snapshots.append(t.snapshot_id)
        c = self.cache
        for todo, states, convs in ((rolled, c.kda_states, c.kda_conv),
                                    (taken, c.snap_states, c.snap_conv)):
            if not todo or not c.kda_states:
                continue
            assert kept is not None, "a verifying forward keeps its states"
            dev = c.kda_states[0].device
            b, upto, dest = (torch.tensor(x, device=dev) for x in zip(*todo))
            kept.copy_to(b, upto, states, convs, dest)
