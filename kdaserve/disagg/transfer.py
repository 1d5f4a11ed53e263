"""The torch side of a transfer: carries out SendRequest and ReceiveRequest (cache/ops.py)
against the device cache, through a connector. Under tensor parallelism every rank runs
the same operations on its own cache: a prefill rank sends its own message (tp_layout.py), a
decode rank is handed its share by rank 0 (rank_receive.py).

Sending gathers each MLA layer's latents of the request's tokens from its blocks into one
[num_tokens, D] tensor (so the receiver may use another block size; all but the first
`held_tokens`, which the receiver said it holds) and takes
the request's live KDA slot through `HybridCache.slot_views`, the same views the offload tiers
store a state through. Receiving checks the transfer continues this request (token hash, first
token) and scatters the latents into the receiver's own blocks, the states into its slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import msgspec
import torch

from kdaserve.cache.ops import DISAGG, OpFailure, PushBlocks, ReceiveRequest, SendRequest
from kdaserve.disagg import wire
from kdaserve.disagg.connector import FAILED_PREFIX, Arrived, Connector, TransferFailed
from kdaserve.disagg.wire import BufferSpec, CacheLayout, TransferHeader, TransferRefused
from kdaserve.model.hybrid_cache import HybridCache

if TYPE_CHECKING:
    from kdaserve.engine.spec.dspark import DSparkProposer


@dataclass
class TransferTimes:
    """Seconds on the engine thread: pushes (a part's host copy, handed to the connector while
    the next chunk computes) and sends (the last part: the tail and the states, until every
    part was acknowledged: the transfer time after the prompt's last chunk)."""

    push_seconds: float = 0.0
    send_seconds: float = 0.0
    receive_seconds: float = 0.0


class CacheTransfer:
    def __init__(self, cache: HybridCache, connector: Connector, identity: str,
                 layout: CacheLayout, receive_timeout_s: float = 10.0,
                 draft: DSparkProposer | None = None, draft_identity: str = "",
                 take: Callable[[str, float], Arrived] | None = None) -> None:
        """`take`: where a receive gets its transfer (a TP=N decode rank: from rank 0,
        rank_receive.py); by default the connector's inbox."""
        self.cache = cache
        self.connector = connector
        self.identity = identity
        self.layout = layout
        self.receive_timeout_s = receive_timeout_s
        # the DSpark drafter, whose context pages travel with the request's cache
        self.draft = draft
        self.draft_identity = draft_identity
        self.times = TransferTimes()
        self.take = take or connector.take

    @property
    def address(self) -> str | None:
        """Where prefill instances send to (a decode instance's; None on a prefill one)."""
        return self.connector.address

    def _same_draft(self, h: TransferHeader) -> bool:
        """The sender speculates with this instance's draft: its pages and drafts fit here."""
        return (self.draft is not None and h.draft_identity == self.draft_identity
                and (h.layout.draft_layers, h.layout.draft_latent_dim)
                == (self.layout.draft_layers, self.layout.draft_latent_dim))

    def arrived_drafts(self, transfer_id: str) -> list[int]:
        """The drafts an arrived transfer's sender proposed after the first token (for the
        request's first step here); none when it has not arrived or the drafts differ."""
        h = self.connector.inbox.peek(transfer_id)
        return list(h.draft_token_ids) if h is not None and self._same_draft(h) else []

    def metrics(self) -> dict[str, float]:
        """The connector's counters, for /metrics."""
        return {k: float(v) for k, v in asdict(self.connector.stats).items()}

    def run(self, op: PushBlocks | SendRequest | ReceiveRequest) -> list[OpFailure]:
        """Carry out one op; a failure is reported (the request ends with it), never raised."""
        try:
            if isinstance(op, PushBlocks):
                self.push(op)
            elif isinstance(op, SendRequest):
                self.send(op)
            else:
                self.receive(op)
        except (TransferFailed, TransferRefused) as exc:
            return [OpFailure(DISAGG, "request", op.transfer_id.encode(), op.request_id,
                              FAILED_PREFIX + str(exc))]
        return []

    # ---- prefill side -----------------------------------------------------------------------
    def push(self, op: PushBlocks) -> None:
        """A part of the prompt's latents, sent without waiting for its acknowledgement."""
        if self.layout.tp_rank:       # the latents are rank 0's to send (replicated)
            return
        start = time.perf_counter()
        tensors = self._latents(op.block_ids, op.token_start % self.cache.block_size,
                                op.token_end - op.token_start)
        names = wire.expected_names(self.layout)[: len(tensors)]
        header, frames = self._message(op.transfer_id, op.token_end, 0, -1, names, tensors,
                                       op.part, op.token_start, final=False,
                                       held=op.held_tokens)
        self.connector.push(op.peer, header, frames)
        self.times.push_seconds += time.perf_counter() - start

    def send(self, op: SendRequest) -> None:
        """The latents not pushed yet and the KDA states; returns once every part of the
        transfer was acknowledged."""
        start = time.perf_counter()
        bs = self.cache.block_size
        first = op.token_start // bs
        # a tensor-parallel rank but 0 sends its KDA heads alone, in one part
        part, token_start, tensors = 0, 0, []
        if self.layout.tp_rank == 0:
            part, token_start = op.parts, op.token_start
            tensors = self._latents(op.block_ids[first:], op.token_start % bs,
                                    op.num_tokens - op.token_start)
        tensors += [v.contiguous().cpu() for v in self.cache.slot_views(op.slot)]
        if self.draft is not None and self.layout.tp_rank == 0:
            tensors += self.draft.export_context(op.block_ids, op.num_tokens, op.held_tokens)
        names = wire.expected_names(self.layout)
        assert len(names) == len(tensors)
        header, frames = self._message(op.transfer_id, op.num_tokens, op.token_hash,
                                       op.first_token_id, names, tensors, part, token_start,
                                       final=True, held=op.held_tokens)
        header = msgspec.structs.replace(header, draft_identity=self.draft_identity,
                                         draft_token_ids=list(op.draft_token_ids))
        self.connector.send(op.peer, header, frames)
        self.times.send_seconds += time.perf_counter() - start

    def _message(self, tid: str, num_tokens: int, token_hash: int, first: int,
                 names: list[str], tensors: list[torch.Tensor], part: int, token_start: int,
                 final: bool, held: int) -> tuple[TransferHeader, list[memoryview]]:
        frames = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors]
        specs = [BufferSpec(n, str(t.dtype).removeprefix("torch."), list(t.shape), len(f),
                            wire.checksum(f)) for n, t, f in zip(names, tensors, frames)]
        return TransferHeader(wire.VERSION, tid, self.identity, self.layout, num_tokens,
                              token_hash, first, specs, part, token_start, final,
                              held_tokens=held), frames

    def _latents(self, block_ids: tuple[int, ...], offset: int, num_tokens: int
                 ) -> list[torch.Tensor]:
        """Host copies of `num_tokens` latents in `block_ids` from row `offset` of the first
        (the transfer may start inside a block: after the tokens the receiver holds, in its
        block size), one per MLA layer."""
        bs = self.cache.block_size
        ids = torch.tensor(block_ids[: -(-(offset + num_tokens) // bs)], dtype=torch.long)
        out = []
        for p in self.cache.mla_pages:     # [blocks, bs, D] -> [num_tokens, D]
            rows = p.index_select(0, ids.to(p.device)).reshape(-1, p.shape[-1])
            out.append(rows[offset:offset + num_tokens].contiguous().cpu())
        return out

    # ---- decode side ------------------------------------------------------------------------
    def receive(self, op: ReceiveRequest) -> None:
        began = time.perf_counter()
        got = self.take(op.transfer_id, self.receive_timeout_s)
        h = got.header
        if h.num_tokens != op.num_tokens or h.token_hash != op.token_hash:
            raise TransferRefused(f"transfer {op.transfer_id} holds another prompt ({h.num_tokens} "
                                  f"tokens; this request has {op.num_tokens}, or its tokens "
                                  "differ): both sides must tokenize the request the same way")
        if h.first_token_id != op.first_token_id:
            raise TransferRefused(f"transfer {op.transfer_id} was sent with first token "
                                  f"{h.first_token_id}, the request says {op.first_token_id}")
        names = wire.cache_names(self.layout.whole())   # every rank installs the latents
        listed = [b.name for b in h.buffers]
        if listed[:len(names)] != names or listed[len(names):] not in (
                [], wire.draft_names(h.layout.whole())):
            raise TransferRefused(f"transfer {op.transfer_id} lists buffers {listed}, this "
                                  f"layout needs {names} (and the sender's draft pages, if "
                                  "any)")
        c = self.cache
        nm = len(c.mla_pages)
        bs = c.block_size
        n = op.num_tokens
        nblocks = -(-n // bs)
        first = op.skip_tokens // bs      # blocks of a prefix hit here: shared, left alone
        start = first * bs
        sent = h.held_tokens              # the transfer's per-token buffers start there
        if sent > start:
            raise TransferRefused(f"transfer {op.transfer_id} leaves out the first {sent} "
                                  f"tokens, but this instance holds only {start} of them (the "
                                  "prefix held for it was released): send it whole")
        ids = torch.tensor(op.block_ids[first:nblocks], dtype=torch.long)
        for i, p in enumerate(c.mla_pages):
            src = _tensor(got.frames[i], h.buffers[i], p.dtype, (n - sent, p.shape[-1]))
            if first == nblocks:
                continue
            pad = torch.zeros((nblocks - first) * bs, p.shape[-1], dtype=p.dtype)
            pad[:n - start] = src[start - sent:]
            p.index_copy_(0, ids.to(p.device), pad.view(nblocks - first, bs, -1).to(p.device))
        views = c.slot_views(op.slot)
        for k, v in enumerate(views):
            spec = h.buffers[nm + k]
            v.copy_(_tensor(got.frames[nm + k], spec, v.dtype, tuple(v.shape)))
        at = nm + len(views)
        if len(h.buffers) > at and self._same_draft(h):   # else: drafts from later context
            pages = self.draft.pages
            ctx = [_tensor(got.frames[at + i], h.buffers[at + i], p.dtype,
                           (n - sent, p.shape[-1])) for i, p in enumerate(pages)]
            ctx.append(_tensor(got.frames[at + len(pages)], h.buffers[at + len(pages)],
                               torch.uint8, (n - sent,)))
            self.draft.import_context(op.block_ids, start, n, ctx, sent)
        self.times.receive_seconds += time.perf_counter() - began


def _tensor(frame: memoryview, spec: BufferSpec, dtype: torch.dtype, shape: tuple[int, ...]
            ) -> torch.Tensor:
    if spec.dtype != str(dtype).removeprefix("torch.") or tuple(spec.shape) != shape:
        raise TransferRefused(f"buffer {spec.name} is {spec.dtype} {spec.shape}; this instance "
                              f"needs {dtype} {list(shape)}")
    if frame.readonly:            # torch wants a writable buffer; the bytes are copied anyway
        frame = memoryview(bytearray(frame))
    return torch.frombuffer(frame, dtype=torch.uint8).view(dtype).view(shape)
