"""The token layout of one forward pass, shared by every layer.

Sequences are packed back to back into T rows. The first `num_decode` sequences are decode rows
(a few new tokens with context in the cache: one, or with speculation the last token and its
drafts, run through the KDA recurrence keeping the state after each position); the rest are
prefill rows (chunks of prompts, or whole sequences when there is no cache). All gather indices are built once here,
vectorised, so a layer's forward is a handful of batched tensor ops.

Legend: T tokens, B sequences (Bd decode, Bp prefill), K conv kernel, C KDA chunk size,
L padded length, D latent width.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from kdaserve.ops import mla as mla_ops


@dataclass
class HybridCache:
    """The engine's cache tensors, as the model sees them (owned and sized by the runner).

    mla_pages[i]: [num_blocks, block_size, kv_lora_rank + rope_dim] for the i-th MLA layer.
    kda_states[i]: [num_slots, H, K, V] fp32; kda_conv[i]: [num_slots, conv_kernel - 1, 3*H*K].
    """

    mla_pages: list[torch.Tensor]
    kda_states: list[torch.Tensor]
    kda_conv: list[torch.Tensor]
    block_size: int
    snap_states: list[torch.Tensor] = field(default_factory=list)  # [num_snapshots, H, K, V]
    snap_conv: list[torch.Tensor] = field(default_factory=list)    # [num_snapshots, K-1, 3HK]
    # One layer's worth of live states, reused by every KDA layer in turn: gathering the slots
    # into fresh memory each layer costs page faults that dominate a decode step on CPU.
    state_scratch: torch.Tensor | None = None                        # [num_slots, H, K, V]

    @classmethod
    def allocate(cls, cfg, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 num_snapshots: int = 0) -> HybridCache:
        """Zeroed cache tensors for a ModelConfig `cfg`."""
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        km1 = cfg.conv_kernel_size - 1
        return cls(
            mla_pages=[torch.zeros(num_blocks, block_size, cfg.mla_latent_dim, dtype=dtype,
                                   device=device) for _ in cfg.mla_layers],
            kda_states=[torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=device)
                        for _ in cfg.kda_layers],
            kda_conv=[torch.zeros(num_slots, cfg.conv_kernel_size - 1, cfg.kda_conv_dim,
                                  dtype=dtype, device=device) for _ in cfg.kda_layers],
            block_size=block_size,
            snap_states=[torch.zeros(num_snapshots, h, d, d, dtype=torch.float32, device=device)
                         for _ in cfg.kda_layers] if num_snapshots else [],
            snap_conv=[torch.zeros(num_snapshots, km1, cfg.kda_conv_dim, dtype=dtype,
                                   device=device) for _ in cfg.kda_layers] if num_snapshots else [],
            state_scratch=torch.empty(num_slots, h, d, d, dtype=torch.float32, device=device)
            if cfg.kda_layers else None,
        )

    def restore(self, slots: torch.Tensor, snapshot_ids: torch.Tensor) -> None:
        """Load snapshots into live state slots (prefix-cache hits), every KDA layer."""
        for st, cv, sst, scv in zip(self.kda_states, self.kda_conv, self.snap_states,
                                    self.snap_conv):
            st.index_copy_(0, slots, sst.index_select(0, snapshot_ids))
            cv.index_copy_(0, slots, scv.index_select(0, snapshot_ids))

    # Views of one cache entry, in the fixed order the offload tiers store them in
    # (kdaserve/engine/cache_ops.py): writing into the views writes the cache.
    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One MLA block: [block_size, D] per MLA layer."""
        return [p[block_id] for p in self.mla_pages]

    def snapshot_views(self, snapshot_id: int) -> list[torch.Tensor]:
        """One KDA snapshot: [H, K, V] per KDA layer, then [K-1, 3HK] per KDA layer."""
        return ([s[snapshot_id] for s in self.snap_states]
                + [c[snapshot_id] for c in self.snap_conv])

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """One live KDA slot, laid out like a snapshot (a tier snapshot loads straight in)."""
        return [s[slot] for s in self.kda_states] + [c[slot] for c in self.kda_conv]

    def commit_decode(self, fb: ForwardBatch, rows: torch.Tensor, upto: torch.Tensor,
                      slots: torch.Tensor) -> None:
        """Roll multi-token decode rows back: the state and conv window after position `upto`
        of decode row `rows` (kept by the forward) become the slot's, every KDA layer."""
        self._copy_decode(fb, rows, upto, slots, self.kda_states, self.kda_conv)

    def snapshot_decode(self, fb: ForwardBatch, rows: torch.Tensor, upto: torch.Tensor,
                        snapshot_ids: torch.Tensor) -> None:
        """Save the kept state after position `upto` of decode row `rows` as snapshots."""
        self._copy_decode(fb, rows, upto, snapshot_ids, self.snap_states, self.snap_conv)

    def _copy_decode(self, fb: ForwardBatch, rows: torch.Tensor, upto: torch.Tensor,
                     dest: torch.Tensor, states: list[torch.Tensor],
                     convs: list[torch.Tensor]) -> None:
        assert fb.decode is not None
        ld = fb.decode.pad_src.shape[1]
        for i, (st, cv) in enumerate(zip(states, convs)):
            st.index_copy_(0, dest, fb.decode_states[i][rows, upto].to(st.dtype))
            cv.index_copy_(0, dest, fb.decode_windows[i][rows * ld + upto].to(cv.dtype))


