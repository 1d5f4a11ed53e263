"""A tensor-parallel decode instance (TP=N): rank 0 receives every transfer and hands each
rank its share when the request's cache is installed.

Only rank 0 listens on the kv-transfer port, with the whole model's layout, so a sender of
any TP size is checked and joined there as for a one-rank decode instance (tp_layout.join).
The `ReceiveRequest` operation travels in the step that every rank runs (the executor
publishes it), so every rank's executor of cache operations reaches it at the same point:
there rank 0 takes the transfer from its inbox, splits it (tp_layout.split, replicated: each
rank its KDA heads' states and conv windows, every rank the latents, which are per token) and
sends each rank its message over the control group; each rank then installs its share through
the same `CacheTransfer.receive` as a one-rank instance. A transfer that failed on rank 0
(missing, refused) fails with the same message on every rank, so no rank waits for bytes that
never come and the ranks agree on the failure (union_failures).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from kdaserve.disagg import tp_layout, wire
from kdaserve.disagg.connector import Arrived, Connector, TransferFailed
from kdaserve.disagg.wire import TransferRefused
from kdaserve.distributed.comm import recv_frames, send_frames


class RankReceiver:
    """`take` for one rank of a TP=N decode instance (the connector's own on one rank)."""

    def __init__(self, connector: Connector, tp_size: int, tp_rank: int, group: Any) -> None:
        """`connector`: rank 0's receives (the other ranks' is never asked); `group`: the
        control group of the instance's ranks (their global ranks are 0..tp_size-1)."""
        self.connector = connector
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.group = group

    def take(self, transfer_id: str, timeout_s: float) -> Arrived:
        shares: list[tp_layout.Message] = []
        box: list = [None, None]                  # [(failure kind, message), rank headers]
        if self.tp_rank == 0:
            try:
                got = self.connector.take(transfer_id, timeout_s)
                shares = tp_layout.split(got.header, got.frames, self.tp_size, replicate=True)
                box[1] = [wire.encode(h) for h, _ in shares]
            except TransferFailed as exc:
                box[0] = ("failed", str(exc))
            except Exception as exc:      # noqa: BLE001 (refused, or not splittable: all fail)
                box[0] = ("refused", str(exc))
        dist.broadcast_object_list(box, src=0, group=self.group)
        failure, headers = box
        if failure is not None:
            raise (TransferFailed if failure[0] == "failed" else TransferRefused)(failure[1])
        header = wire.decode_header(headers[self.tp_rank])
        if self.tp_rank == 0:
            for r in range(1, self.tp_size):
                send_frames(shares[r][1], r, self.group)
            return Arrived(header, list(shares[0][1]))
        frames = recv_frames([b.nbytes for b in header.buffers], 0, self.group)
        wire.check_buffers(header, frames)        # split recomputed every checksum
        return Arrived(header, frames)
