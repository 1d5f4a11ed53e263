"""The token layout of one forward pass, shared by every layer.

Sequences are packed back to back into T rows. The first `num_decode` sequences are decode rows
(a few new tokens with context in the cache: one, or with speculation the last token and its
drafts, run through the KDA recurrence keeping the state after each position); the rest are
prefill rows (chunks of prompts, or whole sequences when there is no cache). Every gather
index a layer needs is built once per step by the builders in kdaserve/model/layout/ (packed
rows, KDA rows and conv windows, MLA pages and masks, the snapshot plan), vectorised, so a
layer's forward is a handful of batched tensor ops. What the layers hand back beyond their
output (states kept for rollback and snapshots) goes in `LayerOutputs`.

Legend: T tokens, B sequences (Bd decode, Bp prefill), K conv kernel, C KDA chunk size,
L padded length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kdaserve.model.hybrid_cache import HybridCache
from kdaserve.model.layout.kda import DecodeLayout, KDALayout, kda_layout
from kdaserve.model.layout.mla import MLALayout, mla_layout
from kdaserve.model.layout.rows import ConvRows, PackedRows
from kdaserve.model.layout.snapshots import SnapshotAt, SnapshotPlan, snapshot_plan


@dataclass
class LayerOutputs:
    """Filled by the KDA layers during the forward, by kda_index."""

    # multi-token decode rows: the state / conv window after each position (speculative
    # rollback reads them: kdaserve/model/kept_states.py)
    decode_states: dict[int, torch.Tensor] = field(default_factory=dict)   # [Bd, Ld, H, K, V]
    decode_windows: dict[int, torch.Tensor] = field(default_factory=dict)  # [Bd*Ld, K-1, C]
    # prefill rows: the state at each chunk end, when a snapshot needs an interior one
    chunk_states: dict[int, torch.Tensor] = field(default_factory=dict)   # [Bp, L/C, H, K, V]


@dataclass
class ForwardBatch:
    seq_lens: list[int]
    context_lens: list[int]
    num_decode: int
    positions: torch.Tensor                 # [T]
    kda: KDALayout
    mla: MLALayout
    num_decode_tokens: int = 0
    decode: DecodeLayout | None = None      # set when a decode row has several tokens
    out: LayerOutputs = field(default_factory=LayerOutputs)
    cache: HybridCache | None = None
    state_slots: torch.Tensor | None = None  # [B] KDA slot of each sequence
    has_initial_state: torch.Tensor | None = None  # [B] float 1/0: read the slot or start at 0
    num_fresh: int = 0                              # sequences starting from zero state
    logits_indices: torch.Tensor | None = None     # [S] rows whose logits are wanted
    keep_chunk_states: bool = False          # return KDA states at chunk ends (snapshots)
    snapshots: SnapshotPlan | None = None
    cu_seqlens: torch.Tensor | None = None   # [B+1] token offsets of the sequences
    # a device-resident decode step: layers take no path that reads a tensor back to the
    # host (the MoE routes without its expert counts; kdaserve/engine/decode_inputs.py)
    sync_free: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def build_forward_batch(
    seq_lens: list[int],
    context_lens: list[int] | None = None,
    *,
    num_decode: int = 0,
    conv_kernel: int = 4,
    chunk_size: int = 16,
    cache: HybridCache | None = None,
    block_tables: list[list[int]] | torch.Tensor | None = None,
    state_slots: list[int] | torch.Tensor | None = None,
    logits_indices: list[int] | torch.Tensor | None = None,
    keep_chunk_states: bool = False,
    snapshots: list[SnapshotAt] | None = None,
    device: torch.device | str = "cpu",
    positions: torch.Tensor | None = None,
    sync_free: bool = False,
    decode_width: int | None = None,
) -> ForwardBatch:
    """Build every index of a step. Without a cache all context lengths must be 0. Every
    size is taken from the Python lists, so building never waits on the device. A decode
    step's persistent inputs come as tensors: `positions` [T], `state_slots` [B] and
    `block_tables` [B, width] (kdaserve/engine/decode_inputs.py); `decode_width`: see
    layout/mla.py (a captured decode graph)."""
    device = torch.device(device)
    B = len(seq_lens)
    ctx_list = list(context_lens) if context_lens is not None else [0] * B
    if cache is None and any(ctx_list):
        raise ValueError("a forward without a cache cannot continue sequences (context_lens > 0)")
    if any(n <= 0 for n in seq_lens):
        raise ValueError("every sequence in a batch needs at least one token")
    if any(ctx_list[i] <= 0 for i in range(num_decode)):
        raise ValueError("decode rows continue a sequence: they need context")
    rows = PackedRows.build(seq_lens, ctx_list, num_decode, device, positions)
    conv = ConvRows(B, conv_kernel - 1, rows.num_tokens)
    kda, decode = kda_layout(rows, conv, seq_lens, ctx_list, chunk_size)
    mla = mla_layout(rows, seq_lens, ctx_list, cache.block_size if cache is not None else None,
                     block_tables, decode_width)
    li = None
    if logits_indices is not None:
        li = torch.as_tensor(logits_indices, dtype=torch.long, device=device)
    plan = None
    if snapshots:
        plan = snapshot_plan(snapshots, rows, conv, seq_lens, ctx_list, chunk_size)
        keep_chunk_states = keep_chunk_states or plan.interior
    slots = has_init = None
    if state_slots is not None:
        slots = (state_slots if isinstance(state_slots, torch.Tensor)
                 else torch.tensor(state_slots, dtype=torch.long, device=device))
        has_init = (rows.ctx > 0).to(torch.float32)
    return ForwardBatch(
        seq_lens=list(seq_lens), context_lens=ctx_list, num_decode=num_decode,
        positions=rows.positions, kda=kda, mla=mla, num_decode_tokens=rows.num_decode_tokens,
        decode=decode, cache=cache, state_slots=slots, has_initial_state=has_init,
        num_fresh=sum(1 for c in ctx_list if c == 0), logits_indices=li,
        keep_chunk_states=keep_chunk_states, snapshots=plan, cu_seqlens=rows.cu,
        sync_free=sync_free,
    )