@dataclass
class KDALayout:
    # per run of sequences (decode rows, prefill rows): ([b, K-1+Lc] rows of
    # cat(window.view(B*(K-1), C), x, 0), [t] flat rows of that run's conv output [b*Lc] or
    # None when every sequence of the run has length Lc)
    conv_groups: list[tuple[torch.Tensor, torch.Tensor | None]]
    conv_state_idx: torch.Tensor    # [B, K-1] rows of the same, the window after this step
    pad_src: torch.Tensor           # [Bp, L] rows of prefill tokens (Tp = a zero row)
    unpad_idx: torch.Tensor         # [Tp] flat rows of the padded [Bp*L] layout, packed order
    padded_len: int
    pad_is_reshape: bool = False    # equal lengths, no alignment pad: [Tp] -> [Bp, L] is a view


@dataclass
class DecodeLayout:
    """Decode rows with more than one token (verification of drafts): a padded [Bd, Ld] view."""

    pad_src: torch.Tensor           # [Bd, Ld] rows of decode tokens (Td = a zero row)
    unpad_idx: torch.Tensor         # [Td] flat rows of [Bd*Ld], packed order
    window_idx: torch.Tensor        # [Bd*Ld, K-1] conv-window rows after each position


@dataclass
class SnapshotPlan:
    """KDA states to save at block boundaries during this forward (prefix-cache snapshots)."""

    dest: torch.Tensor          # [S] snapshot ids
    seq: torch.Tensor           # [S] batch index of the sequence
    final: torch.Tensor         # [S] bool: the boundary is the end of this step's chunk
    chunk: torch.Tensor         # [S] index into the prefill row's chunk states (when not final)
    window_idx: torch.Tensor    # [S, K-1] conv-window rows (rows of the conv input `ext`)


@dataclass
class MLALayout:
    """Past the dense size limits of kdaserve.ops.mla the dense masks are not built (they grow
    with the context) and layers attend in blocks from the lengths instead."""

    slot_mapping: torch.Tensor | None      # [T] flat cache row for each new token
    decode_ctx_blocks: torch.Tensor | None  # [Td, Wd] cache blocks (one query per token)
    decode_ctx_mask: torch.Tensor | None    # [Td, Wd*block_size] bool (None: blockwise)
    prefill_q_idx: torch.Tensor            # [Bp, Qp] rows of prefill tokens (Tp = zero row)
    prefill_unpad_idx: torch.Tensor        # [Tp] flat rows of [Bp*Qp]
    prefill_ctx_blocks: torch.Tensor | None  # [Bp, Wp] cache blocks (None: no cache)
    prefill_mask: torch.Tensor | None      # [Bp, 1, Qp, Lp] bool (Lp = Wp*block_size with a
                                           # cache), None when plainly causal or blockwise
    decode_kv_lens: torch.Tensor | None = None    # [Td] keys each decode query sees
    prefill_ctx_lens: torch.Tensor | None = None  # [Bp] cached tokens before each chunk
    decode_blockwise: bool = False         # split-K over the page table (no decode_ctx_mask)
    prefill_blockwise: bool = False        # context tiles + online softmax (no prefill_mask)
    # fresh prompts of one length: the keys are the first Qp cache rows and the mask is plain
    # causal, so none is built and the attention skips the future (half the work of a mask)
    prefill_causal: bool = False


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
    # filled by KDA layers for multi-token decode rows: state / conv window after each position
    decode_states: dict[int, torch.Tensor] = field(default_factory=dict)   # [Bd, Ld, H, K, V]
    decode_windows: dict[int, torch.Tensor] = field(default_factory=dict)  # [Bd*Ld, K-1, C]
    cache: HybridCache | None = None
    state_slots: torch.Tensor | None = None  # [B] KDA slot of each sequence
    has_initial_state: torch.Tensor | None = None  # [B] float 1/0: read the slot or start at 0
    num_fresh: int = 0                              # sequences starting from zero state
    logits_indices: torch.Tensor | None = None     # [S] rows whose logits are wanted
    keep_chunk_states: bool = False          # return KDA states at chunk ends (snapshots)
    chunk_states: dict[int, torch.Tensor] = field(default_factory=dict)  # filled by KDA layers
    snapshots: SnapshotPlan | None = None
    cu_seqlens: torch.Tensor | None = None   # [B+1] token offsets of the sequences

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.long, device=device)


def build_forward_batch(
    seq_lens: list[int],
    context_lens: list[int] | None = None,
    *,
    num_decode: int = 0,
    conv_kernel: int = 4,
    chunk_size: int = 16,
    cache: HybridCache | None = None,
    block_tables: list[list[int]] | None = None,
    state_slots: list[int] | None = None,
    logits_indices: list[int] | torch.Tensor | None = None,
    keep_chunk_states: bool = False,
    snapshots: list[tuple[int, int, int]] | None = None,
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Build every index of a step. Without a cache all context lengths must be 0."""
    device = torch.device(device)
    B = len(seq_lens)
    ctx_list = list(context_lens) if context_lens is not None else [0] * B
    if cache is None and any(ctx_list):
        raise ValueError("a forward without a cache cannot continue sequences (context_lens > 0)")
    if any(n <= 0 for n in seq_lens):
        raise ValueError("every sequence in a batch needs at least one token")
    if any(ctx_list[i] <= 0 for i in range(num_decode)):
        raise ValueError("decode rows continue a sequence: they need context")
    lens = torch.tensor(seq_lens, dtype=torch.long, device=device)
    ctx = torch.tensor(ctx_list, dtype=torch.long, device=device)
    cu = torch.zeros(B + 1, dtype=torch.long, device=device)
    cu[1:] = lens.cumsum(0)
    T = int(cu[-1])
    seq_of = torch.repeat_interleave(_arange(B, device), lens)           # [T]
    local = _arange(T, device) - cu[seq_of]                               # [T]
    positions = ctx[seq_of] + local

    # ---- KDA: conv windows -----------------------------------------------------------------
    km1 = conv_kernel - 1
    Td = int(cu[num_decode])
    conv_groups = []
    for r0, r1 in ((0, num_decode), (num_decode, B)):
        if r1 == r0:
            continue
        g_lens = lens[r0:r1]
        lc = int(g_lens.max())
        jc = _arange(km1 + lc, device) - km1                              # [K-1+Lc]
        rows_g = _arange(r1 - r0, device)[:, None] + r0
        pad_idx = torch.where(
            jc[None] < 0, rows_g * km1 + km1 + jc[None],
            torch.where(jc[None] < g_lens[:, None], B * km1 + cu[r0:r1, None] + jc[None],
                        torch.full((r1 - r0, km1 + lc), B * km1 + T, dtype=torch.long,
                                   device=device)))
        t0, t1 = int(cu[r0]), int(cu[r1])
        unpad = None
        if bool((g_lens != lc).any()):
            unpad = (seq_of[t0:t1] - r0) * lc + local[t0:t1]
        conv_groups.append((pad_idx, unpad))
    offs = lens[:, None] - km1 + _arange(km1, device)[None]               # [B, K-1]
    conv_state_idx = torch.where(offs >= 0, B * km1 + cu[:-1][:, None] + offs,
                                 _arange(B, device)[:, None] * km1 + km1 + offs)

    # ---- decode rows with several tokens: padded [Bd, Ld] for the recurrence ---------------
    decode = None
    if num_decode and Td > num_decode:
        d_lens = lens[:num_decode]
        ld = int(d_lens.max())
        jd = _arange(ld, device)
        d_valid = jd[None] < d_lens[:, None]
        d_pad_src = torch.where(d_valid, cu[:num_decode, None] + jd[None],
                                torch.full((num_decode, ld), Td, dtype=torch.long, device=device))
        d_unpad = seq_of[:Td] * ld + local[:Td]
        b_of = _arange(num_decode, device).repeat_interleave(ld)                # [Bd*Ld]
        offs = (jd + 1).repeat(num_decode)[:, None] - km1 + _arange(km1, device)[None]
        d_window = torch.where(offs >= 0, B * km1 + cu[b_of][:, None] + offs,
                               b_of[:, None] * km1 + km1 + offs).clamp(max=B * km1 + T)
        decode = DecodeLayout(d_pad_src, d_unpad, d_window)

    # ---- prefill rows: padded layouts for KDA chunks and MLA queries -----------------------
    p_lens, p_ctx, p_cu = lens[num_decode:], ctx[num_decode:], cu[num_decode:] - Td
    Bp = B - num_decode
    Tp = T - Td
    p_seq = seq_of[Td:] - num_decode                                      # [Tp]
    p_local = local[Td:]
    pre = p_ctx % chunk_size                                              # align chunks to C
    padded_len = 0
    if Bp:
        padded_len = int(((pre + p_lens).max() + chunk_size - 1) // chunk_size * chunk_size)
    jj = _arange(padded_len, device)
    loc = jj[None] - pre[:, None]                                         # [Bp, L]
    valid = (loc >= 0) & (loc < p_lens[:, None])
    pad_src = torch.where(valid, p_cu[:-1, None] + loc, torch.full_like(loc, Tp))
    unpad_idx = p_seq * padded_len + pre[p_seq] + p_local
    pad_is_reshape = bool(Bp and (pre == 0).all() and (p_lens == padded_len).all())
    kda = KDALayout(conv_groups, conv_state_idx, pad_src, unpad_idx, padded_len,
                    pad_is_reshape)

    q_len = int(p_lens.max()) if Bp else 0
    qi = _arange(q_len, device)
    q_valid = qi[None] < p_lens[:, None]                                  # [Bp, Qp]
    prefill_q_idx = torch.where(q_valid, p_cu[:-1, None] + qi[None], torch.full((Bp, q_len), Tp,
                                dtype=torch.long, device=device))
    prefill_unpad_idx = p_seq * q_len + p_local

    slot_mapping = decode_ctx_blocks = decode_ctx_mask = prefill_ctx_blocks = prefill_mask = None
    decode_kv_lens = prefill_ctx_lens = None
    decode_blockwise = prefill_blockwise = prefill_causal = False
    if cache is not None:
        bs = cache.block_size
        if block_tables is None:
            raise ValueError("block_tables are required with a cache")
        bt = _block_table(block_tables, device)                           # [B, width]
        width = bt.shape[1]
        blk = (positions // bs).clamp(max=width - 1)
        slot_mapping = bt[seq_of, blk] * bs + positions % bs
        # context is read whole blocks at a time: a gather of block_size rows per index
        if num_decode:
            decode_kv_lens = positions[:Td] + 1
            wd = int((decode_kv_lens.max() + bs - 1) // bs)
            # index_select: advanced indexing with a trailing slice takes a slow path that
            # costs milliseconds at 1M-token page tables
            decode_ctx_blocks = bt[:, :wd].index_select(0, seq_of[:Td])
            decode_blockwise = Td * wd * bs > mla_ops.DENSE_MAX_DECODE_KEYS
            if not decode_blockwise:
                decode_ctx_mask = _arange(wd * bs, device)[None] < decode_kv_lens[:, None]
        if Bp:
            total = p_ctx + p_lens
            wp = int((total.max() + bs - 1) // bs)
            prefill_ctx_blocks = bt[num_decode:, :wp]
            prefill_ctx_lens = p_ctx
            prefill_blockwise = Bp * q_len * wp * bs > mla_ops.DENSE_MAX_SCORES
            prefill_causal = (not prefill_blockwise
                              and all(c == 0 for c in ctx_list[num_decode:])
                              and len(set(seq_lens[num_decode:])) == 1)
            if not (prefill_blockwise or prefill_causal):
                jk = _arange(wp * bs, device)
                qpos = p_ctx[:, None] + qi[None]                          # [Bp, Qp]
                mask = jk[None, None, :] <= qpos[:, :, None]              # [Bp, Qp, Lp]
                mask = mask & q_valid[:, :, None] | (~q_valid[:, :, None] & (jk == 0)[None, None])
                prefill_mask = mask[:, None]
    elif Bp and Bp * q_len * q_len > mla_ops.DENSE_MAX_SCORES:
        prefill_blockwise = True
    elif Bp and bool((p_lens != p_lens[0]).any()):
        mask = qi[None, None, :] <= qi[None, :, None]                     # causal [1, Qp, Qp]
        kv_valid = q_valid[:, None, :]
        mask = ((mask & kv_valid & q_valid[:, :, None])
                | (~q_valid[:, :, None] & (qi == 0)[None, None]))
        prefill_mask = mask[:, None]
    mla = MLALayout(slot_mapping, decode_ctx_blocks, decode_ctx_mask, prefill_q_idx,
                    prefill_unpad_idx, prefill_ctx_blocks, prefill_mask, decode_kv_lens,
                    prefill_ctx_lens, decode_blockwise, prefill_blockwise, prefill_causal)

    li = None
    if logits_indices is not None:
        li = torch.as_tensor(logits_indices, dtype=torch.long, device=device)
    plan = None
    if snapshots:
        plan = _snapshot_plan(snapshots, lens, ctx, cu, pre, chunk_size, km1, num_decode, B, device)
        keep_chunk_states = keep_chunk_states or not bool(plan.final.all())
    slots = has_init = None
    if state_slots is not None:
        slots = torch.tensor(state_slots, dtype=torch.long, device=device)
        has_init = (ctx > 0).to(torch.float32)
    return ForwardBatch(
        seq_lens=list(seq_lens), context_lens=ctx_list, num_decode=num_decode,
        positions=positions, kda=kda, mla=mla, num_decode_tokens=Td, decode=decode,
        cache=cache, state_slots=slots,
        has_initial_state=has_init, num_fresh=sum(1 for c in ctx_list if c == 0),
        logits_indices=li, keep_chunk_states=keep_chunk_states, snapshots=plan, cu_seqlens=cu,
    )


def _block_table(block_tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[B, width] block ids, rows right-padded with block 0. Built through array('q') because
    it is rebuilt every step and a 1M-token request holds 65536 blocks: torch.tensor over
    Python ints costs ~10x more (milliseconds per step, a real share of a decode step)."""
    width = max(1, max((len(t) for t in block_tables), default=1))
    flat = array("q")
    zero = array("q", [0])
    for t in block_tables:
        flat.extend(t)
        flat.extend(zero * (width - len(t)))
    return torch.frombuffer(flat, dtype=torch.long).view(len(block_tables), width).to(device)


def _snapshot_plan(snapshots: list[tuple[int, int, int]], lens: torch.Tensor, ctx: torch.Tensor,
                   cu: torch.Tensor, pre: torch.Tensor, chunk_size: int, km1: int,
                   num_decode: int, B: int, device: torch.device) -> SnapshotPlan:
    seq = torch.tensor([b for b, _, _ in snapshots], dtype=torch.long, device=device)
    pos = torch.tensor([p for _, p, _ in snapshots], dtype=torch.long, device=device)
    dest = torch.tensor([d for _, _, d in snapshots], dtype=torch.long, device=device)
    upto = pos - ctx[seq]                                  # tokens of this step before p
    if bool(((upto <= 0) | (upto > lens[seq])).any()):
        raise ValueError("snapshot positions must fall inside the sequence's tokens of the step")
    final = upto == lens[seq]
    interior = ~final
    if bool((interior & (seq < num_decode)).any()):
        raise ValueError("decode rows can only snapshot their final state")
    chunk = torch.zeros_like(seq)
    if bool(interior.any()):
        p_seq = (seq - num_decode).clamp(min=0)
        into = upto + pre[p_seq]                           # padded rows up to p
        if bool((interior & (into % chunk_size != 0)).any()):
            raise ValueError("interior snapshots must sit on KDA chunk boundaries")
        chunk = torch.where(interior, into // chunk_size - 1, chunk)
    offs = upto[:, None] - km1 + torch.arange(km1, device=device)[None]
    window_idx = torch.where(offs >= 0, B * km1 + cu[seq][:, None] + offs,
                             seq[:, None] * km1 + km1 + offs)
    return SnapshotPlan(dest, seq, final, chunk, window_idx)
